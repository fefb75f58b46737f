#!/usr/bin/env python
"""Host cost of overlap_param_sync's guarantee ([Note: first-use guard]) on bench_distributed's GPT.

One run, the same model and optimizer options, four variants:

- no_overlap:      overlap_param_sync=False (step() all-gathers before returning)
- hooks_only:      overlap_param_sync=True with the first-use guard switched off
                   in this benchmark (each module's forward waits for its own
                   parameters; other reads could see stale values)
- hooks_and_guard: overlap_param_sync=True as shipped
- guard_only:      overlap_param_sync=True with the forward-pre hook removed in
                   this benchmark: every parameter waits through the guard on
                   its first use (the worst case: a model whose parameters are
                   all used outside their module's forward)

For each: the median host milliseconds of step(), zero_grad() and the
forward (the Python call returning, from an idle device: synchronised before
zero_grad), and rank 0's last loss (the variants train alike).

    torchrun --nproc_per_node 2 benchmarks/bench_first_use.py               # GPT-1.4B, 2 GPUs
    python -m torch.distributed.run --nproc_per_node 1 benchmarks/bench_first_use.py --tiny   # CPU smoke
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardadam
from bench_distributed import FULL, add_size_args, build_model, describe, fill_defaults, init_distributed, make_batch, \
    run_meta

VARIANTS = ("no_overlap", "hooks_only", "hooks_and_guard", "guard_only")
WARMUP = 3


def build(variant: str, args, dev: torch.device):
    model = build_model(args, dev)
    opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-4, weight_decay=0.1,
                                         bucket_cap_mb=args.bucket_cap_mb,
                                         overlap_param_sync=variant != "no_overlap")
    if variant == "hooks_only":
        opt._first_use.arm = lambda params: None
    if variant == "guard_only":
        opt._forward_hook.remove()
    return model, opt


def run(variant: str, args, dev: torch.device, cuda: bool) -> dict:
    model, opt = build(variant, args, dev)
    inputs, targets = make_batch(args, args.batch, dev)
    autocast = torch.autocast("cuda", torch.bfloat16) if cuda else contextlib.nullcontext()
    times = {"step": [], "zero_grad": [], "forward": []}
    loss = None
    for i in range(WARMUP + args.iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad()
        t1 = time.perf_counter()
        with autocast:
            logits = model(inputs)
        t2 = time.perf_counter()
        with autocast:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        if i >= WARMUP:
            times["zero_grad"].append(t1 - t0)
            times["forward"].append(t2 - t1)
            times["step"].append(t4 - t3)
    opt.param_sync()
    result = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    result["loss_last"] = loss.item()
    del model, opt
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(ap)
    ap.add_argument("--batch", type=int, default=4, help="batch size per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=int, default=10, help=f"timed iterations after {WARMUP} warm-up ones")
    ap.add_argument("--bucket-cap-mb", type=float, help="bucket size in MiB (default 100; --tiny 0.1)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    args = ap.parse_args()
    fill_defaults(args, FULL, ("d_model", "layers", "heads", "vocab", "seq", "bucket_cap_mb"))
    dev, cuda = init_distributed()
    n_params = sum(p.numel() for p in build_model(args, torch.device("meta")).parameters())
    if dist.get_rank() == 0:
        print(describe(run_meta(args, dev, cuda, n_params), args), flush=True)
        print(f"{'variant':<16} {'step ms':>9} {'zero_grad ms':>13} {'forward ms':>11} {'last loss':>10}")
    for variant in args.variants.split(","):
        r = run(variant, args, dev, cuda)
        if dist.get_rank() == 0:
            print(f"{variant:<16} {r['step']:9.3f} {r['zero_grad']:13.3f} {r['forward']:11.3f} {r['loss_last']:10.4f}",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
