#!/usr/bin/env python
"""DistributedFusedAdam eager and captured in one CUDA graph, per storage mode, against DDP + fused AdamW.

Goal: every storage mode captures and replays, its losses within LOSS_TOLERANCE
of its eager run's, with the iteration's host time gone. Judged by "vs DDP"
(ms / DDP's eager ms), "host vs DDP" and, for a captured run, "vs eager" and
its loss difference to the eager run. The GPT of models.py, bf16 autocast, a
GradScaler and clipping; medians of back-to-back iterations (CUDA events) and
of the host time from an idle device, maximum over ranks. A failed check exits 1.

    torchrun --nproc_per_node 2 benchmarks/bench_capture.py --out results.json
    torchrun --nproc_per_node 2 benchmarks/bench_capture.py --tiny      # smoke run, CPU (gloo, eager only) or GPU
"""
from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench_distributed import WARMUP, build_ddp_fused, build_shardadam
from harness import (add_run_args, choose, finish, memory_figures, parse_gpt_args, results_table, run_case, say,
                     start_gpt)
from models import FULL, add_size_args, autocast, build_model, make_batch
from timing import capture_graph, timed_calls

REFERENCE = "ddp_fused"
BF16 = dict(param_sync_dtype=torch.bfloat16)
# name: (parameter dtype, DistributedFusedAdam storage options)
STORAGE = {
    "fp32": (torch.float32, {}),
    "bf16": (torch.bfloat16, BF16),
    "bf16_remainders": (torch.bfloat16, dict(BF16, store_param_remainders=True, store_params=False)),
    "bf16_scaled_states": (torch.bfloat16, dict(BF16, with_scaled_states=True, dtype=torch.float16)),
    "bf16_no_master": (torch.bfloat16, dict(BF16, store_params=False)),
}
CONFIGS = (REFERENCE, *STORAGE)
MODES = ("eager", "captured")
MAX_NORM = 1.0
# Eager and captured runs do the same arithmetic, up to the order of atomic
# additions in a few kernels (different implementations of the same training
# ended 2e-3 apart in bench_distributed.py). A broken capture (stale
# parameters, a step not applied) departs by far more.
LOSS_TOLERANCE = 0.02

# GradScaler warns that it will stop passing itself to step(grad_scaler=...),
# which is how DistributedFusedAdam receives it: once per rank, not actionable here.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


def build(config: str, args, dev: torch.device):
    """A fresh model from the seed, its optimizer, the GradScaler, and the
    clipping call of an iteration."""
    cuda = dev.type == "cuda"
    scaler = torch.amp.GradScaler(dev.type)
    model = build_model(args, dev)
    if config == REFERENCE:
        module, opt = build_ddp_fused(model, args, cuda)

        def clip() -> None:  # torch's way: unscale the gradients in place, then clip them
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_NORM)
        return module, opt, scaler, clip
    dtype, options = STORAGE[config]
    module, opt = build_shardadam(model.to(dtype), args, cuda, capturable=cuda, **options)
    # Applied inside step() to the unscaled norm; nothing is read back to the host.
    return module, opt, scaler, partial(opt.clip_grad_norm, MAX_NORM)


def static_batch(args, batch: int, dev: torch.device):
    """Static input and target tensors, and the copy of this rank's batch into them."""
    source = make_batch(args, batch, dev)
    static = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in source]

    def load() -> None:
        for s, t in zip(static, source):
            s.copy_(t)
    return static, load


def make_iteration(module, opt, scaler, clip, inputs, targets, cuda: bool):
    def iteration() -> torch.Tensor:
        opt.zero_grad()
        with autocast(cuda):
            # fp32 loss: a bf16 model's bf16 loss (CPU run) is too coarse to show a few iterations' fall.
            loss = F.cross_entropy(module(inputs).flatten(0, 1).float(), targets.flatten())
        scaler.scale(loss).backward()
        clip()
        scaler.step(opt)
        scaler.update()
        return loss.detach()
    return iteration


def train(mode: str, iteration, load, cuda: bool, iters: int) -> tuple[dict, list]:
    """WARMUP eager iterations (on a side stream before a capture: the first
    one learns the bucket order, the scaler creates its tensors), then `iters`
    calls back to back between Stopwatch marks, with the wall clock around
    them, then `iters` more, each from an idle device, timed on the host until
    it returns. The medians and every iteration's loss (cloned: a replay
    overwrites its static loss)."""
    def eager() -> torch.Tensor:
        load()
        return iteration()

    if mode == "eager":
        warm = [eager() for _ in range(WARMUP)]
        step = eager
    else:
        graph, static_loss, warm = capture_graph(eager, WARMUP)

        def step() -> torch.Tensor:
            load()
            graph.replay()
            return static_loss

    def call(watch) -> torch.Tensor:
        watch.mark()
        loss = step()
        watch.mark()
        return loss.clone()
    laps, wall, losses = timed_calls(call, cuda, iters)
    host, _, more = timed_calls(call, cuda, iters, idle=True, host=True)
    return dict(ms=statistics.median(lap for lap, in laps), wall_ms=wall,
                host_ms=statistics.median(lap for lap, in host)), warm + losses + more


