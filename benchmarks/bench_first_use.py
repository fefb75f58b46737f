#!/usr/bin/env python
"""Host cost of overlap_param_sync's guarantee ([Note: first-use guard]) on the benchmarks' GPT.

Goal: the guard that makes every read after step() wait for its all-gather
costs nothing measurable where the forward hooks already wait. Judged by the
forward's host ms with the guard over without it, and the guard's own costs
per parameter (best of 30 rounds over 300 CPU parameters). Variants (VARIANTS):
no overlap, hooks only, hooks and guard (as shipped), guard only.

    torchrun --nproc_per_node 2 benchmarks/bench_first_use.py               # GPT-1.4B, 2 GPUs
    python -m torch.distributed.run --nproc_per_node 1 benchmarks/bench_first_use.py --tiny   # CPU smoke
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardadam
from harness import add_run_args, parse_gpt_args, say, start_gpt
from models import FULL, SIZE_KEYS, add_size_args, autocast, build_model, make_batch
from shardadam.distributed._first_use import FirstUseGuard
from timing import timed_calls

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
        opt._hooks.forward.remove()
    return model, opt


def run(variant: str, args, dev: torch.device, cuda: bool) -> dict:
    """Host ms of zero_grad(), the forward and step() (medians), each
    iteration from an idle device, and the last loss."""
    model, opt = build(variant, args, dev)
    inputs, targets = make_batch(args, args.batch, dev)

    def iteration(watch) -> torch.Tensor:
        watch.mark()
        opt.zero_grad()
        watch.mark()
        with autocast(cuda):
            logits = model(inputs)
        watch.mark()
        with autocast(cuda):
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        watch.mark()
        opt.step()
        watch.mark()
        return loss
    laps, _, losses = timed_calls(iteration, cuda, args.iters, WARMUP, idle=True, host=True)
    opt.param_sync()
    zero_grad, forward, _, step = (statistics.median(col) for col in zip(*laps))
    return dict(step=step, zero_grad=zero_grad, forward=forward, loss_last=losses[-1].item())


def per_parameter_costs(count: int = 300, rounds: int = 30) -> dict:
    """The guard's costs in microseconds per parameter, best of `rounds`."""
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(count)]
    waits = _NoWait()  # held here: the guard keeps only a weak reference to its bound method
    guard = FirstUseGuard(waits.land)
    best = dict.fromkeys(("arm", "disarm", ".grad armed", "first use", "same op, plain"), float("inf"))

    def timed(name, fn):
        t0 = time.perf_counter()
        fn()
        best[name] = min(best[name], (time.perf_counter() - t0) / count * 1e6)
    for _ in range(rounds):
        timed("arm", lambda: guard.arm(params))
        timed(".grad armed", lambda: [p.grad for p in params])
        timed("first use", lambda: [p.mul(1.0) for p in params])
        timed("same op, plain", lambda: [p.mul(1.0) for p in params])
        guard.arm(params)
        timed("disarm", guard.disarm_all)
    return best


class _NoWait:
    """Lands nothing: the cost of the guard alone."""

    def land(self, params) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(ap)
    ap.add_argument("--batch", type=int, default=4, help="batch size per rank")
    ap.add_argument("--iters", type=int, default=10, help=f"timed iterations after {WARMUP} warm-up ones")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    add_run_args(ap, lr=None, buckets="bucket size in MiB (default 100; --tiny 0.1)", out=None)
    args = parse_gpt_args(ap, FULL, (*SIZE_KEYS, "bucket_cap_mb"))
    dev, cuda, _, _ = start_gpt(args)
    if dist.get_rank() == 0:
        costs = per_parameter_costs()
        say("guard, us per parameter: " + ", ".join(f"{k} {v:.2f}" for k, v in costs.items()),
            f"{'variant':<16} {'step ms':>9} {'zero_grad ms':>13} {'forward ms':>11} {'last loss':>10}")
    results = {}
    for variant in args.variants.split(","):
        r = results[variant] = run(variant, args, dev, cuda)
        say(f"{variant:<16} {r['step']:9.3f} {r['zero_grad']:13.3f} {r['forward']:11.3f} {r['loss_last']:10.4f}")
    if {"hooks_only", "hooks_and_guard"} <= results.keys():
        say(f"forward with the guard / without: "
            f"{results['hooks_and_guard']['forward'] / results['hooks_only']['forward']:.3f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
