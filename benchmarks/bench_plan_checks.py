#!/usr/bin/env python
"""Host cost of what a plan launch checks and records, side by side in one run.

Goal: the address check and version bumps of a kernels.adam launch cost little
per tensor (the 20,000 x 12,800 plan within 1.5x of its GPU floor). Judged by
the checked launch's wall time per call over the baseline's (no address check,
no version bump), the host time of one call and the ns per tensor of each part.
On the CPU the call runs the update too: tensors are tiny there.

    python benchmarks/bench_plan_checks.py --device cpu
    python benchmarks/bench_plan_checks.py --device cuda [--tensors 20000 --numel 12800] [--views]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from shardadam import kernels
from timing import interleaved, median_ms, sync, time_wall_and_host

HYPER = dict(lr=1e-3, step=1, weight_decay=0.01)


def make_lists(n: int, numel: int, device: str, views: bool) -> list[list[torch.Tensor]]:
    if views:
        flats = [torch.randn(n * numel, device=device) for _ in range(2)] + \
                [torch.zeros(n * numel, device=device) for _ in range(2)]
        flats[3].fill_(1e-4)
        return [list(f.view(n, numel).unbind(0)) for f in flats]
    p, g = ([torch.randn(numel, device=device) for _ in range(n)] for _ in range(2))
    m = [torch.zeros(numel, device=device) for _ in range(n)]
    v = [torch.full((numel,), 1e-4, device=device) for _ in range(n)]
    return [p, g, m, v]


def median_ns(fn, reps: int, device: str, sync_each: bool) -> float:
    """Median host nanoseconds of one call (from an idle device when sync_each)."""
    return median_ms(fn, device if sync_each else "cpu", reps, sync_after=False) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tensors", type=int, default=20000, help="parameters in the plan (default 20000)")
    ap.add_argument("--numel", type=int, default=None,
                    help="elements per tensor (default 12800 on cuda, 16 on cpu, where the call runs the update)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per case (default 40 on cuda, 20 on cpu)")
    ap.add_argument("--views", action="store_true", help="tensors are views of flat buffers (one base per list)")
    args = ap.parse_args()
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU")
    n = args.tensors
    numel = args.numel or (12800 if dev == "cuda" else 16)
    reps = args.reps or (40 if dev == "cuda" else 20)

    lists = make_lists(n, numel, dev, args.views)
    base = kernels.AdamPlan(*lists, check_addresses=False)
    base._roots = []  # no version bump: the launch as it was before
    checked = kernels.AdamPlan(*lists)
    watched, roots = len(checked._watched), len(checked._roots)

    def launch(plan):
        return lambda: kernels.adam(plan, **HYPER)

    for plan in (base, checked):  # warm up
        for _ in range(3):
            launch(plan)()
    rounds = interleaved({name: (lambda plan=plan: median_ns(launch(plan), max(reps // 5, 1), dev, sync_each=True))
                          for name, plan in (("base", base), ("checked", checked))}, 5)
    t_base, t_checked = statistics.median(rounds["base"]), statistics.median(rounds["checked"])
    walls = interleaved({name: (lambda plan=plan: time_wall_and_host(launch(plan), dev, reps, warmup=2)[0])
                         for name, plan in (("base", base), ("checked", checked))}, 5)
    w_base, w_checked = statistics.median(walls["base"]), statistics.median(walls["checked"])
    t_check = median_ns(checked._check_launch, reps, dev, sync_each=False)
    t_bump = median_ns(checked._bump_versions, reps, dev, sync_each=False)
    sync(dev)

    print(f"device {dev}, torch {torch.__version__}, {n} parameters x {numel} elements, "
          f"{'views of flat buffers' if args.views else 'separate tensors'}: "
          f"{watched} tensors checked, {roots} version counters bumped per launch")
    print(f"{'kernels.adam(plan) host time':34s} {'baseline':>12s} {'checked':>12s} {'ratio':>7s} "
          f"{'added/param':>12s}")
    print(f"{'per call':34s} {t_base / 1e3:10.1f}us {t_checked / 1e3:10.1f}us {t_checked / t_base:7.2f} "
          f"{(t_checked - t_base) / n:10.1f}ns")
    print(f"{'per call, back to back (wall)':34s} {w_base * 1e3:10.1f}us {w_checked * 1e3:10.1f}us "
          f"{w_checked / w_base:7.2f}")
    print("parts, timed alone:")
    print(f"  address check  {t_check / 1e3:10.1f}us per launch = {t_check / n:6.1f} ns per parameter, "
          f"{t_check / max(watched, 1):6.1f} ns per tensor checked")
    print(f"  version bump   {t_bump / 1e3:10.1f}us per launch = {t_bump / n:6.1f} ns per parameter, "
          f"{t_bump / max(roots, 1):6.1f} ns per counter bumped")
    if dev == "cpu":
        print("(on the CPU the call includes the update itself; the parts timed alone are the added host cost)")


if __name__ == "__main__":
    main()
