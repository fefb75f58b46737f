#!/usr/bin/env python
"""shardadam.FusedAdam against torch.optim.AdamW on an FSDP2 model, in one run.

The benchmarks' GPT (bench_distributed.py; default about 1.4B parameters)
sharded with fully_shard(reshard_after_forward=False) per block and at the
root, with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on the GPU
(fp32 sharded parameters, gradients and optimizer state), stepped by:

- shardadam:     shardadam.FusedAdam (one launch per storage kind on the local shards)
- torch_fused:   torch.optim.AdamW(fused=True)
- torch_foreach: torch.optim.AdamW(foreach=True)

Each implementation is built on a fresh model from the same seed and run in
`--rounds` rounds, interleaved (A B C A B C), so drift of the machine shows as
a spread between rounds. Per round, after warm-up:

- step: the optimizer step alone, host plus device: synchronise, start the
  clock, opt.step(), synchronise, stop; the median over the timed iterations.
  step_host is when opt.step() returned (its host cost, with the device idle
  at its start);
- iteration: forward, backward, step and zero_grad back to back, no sync
  inside; the wall-clock mean per iteration over the timed loop, synchronised
  around it.

Reported: the median over rounds of each figure, every round's values, and the
ratios to torch_fused (the issue's goals: shardadam's step <= 0.6x torch
fused's, and a faster iteration); rank 0's losses (checked: finite, falling).

    torchrun --nproc_per_node 2 benchmarks/bench_fsdp2.py --out benchmarks/results/bench_fsdp2_2xh200.json
    torchrun --nproc_per_node 2 benchmarks/bench_fsdp2.py --tiny --device cpu      # smoke run (gloo)

The CPU run checks the wiring (fp32, no mixed precision); its timings mean little.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import shardadam

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_distributed import (FULL, WARMUP, WEIGHT_DECAY, add_size_args, agree_on_error, build_model,  # noqa: E402
                               describe, fill_defaults, free, init_distributed, make_batch, max_over_ranks,
                               optimizer_bytes, run_meta, sync)

REFERENCE = "torch_fused"
OPTIMIZERS = {
    "shardadam": lambda params, lr: shardadam.FusedAdam(params, lr=lr, weight_decay=WEIGHT_DECAY),
    "torch_fused": lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, fused=True),
    "torch_foreach": lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, foreach=True),
}
STEP_GOAL = 0.6  # shardadam's step time over torch fused's, at most


def build(name: str, args, dev: torch.device, cuda: bool):
    model = build_model(args, dev)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else \
        MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=False, mp_policy=policy)
    fully_shard(model, reshard_after_forward=False, mp_policy=policy)
    return model, OPTIMIZERS[name](model.parameters(), args.lr)


def forward_backward(model, inputs, targets) -> torch.Tensor:
    loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
    loss.backward()
    return loss.detach()


def measure(model, opt, inputs, targets, cuda: bool, iters: int) -> dict:
    """WARMUP iterations, then `iters` with the step timed alone, then `iters`
    back to back (see the module docstring). Returns ms figures and the losses."""
    losses, steps, hosts = [], [], []
    for i in range(WARMUP + iters):
        losses.append(forward_backward(model, inputs, targets))
        sync(cuda)  # backward's reduce-scatters are done: the clock sees the step only
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        sync(cuda)
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if i >= WARMUP:
            hosts.append((t1 - t0) * 1e3)
            steps.append((t2 - t0) * 1e3)
    sync(cuda)
    t0 = time.perf_counter()
    for _ in range(iters):
        losses.append(forward_backward(model, inputs, targets))
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(cuda)
    iteration = (time.perf_counter() - t0) * 1e3 / iters
    return dict(step_ms=statistics.median(steps), step_host_ms=statistics.median(hosts), iter_ms=iteration,
                losses=torch.stack(losses).float().tolist())


def run_one(name: str, args, dev: torch.device, cuda: bool, n_params: int) -> dict:
    free(cuda)
    error = None
    try:
        model, opt = build(name, args, dev, cuda)
        inputs, targets = make_batch(args, args.batch, dev)
        timing = measure(model, opt, inputs, targets, cuda, args.iters)
    except Exception as e:  # recorded, and the other implementations still run
        traceback.print_exc()
        error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    result = dict(impl=name, error=agree_on_error(error, dev))
    if result["error"]:
        return result
    step, host, iteration, opt_bytes = max_over_ranks(
        [timing["step_ms"], timing["step_host_ms"], timing["iter_ms"], optimizer_bytes(opt)], dev)
    losses = timing["losses"]  # rank 0's: each rank has its own batch
    result.update(step_ms=step, step_host_ms=host, iter_ms=iteration, opt_bytes_per_param=opt_bytes / n_params,
                  loss_first=losses[0], loss_last=losses[-1],
                  loss_ok=all(math.isfinite(x) for x in losses) and losses[-1] < losses[0])
    del model, opt
    return result


def summarize(rounds: list[list[dict]]) -> list[dict]:
    """Per implementation: the median over rounds, every round's values, ratios to REFERENCE."""
    summary = []
    for name in OPTIMIZERS:
        runs = [r for rnd in rounds for r in rnd if r["impl"] == name]
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


