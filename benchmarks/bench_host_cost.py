#!/usr/bin/env python
"""Host cost of what the optimizers check and hand over around a step, one case per subcommand.

- ab: the trust checks (README "Guarantees") cost real models nothing measurable. Judged by "this / against": each
  case's median host time per call (from an idle device) for this package over another version's (--against: its
  PYTHONPATH), in alternating child processes (A B A B ...).
- plan-checks: the address check and version bumps of a kernels.adam launch cost little per tensor (the 20,000 x
  12,800 plan within 1.5x of its GPU floor). Judged by the checked launch's wall time per call over the baseline's
  (no address check, no version bump), and the ns per tensor of each part. On the CPU the call runs the update too:
  tensors are tiny there.
- grad-handover: DistributedFusedAdam's gradient hand-over adds little host time to backward. Judged by the host us
  per parameter and per extra bucket of what the post-accumulate-grad hook runs for every parameter (GradSync.pack),
  then GradSync.finish, in a world of 1, one bucket against --buckets.
- first-use: overlap_param_sync's guard ([Note: first-use guard]) costs nothing measurable where the forward hooks
  already wait. Judged by the forward's host ms with the guard over without it, and the guard's own costs per
  parameter (best of 30 rounds over 300 CPU parameters). Variants: no overlap, hooks only, hooks and guard (as
  shipped), guard only.

    python benchmarks/bench_host_cost.py ab --device cuda --against old/python   # without --against: this one
    python benchmarks/bench_host_cost.py plan-checks --device cuda --tensors 20000 --numel 12800 [--views]
    python benchmarks/bench_host_cost.py grad-handover [--device cuda]        # 290 parameters, 57 buckets
    torchrun --nproc_per_node 2 benchmarks/bench_host_cost.py first-use      # GPT-1.4B; --tiny: CPU smoke
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardadam
from bench_kernels import LR, WD, shard_fp32
from harness import add_device_arg, add_run_args, init_distributed, md_table, say, start_gpt, write_json
from models import FULL, SIZE_KEYS, add_size_args, autocast, build_model, fill_defaults, gpt2_medium_shapes, make_batch
from shardadam import kernels
from timing import clock_ms, interleaved, median_ms, time_wall_and_host, timed_calls

SMALL = [(4,)] * 20_000


def kernel_plan(dev):
    plan = kernels.AdamPlan(*([torch.zeros(s, device=dev) for s in SMALL] for _ in range(4)))
    return lambda: kernels.adam(plan, lr=LR, step=1, weight_decay=WD)


def distributed_step(dev):
    if not dist.is_initialized():
        init_distributed(dev)
    params = [torch.nn.Parameter(torch.randn(64, 64, device=dev) * 0.02) for _ in range(290)]
    opt = shardadam.DistributedFusedAdam(params, lr=LR, weight_decay=WD, overlap_grad_sync=False)
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    step = partial(opt.step)  # a partial takes the .setup attribute a bound method refuses
    step.setup = lambda: [setattr(p, "grad", g) for p, g in zip(params, grads)]
    return step


# name -> make(dev) -> the call timed (its .setup, if any, untimed before each): FusedAdam as bench_kernels times it
AB_CASES = {"FusedAdam 20k params, grads kept": partial(shard_fp32, SMALL),
    "FusedAdam 20k params, new grads each step": partial(shard_fp32, SMALL, new_grads_each_step=True),
    "FusedAdam 20k params, flat_grads": partial(shard_fp32, SMALL, flat_grads=True),
    "FusedAdam GPT-2 medium shapes": partial(shard_fp32, gpt2_medium_shapes()),
    "kernels.adam plan of 20k tensors": kernel_plan, "DistributedFusedAdam 1 rank, 290 params": distributed_step,
}


def ab_child(args, path: str | None) -> dict:
    """One child process's medians, with `path` first on its PYTHONPATH."""
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.path.abspath(path) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "ab", "--device", args.device, "--reps", str(args.reps)]
    return json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.splitlines()[-1])


