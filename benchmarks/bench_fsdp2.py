#!/usr/bin/env python
"""shardadam.FusedAdam against torch.optim.AdamW on an FSDP2 model, in one run.

Goal: FusedAdam's step at most 0.6x torch fused AdamW's on the same FSDP2 shards, and a faster iteration. Judged by
"step vs fused" and "iteration vs fused" (medians over --rounds interleaved rounds). The GPT of models.py sharded
per block and at the root (reshard_after_forward=False, bf16 parameters and fp32 reduction on the GPU), stepped by
FusedAdam, AdamW(fused=True) and AdamW(foreach=True), each on a fresh model from the same seed.

    torchrun --nproc_per_node 2 benchmarks/bench_fsdp2.py --out benchmarks/results/bench_fsdp2_2xh200.json
    torchrun --nproc_per_node 2 benchmarks/bench_fsdp2.py --tiny --device cpu      # smoke run (gloo)
"""
from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import shardadam
from bench_distributed import WARMUP, WEIGHT_DECAY
from harness import (add_device_arg, add_run_args, finish, optimizer_bytes, parse_gpt_args, results_table, run_case,
                     say, start_gpt)
from models import FULL, SIZE_KEYS, TINY, add_size_args, build_model, lm_loss, make_batch
from timing import interleaved, sync, timed_calls

REFERENCE = "torch_fused"
OPTIMIZERS = {"shardadam": shardadam.FusedAdam, "torch_fused": partial(torch.optim.AdamW, fused=True),
              "torch_foreach": partial(torch.optim.AdamW, foreach=True)}
STEP_GOAL = 0.6  # shardadam's step time over torch fused's, at most


def run_one(name: str, args, dev: torch.device, cuda: bool, n_params: int) -> dict:
    """A fresh model sharded per block and at the root, WARMUP iterations, then `iters` with the step timed alone (host
    clock, synchronised before and after it; step_host: until step() returned), then `iters` back to back. Returns ms
    figures and the losses."""
    def run():
        model = build_model(args, dev)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else \
            MixedPrecisionPolicy()
        for module in [*model.blocks, model]:
            fully_shard(module, reshard_after_forward=False, mp_policy=policy)
        opt = OPTIMIZERS[name](model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY)
        inputs, targets = make_batch(args, args.batch, dev)

        def iteration(watch=None) -> torch.Tensor:
            loss = lm_loss(model, inputs, targets, cuda=False)  # the policy casts: no autocast
            loss.backward()
            if watch:  # the step timed alone: backward's reduce-scatters are done, the clock sees the step only
                sync(cuda)
                watch.mark()
            opt.step()
            if watch:
                watch.mark()
                sync(cuda)
                watch.mark()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        laps, _, losses = timed_calls(iteration, cuda, args.iters, WARMUP, host=True)
        _, wall, more = timed_calls(lambda _: iteration(), cuda, args.iters)
        return dict(step_ms=statistics.median(a + b for a, b in laps),
                    step_host_ms=statistics.median(a for a, _ in laps), iter_ms=wall,
                    opt_bytes=optimizer_bytes(opt)), torch.stack(losses + more).float().tolist()
    return run_case(dict(impl=name), run, dev, n_params)


def summarize(rounds: dict[str, list[dict]]) -> list[dict]:
    """Per implementation: the median over rounds, every round's values, ratios to REFERENCE."""
    summary = []
    for name, runs in rounds.items():
        failed = [r["error"] for r in runs if r["error"]]
        if failed:
            summary.append(dict(impl=name, error=failed[0]))
            continue
        out = dict(impl=name, error=None, loss_ok=all(r["loss_ok"] for r in runs),
                   opt_bytes_per_param=runs[0]["opt_bytes_per_param"])
        for key in ("step_ms", "step_host_ms", "iter_ms"):
            out[key] = statistics.median(r[key] for r in runs)
            out[key.replace("_ms", "_rounds_ms")] = [r[key] for r in runs]
        summary.append(out)
    ref = next((s for s in summary if s["impl"] == REFERENCE and not s["error"]), None)
    for s in summary:
        if ref and not s["error"]:
            s["step_vs_torch_fused"] = s["step_ms"] / ref["step_ms"]
            s["iter_vs_torch_fused"] = s["iter_ms"] / ref["iter_ms"]
    return summary


def goals(summary: list[dict]) -> str:
    mine = next((s for s in summary if s["impl"] == "shardadam"), None)
    if mine is None or mine["error"] or "step_vs_torch_fused" not in mine:
        return "goals: not measured (shardadam or torch_fused failed)"
    return (f"goals: shardadam step {mine['step_vs_torch_fused']:.3f}x torch fused's (target <= {STEP_GOAL}): "
            f"{mine['step_vs_torch_fused'] <= STEP_GOAL}; iteration {mine['iter_vs_torch_fused']:.3f}x "
            f"(target < 1): {mine['iter_vs_torch_fused'] < 1}; losses finite and falling: {mine['loss_ok']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(ap)
    add_device_arg(ap)
    ap.add_argument("--batch", type=int, help="sequences per GPU (default 4; --tiny 2)")
    ap.add_argument("--iters", type=int, help="timed iterations per phase after the warm-up (default 10; --tiny 3)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds of every implementation (default 2; --tiny 1)")
    add_run_args(ap, buckets=None,
                 out="write the results here as JSON (e.g. benchmarks/results/bench_fsdp2_2xh200.json)")
    args = parse_gpt_args(ap, dict(FULL, batch=4, iters=10, rounds=2), [*SIZE_KEYS, "batch", "iters", "rounds"],
                          dict(TINY, batch=2, iters=3, rounds=1))
    dev, cuda, n_params, meta = start_gpt(args, args.device, f"; FSDP2, batch {args.batch}")

    def one(name):
        r = run_one(name, args, dev, cuda, n_params)
        say(f"{name}: " + (f"failed: {r['error']}" if r["error"] else
                           f"step {r['step_ms']:.2f} ms (host {r['step_host_ms']:.2f}), iteration "
                           f"{r['iter_ms']:.1f} ms, loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}"))
        return r
    rounds = interleaved({name: (lambda name=name: one(name)) for name in OPTIMIZERS}, args.rounds)
    summary = summarize(rounds)
    say("", results_table(summary, ["impl"], [
        ("step ms", "step_ms", ".2f"), ("step host ms", "step_host_ms", ".2f"), ("iteration ms", "iter_ms", ".1f"),
        ("step vs fused", "step_vs_torch_fused", ".3f"), ("iteration vs fused", "iter_vs_torch_fused", ".3f"),
        ("opt B/param", "opt_bytes_per_param", ".2f")]), goals(summary))
    finish(args.out, meta=meta, summary=summary, rounds=[[rounds[n][k] for n in rounds] for k in range(args.rounds)])


if __name__ == "__main__":
    main()
