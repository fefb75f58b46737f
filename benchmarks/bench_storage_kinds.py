#!/usr/bin/env python
"""shardadam's AdamW step in each storage kind, side by side in one run with torch's fused AdamW.

Goal: each kind's step at 0.85 of a device copy's bandwidth on the bytes it moves, and FusedAdam's low-bit steps at
least 3x (200 tensors) and 20x (20,000) faster than torchao's. Judged by "of copy" (and "of copy, moved" where a kind
moves more than it must) and the ms per step against torchao's rows. Bytes per element a step must move are KINDS' first
field (fp32 28, FP8 16, 8-bit blockwise 16.06, bf16 22; mixed state dtypes: _mixed_bytes).

    python benchmarks/bench_storage_kinds.py --device cuda --out kinds.json
    python benchmarks/bench_storage_kinds.py --device cpu --numel 27 --tensors 1,200
"""
from __future__ import annotations

import argparse
import statistics

import torch

import shardadam
from bench_kernels import copy_gbs as copy_gbs_of, rand, split, torch_step
from harness import run_meta, write_json
from shardadam import kernels
from timing import time_steps

F8 = torch.float8_e4m3fn
SCALED = (F8, torch.float16)  # states kept with per-tensor scales: two passes
PEERS = {"torchao": "torchao.optim", "bitsandbytes": "bitsandbytes.optim"}