def run_one(config: str, mode: str, batch: int, args, dev: torch.device, n_params: int) -> dict:
    """Build `config` on a fresh model, train it in `mode`, and report its figures."""
    cuda = dev.type == "cuda"

    def run():
        module, opt, scaler, clip = build(config, args, dev)
        (inputs, targets), load = static_batch(args, batch, dev)
        figures, losses = train(mode, make_iteration(module, opt, scaler, clip, inputs, targets, cuda), load,
                                cuda, args.iters)
        opt.zero_grad()  # gradients freed, as between iterations (DDP keeps them until then)
        return dict(figures, **memory_figures(opt, cuda)), torch.stack(losses).float().tolist()
    return run_case(dict(config=config, mode=mode, batch=batch, capturable=cuda and config != REFERENCE), run, dev,
                    n_params, keep_losses=True)


def add_ratios(results: list[dict]) -> None:
    """Time and host time against DDP's eager run and, for a captured run,
    against its configuration's eager run, whose losses it must reproduce."""
    by = {(r["config"], r["mode"], r["batch"]): r for r in results if not r["error"]}
    for r in by.values():
        ddp, eager = by.get((REFERENCE, "eager", r["batch"])), by.get((r["config"], "eager", r["batch"]))
        r["vs_ddp"] = r["ms"] / ddp["ms"] if ddp else None
        r["host_vs_ddp"] = r["host_ms"] / ddp["host_ms"] if ddp else None
        r["vs_eager"] = r["host_vs_eager"] = r["loss_diff_vs_eager"] = r["loss_matches_eager"] = None
        if r["mode"] == "captured" and eager:
            r["vs_eager"] = r["ms"] / eager["ms"]
            r["host_vs_eager"] = r["host_ms"] / eager["host_ms"]
            r["loss_diff_vs_eager"] = max(abs(a - b) for a, b in zip(r["losses"], eager["losses"]))
            r["loss_matches_eager"] = r["loss_diff_vs_eager"] <= LOSS_TOLERANCE


def failures(results: list[dict]) -> list[str]:
    lines = []
    for r in results:
        name = f"{r['config']} {r['mode']} batch {r['batch']}"
        if r["error"]:
            lines.append(f"{name}: failed: {r['error']}")
            continue
        if not r["loss_ok"]:
            lines.append(f"{name}: loss not finite or not falling ({r['loss_first']:.4f} -> {r['loss_last']:.4f})")
        if r["loss_matches_eager"] is False:
            lines.append(f"{name}: losses differ from the eager run's by {r['loss_diff_vs_eager']:.4f} "
                         f"(tolerance {LOSS_TOLERANCE})")
    return lines


def table(results: list[dict]) -> str:
    return results_table(results, ["config", "mode", "batch"], [
        ("ms/iter", "ms", ".1f"), ("vs DDP", "vs_ddp", ".3f"), ("vs eager", "vs_eager", ".3f"),
        ("host ms/iter", "host_ms", ".2f"), ("host vs DDP", "host_vs_ddp", ".3f"),
        ("host vs eager", "host_vs_eager", ".3f"), ("peak GiB", "peak_gib", ".2f"),
        ("opt B/param", "opt_bytes_per_param", ".2f"), ("resident B/param", "resident_bytes_per_param", ".2f"),
        ("loss first -> last", lambda r: f"{r['loss_first']:.4f} -> {r['loss_last']:.4f}", None),
        ("loss diff vs eager", "loss_diff_vs_eager", ".2e")], "llrrrrrrrrrrlr")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(ap)
    ap.add_argument("--batches", help="batch sizes per GPU, comma-separated (default 4)")
    ap.add_argument("--iters", type=int, help=f"timed iterations, twice (GPU time, then host time), after {WARMUP} "
                                              "warm-up ones (default 10)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma-separated subset of " + ",".join(MODES) + f" ({REFERENCE} runs eager only)")
    add_run_args(ap)
    args = parse_gpt_args(ap, dict(FULL, batches="4"))
    args.configs, args.modes = choose(ap, args.configs, CONFIGS, "--configs"), choose(ap, args.modes, MODES, "--modes")
    return args


def main() -> None:
    args = parse_args()
    dev, cuda, n_params, meta = start_gpt(args)
    if not cuda and "captured" in args.modes:
        say("captured mode skipped: CUDA graphs need CUDA (this run is eager only, capturable=False)")
    # (config, mode) in order: the reference first, each captured run after its eager one
    modes = [m for m in MODES if m in args.modes and (cuda or m == "eager")]
    runs = [(c, m) for c in CONFIGS if c in args.configs for m in (["eager"] if c == REFERENCE else modes)]
    results = []
    for batch in args.batches:
        for config, mode in runs:
            r = run_one(config, mode, batch, args, dev, n_params)
            results.append(r)
            say(f"{config} {mode} batch {batch}: " + (f"failed: {r['error']}" if r["error"] else
                f"{r['ms']:.1f} ms/iter, host {r['host_ms']:.2f} ms/iter, "
                f"loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}"))
    add_ratios(results)
    failed = failures(results)
    compared = sum(r.get("loss_matches_eager") is not None for r in results)
    say("", table(results), "\n".join(failed) or "every loss finite and falling" + (
        f"; {compared} captured runs within {LOSS_TOLERANCE} of their eager runs' losses" if compared else ""))
    rank0 = dist.get_rank() == 0  # each rank judges its own losses: rank 0 speaks for the run
    finish(args.out, meta=meta, results=results)
    if rank0 and failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
