"""Host cost of a step, for two versions of the Python package side by side.

Goal: the trust checks (README "Guarantees") cost real models nothing
measurable. Judged by "this / against": each case's median host time per call
(from an idle device) for this package over the other's, measured in
alternating child processes (A B A B ...); without --against, this package's
figures alone.

    python benchmarks/bench_host_ab.py --device cuda                      # this package
    python benchmarks/bench_host_ab.py --device cuda --against old/python  # both, side by side
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

from bench_fused_adam import shard_fp32
from harness import init_one_rank, md_table, write_json
from models import gpt2_medium_shapes
from timing import interleaved, time_wall_and_host

LR, WD = 1e-3, 1e-2  # as bench_fused_adam.py
SMALL = [(4,)] * 20_000


def fused_adam(shapes, dev, *, new_grads=False, flat_grads=False):
    """FusedAdam.step and its per-step setup, as bench_fused_adam.py times them."""
    step = shard_fp32(shapes, dev, new_grads_each_step=new_grads, flat_grads=flat_grads)
    return step, step.setup


def kernel_plan(shapes, dev):
    from shardadam import kernels
    ts = [[torch.zeros(s, device=dev) for s in shapes] for _ in range(4)]
    plan = kernels.AdamPlan(*ts)
    return (lambda: kernels.adam(plan, lr=LR, step=1, weight_decay=WD)), None


def distributed_step(dev):
    import torch.distributed as dist
    import shardadam
    if not dist.is_initialized():
        init_one_rank(dev)
    params = [torch.nn.Parameter(torch.randn(64, 64, device=dev) * 0.02) for _ in range(290)]
    opt = shardadam.DistributedFusedAdam(params, lr=LR, weight_decay=WD, overlap_grad_sync=False)
    grads = [torch.randn_like(p) * 1e-3 for p in params]

    def setup():
        for p, g in zip(params, grads):
            p.grad = g
    return opt.step, setup


CASES = {
    "FusedAdam 20k params, grads kept": lambda dev: fused_adam(SMALL, dev),
    "FusedAdam 20k params, new grads each step": lambda dev: fused_adam(SMALL, dev, new_grads=True),
    "FusedAdam 20k params, flat_grads": lambda dev: fused_adam(SMALL, dev, flat_grads=True),
    "FusedAdam GPT-2 medium shapes": lambda dev: fused_adam(gpt2_medium_shapes(), dev),
    "kernels.adam plan of 20k tensors": lambda dev: kernel_plan(SMALL, dev),
    "DistributedFusedAdam 1 rank, 290 params": distributed_step,
}


def measure(dev: str, reps: int) -> dict:
    out = {}
    for name, make in CASES.items():
        fn, setup = make(dev)
        wall, host = time_wall_and_host(fn, dev, reps, warmup=5, setup=setup)
        out[name] = {"host_ms": host, "wall_ms": wall}
    return out


def child(args, path: str | None) -> dict:
    """One child process's medians, with `path` first on its PYTHONPATH."""
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.path.abspath(path) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--device", args.device, "--reps", str(args.reps), "--json"]
    return json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.splitlines()[-1])


def compare(args) -> None:
    runs = interleaved({"against": lambda: child(args, args.against), "this": lambda: child(args, None)}, args.rounds)
    rows, result = [], {}
    for name in CASES:
        fig = {f"{label}_{k}": statistics.median(r[name][k] for r in runs[label])
               for label in runs for k in ("host_ms", "wall_ms")}
        fig["host_ratio"] = fig["this_host_ms"] / fig["against_host_ms"]
        result[name] = fig
        rows.append([name, f"{fig['against_host_ms']:.3f}", f"{fig['this_host_ms']:.3f}", f"{fig['host_ratio']:.2f}x",
                     f"{fig['against_wall_ms']:.3f}", f"{fig['this_wall_ms']:.3f}"])
    print(md_table(["case", "against: host ms", "this: host ms", "this / against", "against: wall ms",
                    "this: wall ms"], rows))
    write_json(args.out, device=args.device, rounds=args.rounds, cases=result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--against", help="PYTHONPATH of the other package: measure both, alternating")
    ap.add_argument("--rounds", type=int, default=3, help="with --against: child processes per package")
    ap.add_argument("--json", action="store_true", help="print this package's medians as one JSON line")
    ap.add_argument("--out", help="with --against: write the table's figures here")
    args = ap.parse_args()
    if args.against:
        compare(args)
        return
    figures = measure(args.device, args.reps)
    if args.json:
        print(json.dumps(figures))
    else:
        for name, fig in figures.items():
            print(f"{name}: {fig['host_ms']:.3f} ms host, {fig['wall_ms']:.3f} ms wall")


if __name__ == "__main__":
    main()
