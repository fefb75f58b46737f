#!/usr/bin/env python
"""bf16 parameters without a master: shardadam's AdamW step rounding to nearest
against the same step rounding stochastically (bf16_stochastic_round), and
torch's fused AdamW on the same bf16 tensors (it rounds to nearest), side by
side in one run.

shardadam's step moves 22 B per element: it reads and writes the bf16
parameter (2 + 2) and the fp32 exp_avg and exp_avg_sq (8 + 8) and reads the
bf16 gradient (2). torch keeps bf16 parameters' states in bf16: 14 B per
element (its states lose precision shardadam's keep). Effective bandwidth =
the bytes each moves / time, next to a large device-to-device copy (bytes
read + written). Stochastic rounding adds a 32-bit hash per element: the
question is whether it stays memory-bound.

    python benchmarks/bench_stochastic_rounding.py --device cuda --out sr.json
    python benchmarks/bench_stochastic_rounding.py --device cpu --numel 26
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch

import shardadam
from shardadam import kernels
from timing import time_steps

BYTES_SHARDADAM, BYTES_TORCH = 22, 14  # fp32 states; torch's bf16 states


def _tensors(numel: int, n_tensors: int, dev: str):
    sizes = [numel // n_tensors + (i < numel % n_tensors) for i in range(n_tensors)]
    params = [torch.randn(n, device=dev).to(torch.bfloat16) for n in sizes]
    grads = [torch.randn(n, device=dev).to(torch.bfloat16) for n in sizes]
    return params, grads


def _shardadam(params, grads, seed):
    dev = params[0].device
    plan = kernels.AdamPlan(params, grads, [torch.zeros(p.numel(), device=dev) for p in params],
                            [torch.zeros(p.numel(), device=dev) for p in params])
    step = iter(range(1, 1 << 30))
    return lambda: kernels.adam(plan, lr=1e-3, step=next(step), weight_decay=0.01, stochastic_rounding_seed=seed)


def _torch_fused(params, grads):
    ps = [torch.nn.Parameter(p) for p in params]
    for p, g in zip(ps, grads):
        p.grad = g
    opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True)
    return opt.step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--numel", type=int, default=30, help="log2 of the element count (default 30)")
    ap.add_argument("--tensors", default="1,200,20000", help="tensor counts, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev, numel = args.device, 1 << args.numel
    torch.manual_seed(0)
    src = torch.randn(numel // 2, device=dev)
    dst = torch.empty_like(src)
    copy_ms = statistics.median(time_steps(lambda: dst.copy_(src), dev, args.reps, 3))
    copy_gbs = 2 * src.numel() * 4 / copy_ms / 1e6
    del src, dst
    rows = []
    for n_tensors in map(int, args.tensors.split(",")):
        params, grads = _tensors(numel, n_tensors, dev)
        cases = {"shardadam, to nearest": _shardadam(params, grads, None),
                 "shardadam, stochastic": _shardadam(params, grads, 1234)}
        if dev == "cuda" or n_tensors == 1:
            cases["torch fused AdamW (to nearest)"] = _torch_fused(params, grads)
        for name, fn in cases.items():
            ms = statistics.median(time_steps(fn, dev, args.reps, 3))
            gbs = (BYTES_TORCH if name.startswith("torch") else BYTES_SHARDADAM) * numel / ms / 1e6
            rows.append(dict(tensors=n_tensors, impl=name, ms=ms, gbs=gbs, of_copy=gbs / copy_gbs))
        del params, grads, cases
    nearest = {r["tensors"]: r["ms"] for r in rows if r["impl"] == "shardadam, to nearest"}
    meta = dict(device=torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu",
                torch=torch.__version__, shardadam=shardadam.__version__, numel=numel, copy_gbs=copy_gbs,
                cpu_threads=torch.get_num_threads())
    print(f"{meta['device']}, 2^{args.numel} elements, copy {copy_gbs:.0f} GB/s")
    print("| tensors | step | ms | GB/s (bytes moved) | of copy | time / to nearest |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tensors']} | {r['impl']} | {r['ms']:.2f} | {r['gbs']:.0f} | {r['of_copy']:.2f} | "
              f"{r['ms'] / nearest[r['tensors']]:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