# (header, summary key, format) of each column after the implementation's name
COLUMNS = (("step ms", "step_ms", ".2f"), ("step host ms", "step_host_ms", ".2f"), ("iteration ms", "iter_ms", ".1f"),
           ("step vs fused", "step_vs_torch_fused", ".3f"), ("iteration vs fused", "iter_vs_torch_fused", ".3f"),
           ("opt B/param", "opt_bytes_per_param", ".2f"))


def table(summary: list[dict]) -> str:
    lines = ["| impl | " + " | ".join(c[0] for c in COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
    for s in summary:
        cells = [f"failed: {s['error']}"] + [""] * (len(COLUMNS) - 1) if s["error"] else [
            "-" if s.get(key) is None else format(s[key], spec) for _, key, spec in COLUMNS]
        lines.append(f"| {s['impl']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goals(summary: list[dict]) -> str:
    mine = next((s for s in summary if s["impl"] == "shardadam"), None)
    if mine is None or mine["error"] or "step_vs_torch_fused" not in mine:
        return "goals: not measured (shardadam or torch_fused failed)"
    return (f"goals: shardadam step {mine['step_vs_torch_fused']:.3f}x torch fused's (target <= {STEP_GOAL}): "
            f"{mine['step_vs_torch_fused'] <= STEP_GOAL}; iteration {mine['iter_vs_torch_fused']:.3f}x "
            f"(target < 1): {mine['iter_vs_torch_fused'] < 1}; losses finite and falling: {mine['loss_ok']}")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(ap)
    ap.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda where available (NCCL), else cpu (gloo)")
    ap.add_argument("--batch", type=int, help="sequences per GPU (default 4; --tiny 2)")
    ap.add_argument("--iters", type=int, help="timed iterations per phase after the warm-up (default 10; --tiny 3)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds of every implementation (default 2; --tiny 1)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the results here as JSON (e.g. benchmarks/results/bench_fsdp2_2xh200.json)")
    args = ap.parse_args()
    fill_defaults(args, FULL, ["d_model", "layers", "heads", "vocab", "seq"])
    for key, full, tiny in (("batch", 4, 2), ("iters", 10, 3), ("rounds", 2, 1)):
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    if args.iters < 1 or args.rounds < 1:
        ap.error("--iters and --rounds must be at least 1")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return args


def main() -> None:
    args = parse_args()
    if args.device == "cuda":
        dev, cuda = init_distributed()
    else:
        dist.init_process_group("gloo")
        dev, cuda = torch.device("cpu"), False
    rank = dist.get_rank()
    n_params = sum(p.numel() for p in build_model(args, torch.device("meta")).parameters())
    meta = run_meta(args, dev, cuda, n_params)
    if rank == 0:
        print(describe(meta, args) + f"; FSDP2, batch {args.batch}", flush=True)
    rounds = []
    for k in range(args.rounds):
        rounds.append([run_one(name, args, dev, cuda, n_params) for name in OPTIMIZERS])
        if rank == 0:
            for r in rounds[-1]:
                status = f"failed: {r['error']}" if r["error"] else (
                    f"step {r['step_ms']:.2f} ms (host {r['step_host_ms']:.2f}), iteration {r['iter_ms']:.1f} ms, "
                    f"loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}")
                print(f"round {k} {r['impl']}: {status}", flush=True)
    summary = summarize(rounds)
    if rank == 0:
        print()
        print(table(summary))
        print(goals(summary))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(meta=meta, summary=summary, rounds=rounds), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