def ab(args) -> None:
    if not args.against:  # this package's medians, as one JSON line
        figures = {}
        for name, make in AB_CASES.items():
            fn = make(args.device)
            wall, host = time_wall_and_host(fn, args.device, args.reps, warmup=5, setup=getattr(fn, "setup", None))
            figures[name] = {"host_ms": host, "wall_ms": wall}
        print(json.dumps(figures))
        return
    runs = interleaved({"against": lambda: ab_child(args, args.against), "this": lambda: ab_child(args, None)},
                       args.rounds)
    rows, result = [], {}
    for name in AB_CASES:
        fig = result[name] = {f"{label}_{k}": statistics.median(r[name][k] for r in runs[label])
                              for label in runs for k in ("host_ms", "wall_ms")}
        fig["host_ratio"] = fig["this_host_ms"] / fig["against_host_ms"]
        rows.append([name] + [f"{fig[k]:.3f}" for k in ("against_host_ms", "this_host_ms")]
                    + [f"{fig['host_ratio']:.2f}x"] + [f"{fig[k]:.3f}" for k in ("against_wall_ms", "this_wall_ms")])
    print(md_table(["case", "against: host ms", "this: host ms", "this / against", "against: wall ms",
                    "this: wall ms"], rows))
    write_json(args.out, device=args.device, rounds=args.rounds, cases=result)


