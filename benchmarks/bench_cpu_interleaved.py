#!/usr/bin/env python
"""CPU Adam steps taken in turn with torch's: what a training loop sees.

Goal (issue 2, CPU): shardadam's step at least as fast as torch fused AdamW's
when each step starts right after torch's own CPU ops, whose OpenMP workers
keep spinning for a while after each parallel region (libgomp's default wait
policy) on the same cores. Judged by the speedup: torch fused's median ms
over shardadam's (kernels.adam on a plan), the two stepping in turn, each on
its own tensors.

    python benchmarks/bench_cpu_interleaved.py
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_cpu_interleaved.py   # torch's workers sleep at once
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from harness import md_table
from shardadam import kernels

CASES = [(64, 2 ** 19), (20_000, 1000)]  # bench_kernels.py's two CPU cases
QUICK = [(16, 2 ** 12), (200, 100)]


def tensors(count: int, numel: int, generator) -> list[torch.Tensor]:
    return [torch.randn(numel, generator=generator) for _ in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help=f"small cases for a smoke run: {QUICK}")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    rows = []
    for count, numel in QUICK if args.quick else CASES:
        plan = kernels.AdamPlan(tensors(count, numel, g), tensors(count, numel, g), tensors(count, numel, g),
                                [t.abs() for t in tensors(count, numel, g)])
        params = [torch.nn.Parameter(t) for t in tensors(count, numel, g)]
        for p, grad in zip(params, tensors(count, numel, g)):
            p.grad = grad
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
        ours, theirs = [], []
        for i in range(args.reps + 3):
            start = time.perf_counter()
            opt.step()
            middle = time.perf_counter()
            kernels.adam(plan, lr=1e-3, step=i + 1, weight_decay=0.01)
            theirs.append(middle - start)
            ours.append(time.perf_counter() - middle)
        o, t = statistics.median(ours[3:]) * 1e3, statistics.median(theirs[3:]) * 1e3
        rows.append([f"fp32, {count} x {numel}", f"{o:.3f}", f"{t:.3f}", f"{t / o:.2f}x"])
        del plan, params, opt
    print(md_table(["case", "shardadam ms", "torch fused ms", "speedup"], rows))


if __name__ == "__main__":
    main()
