#!/usr/bin/env python
"""Capacity with optimizer state in host memory: does a GPT of this size train on this GPU?

Goal: with state on the host a GPU trains a model several times the size that
fits with fp32 AdamW on the GPU. Judged by whether the model trains, its
parameter count, and the GPU's peak and host's resident memory. One process
per attempt; prints one JSON line, with "error" when it does not fit.

    python benchmarks/bench_host_capacity.py --d-model 6144 --layers 56 --param-dtype bf16 --states 8-bit
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import shardadam
from harness import rss_bytes
from models import BLOCKWISE8, FULL, STOCHASTIC, add_size_args, build_model, lm_loss

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def optimizer_options(args) -> dict:
    return dict(state_device="cpu", **(BLOCKWISE8 if args.states == "8-bit" else {}),
                **(STOCHASTIC if args.param_dtype == "bf16" else {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(ap, None, dict(FULL, heads=32))
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
        model = build_model(args, "cuda", DTYPES[args.param_dtype])
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
            loss = lm_loss(model, tokens[:, :-1], tokens[:, 1:], cuda=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            seconds.append(time.perf_counter() - t0)
        result.update(losses=losses, seconds=seconds, trains=all(v == v for v in losses))
    except (torch.OutOfMemoryError, RuntimeError) as e:
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    result.update(gpu_peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30, host_resident_gib=rss_bytes() / 2 ** 30)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