def plan_checks(args) -> None:
    dev, n = args.device, args.tensors
    numel = args.numel or (12800 if dev == "cuda" else 16)
    reps = args.reps or (40 if dev == "cuda" else 20)
    # parameters, gradients, exp_avg and exp_avg_sq: n tensors each, or n views of one flat buffer each
    fills = (torch.randn, torch.randn, torch.zeros, lambda *size, **kw: torch.full(size, 1e-4, **kw))
    lists = [list(fill(n * numel, device=dev).view(n, numel).unbind(0)) if args.views else
             [fill(numel, device=dev) for _ in range(n)] for fill in fills]
    base = kernels.AdamPlan(*lists, check_addresses=False)
    base._roots = []  # no version bump: the launch as it was before
    checked = kernels.AdamPlan(*lists)
    watched, roots = len(checked._watched), len(checked._roots)
    launch = {name: (lambda plan=plan: kernels.adam(plan, lr=LR, step=1, weight_decay=WD))
              for name, plan in (("baseline", base), ("checked", checked))}
    [fn() for fn in launch.values() for _ in range(3)]  # warm up
    host_us = interleaved({k: (lambda fn=fn: median_ms(fn, dev, max(reps // 5, 1), sync_after=False) * 1e3)
                           for k, fn in launch.items()}, 5)
    wall_us = interleaved({k: (lambda fn=fn: time_wall_and_host(fn, dev, reps, warmup=2)[0] * 1e3)
                           for k, fn in launch.items()}, 5)
    (t_base, t_checked), (w_base, w_checked) = ([statistics.median(r[k]) for k in launch] for r in (host_us, wall_us))
    t_check, t_bump = (median_ms(fn, "cpu", reps, sync_after=False) * 1e3
                       for fn in (checked._check_launch, checked._bump_versions))
    print(f"device {dev}, torch {torch.__version__}, {n} parameters x {numel} elements, "
          f"{'views of flat buffers' if args.views else 'separate tensors'}: "
          f"{watched} tensors checked, {roots} version counters bumped per launch")
    print(md_table(["kernels.adam(plan) host time", "baseline us", "checked us", "checked / baseline",
                    "added ns per parameter"],
                   [["per call, from an idle device", f"{t_base:.1f}", f"{t_checked:.1f}", f"{t_checked / t_base:.2f}",
                     f"{(t_checked - t_base) * 1e3 / n:.1f}"],
                    ["per call, back to back (wall)", f"{w_base:.1f}", f"{w_checked:.1f}", f"{w_checked / w_base:.2f}",
                     ""]]))
    print(f"parts, timed alone: address check {t_check:.1f} us per launch = {t_check * 1e3 / n:.1f} ns per "
          f"parameter, {t_check * 1e3 / max(watched, 1):.1f} ns per tensor checked; version bump {t_bump:.1f} us "
          f"per launch = {t_bump * 1e3 / n:.1f} ns per parameter, {t_bump * 1e3 / max(roots, 1):.1f} ns per counter")
    if dev == "cpu":
        print("(on the CPU the call includes the update itself; the parts timed alone are the added host cost)")


def handover_ms(params: list, grads: list, bucket_cap_mb: float, iters: int) -> tuple[float, int]:
    """Median host ms of one iteration's hand-over (from an idle device), and the number of buckets."""
    opt = shardadam.DistributedFusedAdam(params, bucket_cap_mb=bucket_cap_mb, overlap_grad_sync=True)
    sync = opt._grad_sync

    def hand_over() -> None:
        for k in range(len(params) - 1, -1, -1):  # the layout's first guess: backward runs last to first
            sync.pack(k, grads[k])
        sync.finish()
    return median_ms(hand_over, params[0].device, iters, 5, sync_after=False, setup=sync.reset), \
        len(opt.layout.buckets)


def grad_handover(args) -> None:
    init_distributed(args.device)
    torch.set_num_threads(1)
    params = [torch.nn.Parameter(torch.randn(args.numel, device=args.device)) for _ in range(args.params)]
    grads = [torch.randn_like(p) for p in params]
    mib = args.numel * 4 / 2**20
    one_ms, _ = handover_ms(params, grads, mib * args.params * 2, args.iters)
    many_ms, buckets = handover_ms(params, grads, mib * args.params / args.buckets, args.iters)
    print(f"{args.device}, torch {torch.__version__}, {args.params} parameters of {args.numel} elements")
    print(md_table(["buckets", "host ms per iteration", "us per parameter"],
                   [[n, f"{ms:.2f}", f"{ms * 1e3 / args.params:.1f}"] for n, ms in ((1, one_ms), (buckets, many_ms))],
                   "rrr"))
    print(f"per extra bucket: {(many_ms - one_ms) * 1e3 / max(buckets - 1, 1):.1f} us")
    dist.destroy_process_group()


VARIANTS = ("no_overlap", "hooks_only", "hooks_and_guard", "guard_only")


def first_use_run(variant: str, args, dev: torch.device, cuda: bool) -> dict:
    """Host ms of zero_grad(), the forward and step() (medians, from an idle device), and the last loss."""
    model = build_model(args, dev)
    opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-4, weight_decay=0.1,
                                         bucket_cap_mb=args.bucket_cap_mb, overlap_param_sync=variant != "no_overlap")
    if variant == "hooks_only":
        opt._first_use.arm = lambda params: None
    if variant == "guard_only":
        opt._hooks.forward.remove()
    inputs, targets = make_batch(args, args.batch, dev)

    def iteration(watch) -> torch.Tensor:
        watch.mark()
        opt.zero_grad()
        watch.mark()
        with autocast(cuda):
            logits = model(inputs)
        watch.mark()
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        watch.mark()
        opt.step()
        watch.mark()
        return loss
    laps, _, losses = timed_calls(iteration, cuda, args.iters, 3, idle=True, host=True)
    opt.param_sync()
    zero_grad, forward, _, step = (statistics.median(col) for col in zip(*laps))
    return dict(step=step, zero_grad=zero_grad, forward=forward, loss_last=losses[-1].item())


class _NoWait:
    """Lands nothing: the cost of the guard alone."""

    def land(self, params) -> None:
        pass


def guard_costs(count: int = 300, rounds: int = 30) -> dict:
    """The first-use guard's costs in microseconds per parameter, best of `rounds`."""
    from shardadam.distributed._first_use import FirstUseGuard  # here: ab's children may import an older package
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(count)]
    waits = _NoWait()  # held here: the guard keeps only a weak reference to its bound method
    guard = FirstUseGuard(waits.land)
    best = dict.fromkeys(("arm", "disarm", ".grad armed", "first use", "same op, plain"), float("inf"))

    def timed(name, fn) -> None:
        best[name] = min(best[name], clock_ms(fn) * 1e3 / count)
    for _ in range(rounds):
        timed("arm", lambda: guard.arm(params))
        timed(".grad armed", lambda: [p.grad for p in params])
        timed("first use", lambda: [p.mul(1.0) for p in params])
        timed("same op, plain", lambda: [p.mul(1.0) for p in params])
        guard.arm(params)
        timed("disarm", guard.disarm_all)
    return best


def first_use(args) -> None:
    fill_defaults(args, FULL, (*SIZE_KEYS, "bucket_cap_mb"))
    dev, cuda, _, _ = start_gpt(args)
    if dist.get_rank() == 0:
        say("guard, us per parameter: " + ", ".join(f"{k} {v:.2f}" for k, v in guard_costs().items()))
    results = {variant: first_use_run(variant, args, dev, cuda) for variant in VARIANTS}
    say(md_table(["variant", "step ms", "zero_grad ms", "forward ms", "last loss"],
                 [[v, f"{r['step']:.3f}", f"{r['zero_grad']:.3f}", f"{r['forward']:.3f}", f"{r['loss_last']:.4f}"]
                  for v, r in results.items()]))
    say(f"forward with the guard / without: "
        f"{results['hooks_and_guard']['forward'] / results['hooks_only']['forward']:.3f}x")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cases = ap.add_subparsers(dest="case", required=True)
    p = cases.add_parser("ab", help="this package's step against another version's, in child processes")
    add_device_arg(p)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--against", help="PYTHONPATH of the other package: measure both, alternating")
    p.add_argument("--rounds", type=int, default=3, help="with --against: child processes per package")
    p.add_argument("--out", help="with --against: write the table's figures here")
    p = cases.add_parser("plan-checks", help="a plan launch's address check and version bumps")
    add_device_arg(p)
    p.add_argument("--tensors", type=int, default=20000, help="parameters in the plan (default 20000)")
    p.add_argument("--numel", type=int, help="elements per tensor (default 12800 on cuda, 16 on cpu)")
    p.add_argument("--reps", type=int, help="timed calls per case (default 40 on cuda, 20 on cpu)")
    p.add_argument("--views", action="store_true", help="tensors are views of flat buffers (one base per list)")
    p = cases.add_parser("grad-handover", help="DistributedFusedAdam's gradient hand-over, one rank")
    add_device_arg(p)
    p.add_argument("--params", type=int, default=290, help="parameters (the 1.4B GPT has 290)")
    p.add_argument("--buckets", type=int, default=57, help="buckets (the 1.4B GPT has 57 at 100 MiB)")
    p.add_argument("--numel", type=int, default=1024, help="elements per parameter (host time hardly depends on it)")
    p.add_argument("--iters", type=int, default=50)
    p = cases.add_parser("first-use", help="overlap_param_sync's first-use guard, on the GPT (torchrun)")
    add_size_args(p)
    p.add_argument("--batch", type=int, default=4, help="batch size per rank")
    p.add_argument("--iters", type=int, default=10, help="timed iterations after 3 warm-up ones")
    add_run_args(p, lr=None, buckets="bucket size in MiB (default 100; --tiny 0.1)", out=None)
    args = ap.parse_args()
    {"ab": ab, "plan-checks": plan_checks, "grad-handover": grad_handover, "first-use": first_use}[args.case](args)


if __name__ == "__main__":
    main()
