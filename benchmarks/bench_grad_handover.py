#!/usr/bin/env python
"""Host time of DistributedFusedAdam's gradient hand-over, per parameter and per bucket.

Goal: the hand-over adds little host time to backward. Judged by the host us
per parameter and per extra bucket: what the post-accumulate-grad hook runs for
every parameter (GradSync.pack), then GradSync.finish, in a world of 1, with
one bucket against the given number.

    python benchmarks/bench_grad_handover.py                       # CPU: 290 parameters, 57 buckets
    python benchmarks/bench_grad_handover.py --device cuda         # the same on a GPU (host time only)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import shardadam
from harness import init_one_rank, md_table


def handover_ms(params: list, grads: list, bucket_cap_mb: float, iters: int) -> tuple[float, int]:
    """Median host ms of one iteration's hand-over, and the number of buckets."""
    opt = shardadam.DistributedFusedAdam(params, bucket_cap_mb=bucket_cap_mb, overlap_grad_sync=True)
    sync = opt._grad_sync
    order = range(len(params) - 1, -1, -1)  # the layout's first guess: backward runs last to first
    times = []
    for i in range(iters + 5):
        if params[0].is_cuda:
            torch.cuda.synchronize()  # host time only: the GPU is idle when each iteration starts
        start = time.perf_counter()
        for k in order:
            sync.pack(k, grads[k])
        sync.finish()
        times.append(time.perf_counter() - start)
        sync.reset()
    return statistics.median(times[5:]) * 1e3, len(opt.layout.buckets)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--params", type=int, default=290, help="parameters (the 1.4B GPT has 290)")
    ap.add_argument("--buckets", type=int, default=57, help="buckets (the 1.4B GPT has 57 at 100 MiB)")
    ap.add_argument("--numel", type=int, default=1024, help="elements per parameter (host time hardly depends on it)")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    init_one_rank(args.device)
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    params = [torch.nn.Parameter(torch.randn(args.numel, device=dev)) for _ in range(args.params)]
    grads = [torch.randn(args.numel, device=dev) for _ in params]
    mib = args.numel * 4 / 2**20
    one_ms, _ = handover_ms(params, grads, mib * args.params * 2, args.iters)
    many_ms, buckets = handover_ms(params, grads, mib * args.params / args.buckets, args.iters)
    per_bucket_us = (many_ms - one_ms) * 1e3 / max(buckets - 1, 1)
    print(f"{args.device}, torch {torch.__version__}, {args.params} parameters of {args.numel} elements")
    print(md_table(["buckets", "host ms per iteration", "us per parameter"],
                   [[n, f"{ms:.2f}", f"{ms * 1e3 / args.params:.1f}"] for n, ms in ((1, one_ms), (buckets, many_ms))],
                   "rrr"))
    print(f"per extra bucket: {per_bucket_us:.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