def _shardadam(sizes, dev, param_dtype, state_dtype, seed=None, exp_avg_sq_dtype=None):
    """kernels.adam on a plan; exp_avg_sq_dtype: another dtype for exp_avg_sq (mixed states)."""
    dtypes = (state_dtype, exp_avg_sq_dtype or state_dtype)
    params = [torch.randn(n, device=dev).to(param_dtype) for n in sizes]
    grads = [torch.randn(n, device=dev).to(param_dtype) for n in sizes]
    states = [[torch.zeros(n, device=dev, dtype=dt) for n in sizes] for dt in dtypes]
    scales = [torch.ones(len(sizes), device=dev) if dt in SCALED else None for dt in dtypes]
    blocks = [[torch.zeros(-(-n // 256), device=dev) for n in sizes] if dt == torch.uint8 else None for dt in dtypes]
    plan = kernels.AdamPlan(params, grads, *states, exp_avg_scales=scales[0], exp_avg_sq_scales=scales[1],
                            exp_avg_absmax=blocks[0], exp_avg_sq_absmax=blocks[1])
    step = iter(range(1, 1 << 30))
    return lambda: kernels.adam(plan, lr=1e-3, step=next(step), weight_decay=0.01, stochastic_rounding_seed=seed)


def _stepped(optimizer, sizes, dev, first_steps: int, dtype=torch.float32, **options):
    """optimizer.step on parameters with gradients, after its first steps (torchao's compile). The optimizer as a whole,
    its per-step checks of parameters and gradients included, as torchao's optimizers are timed."""
    params = [torch.nn.Parameter(torch.randn(n, device=dev, dtype=dtype)) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = optimizer(params, lr=1e-3, weight_decay=0.01, **options)
    for _ in range(first_steps):
        opt.step()
    return opt.step


def _fused_adam(sizes, dev, **states):
    return _stepped(shardadam.FusedAdam, sizes, dev, 1, **states)


def _peer(module: str, optimizer: str, sizes, dev, **options):
    """A peer's low-bit AdamW (torchao's compile per parameter in its first steps)."""
    import importlib
    return _stepped(getattr(importlib.import_module(module), optimizer), sizes, dev, 3, **options)


def _imports(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # absent, or built for another torch
        return False
    return True


def _mixed_bytes(param_dtype, exp_avg_dtype, exp_avg_sq_dtype) -> tuple[int, int]:
    """(bytes per element a step must move, bytes it moves). Must: read and write the parameter and both states, read
    the gradient (of the parameter's dtype). With a scaled state the step takes two passes ([Note: params in the measure
    pass] in cpp/ops.h): the first reads everything and writes the parameter, the second reads the gradient and the
    states again and writes the states."""
    p, m, v = (torch.empty(0, dtype=d).element_size() for d in (param_dtype, exp_avg_dtype, exp_avg_sq_dtype))
    must = 2 * p + p + 2 * (m + v)
    if exp_avg_dtype not in SCALED and exp_avg_sq_dtype not in SCALED:
        return must, must
    return must, (p + p + m + v + p) + (p + 2 * (m + v))


def _mixed_kinds() -> dict:
    """The state-dtype combinations of TE and Megatron, with fp32 and with bf16
    parameters (their own master): name -> (must move, moved, builder)."""
    kinds = {}
    for pname, pdt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for sname, (m, v) in (("bf16 states", (torch.bfloat16, torch.bfloat16)),
                              ("FP8 exp_avg + fp32 exp_avg_sq", (F8, torch.float32)),
                              ("FP8 exp_avg + bf16 exp_avg_sq", (F8, torch.bfloat16)),
                              ("fp16 scaled states", (torch.float16, torch.float16))):
            must, moved = _mixed_bytes(pdt, m, v)
            kinds[f"shardadam {pname} params, {sname}"] = (
                must, moved, lambda s, d, pdt=pdt, m=m, v=v: _shardadam(s, d, pdt, m, exp_avg_sq_dtype=v))
    return kinds


MIXED = _mixed_kinds()
# Bytes per element a kind moves where it is more than it must move: the
# two passes of scaled states ([Note: params in the measure pass] in cpp/ops.h).
MOVED = {"shardadam FP8 states": 22, "FusedAdam FP8 states": 22,
         **{name: moved for name, (_, moved, _) in MIXED.items()}}
# name -> (bytes per element it must move, builder(sizes, dev))
KINDS = {"shardadam fp32": (28, lambda s, d: _shardadam(s, d, torch.float32, torch.float32)),
    "shardadam FP8 states": (16, lambda s, d: _shardadam(s, d, torch.float32, F8)),
    "shardadam 8-bit blockwise states": (16.06, lambda s, d: _shardadam(s, d, torch.float32, torch.uint8)),
    "shardadam bf16, to nearest": (22, lambda s, d: _shardadam(s, d, torch.bfloat16, torch.float32)),
    "shardadam bf16, stochastic": (22, lambda s, d: _shardadam(s, d, torch.bfloat16, torch.float32, seed=1234)),
    "torch fused fp32": (28, lambda s, d: torch_step(rand(s, d), rand(s, d), fused=True)),
    "torch fused bf16 (bf16 states)": (14, lambda s, d: torch_step(
        rand(s, d, torch.bfloat16), rand(s, d, torch.bfloat16), fused=True)),
    "FusedAdam 8-bit blockwise states": (16.06, lambda s, d: _fused_adam(
        s, d, exp_avg_dtype=shardadam.BLOCKWISE8, exp_avg_sq_dtype=shardadam.BLOCKWISE8)),
    "FusedAdam FP8 states": (16, lambda s, d: _fused_adam(s, d, exp_avg_dtype=F8, exp_avg_sq_dtype=F8)),
    "FusedAdam bf16 stochastic rounding": (22, lambda s, d: _fused_adam(
        s, d, dtype=torch.bfloat16, master_weights=False, bf16_stochastic_round=True)),
    "torchao AdamW8bit": (16.06, lambda s, d: _peer("torchao.optim", "AdamW8bit", s, d)),
    "torchao AdamWFp8": (16.06, lambda s, d: _peer("torchao.optim", "AdamWFp8", s, d)),
    "torchao bf16 stochastic rounding": (14, lambda s, d: _peer(
        "torchao.optim", "_AdamW", s, d, dtype=torch.bfloat16, bf16_stochastic_round=True)),
    "bitsandbytes AdamW8bit": (16.06, lambda s, d: _peer("bitsandbytes.optim", "AdamW8bit", s, d)),
    **{name: (must, build) for name, (must, _, build) in MIXED.items()},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--numel", type=int, default=30, help="log2 of the element count (default 30)")
    ap.add_argument("--tensors", default="1,200,20000", help="tensor counts, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3,
                    help="steps before the timed ones (torchao's builders take 3 more, which compile)")
    ap.add_argument("--kinds", default="", help="only the kinds whose names contain one of these (comma-separated)")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev, numel = args.device, 1 << args.numel
    torch.manual_seed(0)
    copy_gbs = copy_gbs_of(dev, numel // 2, args.reps, warmup=3)
    rows = []
    print("| tensors | step | B/elem | ms | GB/s | of copy | B/elem moved | of copy, moved |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for n_tensors in map(int, args.tensors.split(",")):
        sizes = split(numel, n_tensors)
        for name, (bytes_per_elem, build) in KINDS.items():
            if args.kinds and not any(k in name for k in args.kinds.split(",")):
                continue
            if name.startswith("torch") and dev == "cpu" and n_tensors > 1:
                continue  # torch's CPU fused step is per tensor: the 1-tensor row says enough
            peer = PEERS.get(name.split()[0])
            if peer and not (dev == "cuda" and _imports(peer)):
                continue
            fn = build(sizes, dev)
            ms = statistics.median(time_steps(fn, dev, args.reps, args.warmup))
            gbs = bytes_per_elem * numel / ms / 1e6
            moved = MOVED.get(name, bytes_per_elem)
            moved_of_copy = moved * numel / ms / 1e6 / copy_gbs
            rows.append(dict(tensors=n_tensors, impl=name, bytes=bytes_per_elem, ms=ms, gbs=gbs,
                             of_copy=gbs / copy_gbs, bytes_moved=moved, of_copy_moved=moved_of_copy))
            print(f"| {n_tensors} | {name} | {bytes_per_elem} | {ms:.2f} | {gbs:.0f} | {gbs / copy_gbs:.2f} "
                  f"| {moved} | {moved_of_copy:.2f} |", flush=True)
            del fn
            if dev == "cuda":
                torch.cuda.empty_cache()
    meta = run_meta(dev, numel=numel, copy_gbs=copy_gbs)
    print(f"{meta['device']}, 2^{args.numel} elements, copy {copy_gbs:.0f} GB/s")
    write_json(args.out, indent=2, meta=meta, rows=rows)


if __name__ == "__main__":
    main()
