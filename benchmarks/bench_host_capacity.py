#!/usr/bin/env python
"""Capacity with optimizer state in host memory: does a GPT of this size
train on this GPU? One process per attempt (an out-of-memory error leaves
torch's caches in an unknown state).

bench_distributed.py's GPT architecture, built directly on the GPU in the
parameter dtype, batch --batch x --seq tokens, bf16 autocast, --iters
iterations of forward, backward and FusedAdam.step (--optimizer torchao:
torchao's CPUOffloadOptimizer with fused CPU AdamW, fp32 states, instead). Prints one JSON line: the
parameter count, each iteration's loss and seconds, the GPU's peak memory and
the process's resident host memory; "error" instead when it does not fit.

    python benchmarks/bench_host_capacity.py --d-model 6144 --layers 56 --param-dtype bf16 --states 8-bit
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_distributed import GPT  # noqa: E402

import shardadam  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def host_resident_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2 ** 20
    return float("nan")


def optimizer_options(args) -> dict:
    options = dict(state_device="cpu")
    if args.states == "8-bit":
        options.update(exp_avg_dtype=shardadam.BLOCKWISE8, exp_avg_sq_dtype=shardadam.BLOCKWISE8)
    if args.param_dtype == "bf16":
        options.update(bf16_stochastic_round=True, stochastic_round_seed=0)
    return options


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--param-dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--states", choices=["fp32", "8-bit"], default="fp32")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--optimizer", choices=("shardadam", "torchao"), default="shardadam")
    args = ap.parse_args()
    result = dict(d_model=args.d_model, layers=args.layers, param_dtype=args.param_dtype, states=args.states,
                  batch=args.batch, seq=args.seq, optimizer=args.optimizer,
                  options={k: str(v) for k, v in optimizer_options(args).items()} if args.optimizer == "shardadam"
                  else dict(optimizer_class="torch.optim.AdamW", fused=True))
    try:
        torch.manual_seed(0)
        torch.set_default_dtype(DTYPES[args.param_dtype])
        with torch.device("cuda"):
            model = GPT(args.d_model, args.layers, args.heads, args.vocab, args.seq)
        torch.set_default_dtype(torch.float32)
        result["params"] = sum(p.numel() for p in model.parameters())
        if args.optimizer == "torchao":
            from torchao.optim import CPUOffloadOptimizer
            opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, fused=True)
        else:
            opt = shardadam.FusedAdam(model.parameters(), lr=1e-4, **optimizer_options(args))
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device="cuda")
        losses, seconds = [], []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            losses.append(loss.item())
            seconds.append(time.perf_counter() - t0)
        result.update(losses=losses, seconds=seconds, gpu_peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30,
                      host_resident_gib=host_resident_gib(), trains=all(map(lambda v: v == v, losses)))
    except (torch.OutOfMemoryError, RuntimeError) as e:
        result.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                      gpu_peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30, host_resident_gib=host_resident_gib())
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
