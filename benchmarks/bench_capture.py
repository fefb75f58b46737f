#!/usr/bin/env python
"""DistributedFusedAdam eager and captured in one CUDA graph, per storage mode, against DDP + fused AdamW.

Goal: every storage mode captures and replays, its losses within LOSS_TOLERANCE
of its eager run's, with the iteration's host time gone. Judged by "vs DDP"
(ms / DDP's eager ms), "host vs DDP" and, for a captured run, "vs eager" and
its loss difference to the eager run.

The GPT of models.py, bf16 autocast, a GradScaler and clipping;
DistributedFusedAdam(capturable=True, both overlaps, contiguous_param_buffer)
eager and captured (README, "CUDA graphs") in each storage configuration, and
DDP + AdamW(fused=True) eager as the reference. Medians of back-to-back
iterations (CUDA events) and of the host time for the call to return from an
idle device, the maximum over ranks. A failed check exits 1 after the table.

    torchrun --nproc_per_node 2 benchmarks/bench_capture.py --out results.json
    torchrun --nproc_per_node 2 benchmarks/bench_capture.py --tiny      # smoke run, CPU (gloo, eager only) or GPU
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardadam
from bench_distributed import WARMUP, WEIGHT_DECAY, build_ddp_fused
from harness import (agree_on_error, attempt, describe, fmt, gpt_meta, init_distributed, losses_ok, max_over_ranks,
                     md_table, optimizer_bytes, write_json)
from models import FULL, add_size_args, autocast, build_model, count_params, fill_defaults, make_batch
from timing import Stopwatch, free, sync

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
    model.to(dtype)
    opt = shardadam.DistributedFusedAdam(model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY,
                                         bucket_cap_mb=args.bucket_cap_mb, capturable=cuda,
                                         overlap_grad_sync=True, overlap_param_sync=True,
                                         contiguous_param_buffer=True, **options)
    # Applied inside step() to the unscaled norm; nothing is read back to the host.
    return model, opt, scaler, partial(opt.clip_grad_norm, MAX_NORM)


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


def capture(warm_step, iteration):
    """The README's recipe: warm-up iterations on a side stream (the first one
    learns the bucket order, the scaler creates its tensors), then one iteration
    captured. Returns the graph, its static loss and the warm-up losses."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        losses = [warm_step() for _ in range(WARMUP)]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = iteration()
    return graph, static_loss, losses


def measure(step, cuda: bool, iters: int) -> tuple[dict, list]:
    """`iters` calls back to back between Stopwatch marks, with the wall clock
    around them; then `iters` more, each from an idle device, timed on the host
    until step() returns. The medians and every call's loss (cloned: a replay
    overwrites its static loss)."""
    losses, watches = [], []
    sync(cuda)
    t0 = time.perf_counter()
    for _ in range(iters):
        watch = Stopwatch(cuda)
        watch.mark()
        loss = step()
        watch.mark()
        losses.append(loss.clone())
        watches.append(watch)
    sync(cuda)
    wall = (time.perf_counter() - t0) * 1e3 / iters
    host = []
    for _ in range(iters):
        sync(cuda)
        t0 = time.perf_counter()
        loss = step()
        host.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.clone())
    sync(cuda)
    return dict(ms=statistics.median(w.laps_ms()[0] for w in watches), wall_ms=wall,
                host_ms=statistics.median(host)), losses


def train(mode: str, iteration, load, cuda: bool, iters: int) -> tuple[dict, list]:
    """WARMUP eager iterations (on a side stream before a capture), then the
    measured ones: the figures and every iteration's loss."""
    def eager() -> torch.Tensor:
        load()
        return iteration()

    if mode == "eager":
        warm = [eager() for _ in range(WARMUP)]
        step = eager
    else:
        graph, static_loss, warm = capture(eager, iteration)

        def step() -> torch.Tensor:
            load()
            graph.replay()
            return static_loss
    figures, losses = measure(step, cuda, iters)
    return figures, warm + losses


def run_one(config: str, mode: str, batch: int, args, dev: torch.device, n_params: int) -> dict:
    """Build `config` on a fresh model, train it in `mode`, and report its figures."""
    cuda = dev.type == "cuda"
    free(cuda)

    def run():
        module, opt, scaler, clip = build(config, args, dev)
        (inputs, targets), load = static_batch(args, batch, dev)
        figures, losses = train(mode, make_iteration(module, opt, scaler, clip, inputs, targets, cuda), load,
                                cuda, args.iters)
        opt.zero_grad()  # gradients freed, as between iterations (DDP keeps them until then)
        sync(cuda)
        memory = [torch.cuda.max_memory_allocated() if cuda else 0, torch.cuda.memory_allocated() if cuda else 0]
        return figures, losses, optimizer_bytes(opt), memory
    out, error = attempt(run)
    result = dict(config=config, mode=mode, batch=batch, capturable=cuda and config != REFERENCE,
                  error=agree_on_error(error, dev))
    if result["error"]:
        return result
    figures, losses, opt_bytes, (peak, resident) = out
    losses = torch.stack(losses).float().tolist()  # rank 0's: each rank has its own batch
    ms, wall, host, opt_bytes, peak, resident = max_over_ranks(
        [figures["ms"], figures["wall_ms"], figures["host_ms"], opt_bytes, peak, resident], dev)
    result.update(ms=ms, wall_ms=wall, host_ms=host, opt_bytes_per_param=opt_bytes / n_params,
                  peak_gib=peak / 2**30 if cuda else None,
                  resident_bytes_per_param=resident / n_params if cuda else None,
                  losses=losses, loss_first=losses[0], loss_last=losses[-1], loss_ok=losses_ok(losses))
    return result


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
    rows = [[r["config"], r["mode"], r["batch"], f"failed: {r['error']}"] + [""] * 10 if r["error"] else
            [r["config"], r["mode"], r["batch"], f"{r['ms']:.1f}", fmt(r["vs_ddp"], ".3f"), fmt(r["vs_eager"], ".3f"),
             f"{r['host_ms']:.2f}", fmt(r["host_vs_ddp"], ".3f"), fmt(r["host_vs_eager"], ".3f"),
             fmt(r["peak_gib"], ".2f"), f"{r['opt_bytes_per_param']:.2f}", fmt(r["resident_bytes_per_param"], ".2f"),
             f"{r['loss_first']:.4f} -> {r['loss_last']:.4f}", fmt(r["loss_diff_vs_eager"], ".2e")]
            for r in results]
    return md_table(["config", "mode", "batch", "ms/iter", "vs DDP", "vs eager", "host ms/iter", "host vs DDP",
                     "host vs eager", "peak GiB", "opt B/param", "resident B/param", "loss first -> last",
                     "loss diff vs eager"], rows, "llrrrrrrrrrrlr")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(ap)
    ap.add_argument("--batches", help="batch sizes per GPU, comma-separated (default 4)")
    ap.add_argument("--iters", type=int, help=f"timed iterations, twice (GPU time, then host time), after {WARMUP} "
                                              "warm-up ones (default 10)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma-separated subset of " + ",".join(MODES) + f" ({REFERENCE} runs eager only)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--bucket-cap-mb", type=float, help="DistributedFusedAdam's bucket size in MiB (default 100)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args()
    fill_defaults(args, dict(FULL, batches="4"))
    args.batches = [int(b) for b in args.batches.split(",")]
    args.configs, args.modes = args.configs.split(","), args.modes.split(",")
    if args.iters < 1:
        ap.error("--iters must be at least 1")
    for option, chosen, known in (("--configs", args.configs, CONFIGS), ("--modes", args.modes, MODES)):
        if set(chosen) - set(known):
            ap.error(f"unknown {option} {sorted(set(chosen) - set(known))}; choose from {known}")
    return args


def main() -> None:
    args = parse_args()
    dev, cuda = init_distributed()
    rank = dist.get_rank()
    n_params = count_params(args)
    meta = gpt_meta(args, dev, n_params)
    if rank == 0:
        print(describe(meta, args), flush=True)
        if not cuda and "captured" in args.modes:
            print("captured mode skipped: CUDA graphs need CUDA (this run is eager only, capturable=False)",
                  flush=True)
    # (config, mode) in order: the reference first, each captured run after its eager one
    modes = [m for m in MODES if m in args.modes and (cuda or m == "eager")]
    runs = [(c, m) for c in CONFIGS if c in args.configs for m in (["eager"] if c == REFERENCE else modes)]
    results = []
    for batch in args.batches:
        for config, mode in runs:
            r = run_one(config, mode, batch, args, dev, n_params)
            results.append(r)
            if rank == 0:
                status = (f"failed: {r['error']}" if r["error"] else
                          f"{r['ms']:.1f} ms/iter, host {r['host_ms']:.2f} ms/iter, "
                          f"loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}")
                print(f"{config} {mode} batch {batch}: {status}", flush=True)
    add_ratios(results)
    failed = failures(results)
    if rank == 0:
        print()
        print(table(results))
        compared = sum(r.get("loss_matches_eager") is not None for r in results)
        print("\n".join(failed) or "every loss finite and falling" + (
            f"; {compared} captured runs within {LOSS_TOLERANCE} of their eager runs' losses" if compared else ""))
        write_json(args.out, meta=meta, results=results)
    dist.destroy_process_group()
    if rank == 0 and failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
