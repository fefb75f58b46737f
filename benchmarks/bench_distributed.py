#!/usr/bin/env python
"""DistributedFusedAdam against DDP + fused AdamW, FSDP2 and ZeroRedundancyOptimizer, in one run.

Goal (issue 4): an iteration faster than each of them, at most 0.9x DDP's time, exposed communication under 10%,
optimizer memory 12/N bytes per parameter plus buffers. Judged by "vs DDP" (ms / ddp_fused's ms) and exposed comm =
(ms - compute_only's fwd+bwd - its step / N for sharded steps) / ms. The GPT of models.py, rebuilt from the same
seed for each implementation and for compute_only (one rank, no collective: the baseline of exposed comm).

--capture: DistributedFusedAdam eager and captured in one CUDA graph, per storage mode, against DDP + fused AdamW,
each with a GradScaler and clipping. Goal: every storage mode captures and replays, its losses within LOSS_TOLERANCE
of its eager run's, with the iteration's host time gone. Judged by "vs DDP" (ms / DDP's eager ms), "host vs DDP"
and, for a captured run, "vs eager" and its loss difference to the eager run. Medians of back-to-back iterations
(CUDA events) and of the host time from an idle device, maximum over ranks. A failed check exits 1.

--fsdp2-step: shardadam.FusedAdam against AdamW(fused=True) and AdamW(foreach=True) on the same FSDP2 shards (per
block and at the root, reshard_after_forward=False, bf16 parameters and fp32 reduction on the GPU). Goal: FusedAdam's
step at most 0.6x torch fused AdamW's, and a faster iteration. Judged by "step vs fused" and "iteration vs fused",
medians over --rounds interleaved rounds.

    torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --impls ddp_fused,shardadam --batches 8
    torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --capture --batches 4 --out results.json
    torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --fsdp2-step --batches 4 --out results.json
    torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --tiny [--capture]  # smoke run, CPU (gloo) or GPU
"""
from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import shardadam
from harness import (add_run_args, choose, finish, fmt, memory_figures, optimizer_bytes, parse_gpt_args, pct,
                     results_table, run_case, say, start_gpt)
from models import add_size_args, build_model, lm_loss, make_batch
from timing import capture_graph, interleaved, sync, timed_calls

IMPLS = ("ddp_fused", "fsdp2", "zero1", "shardadam", "shardadam_contiguous_grads", "shardadam_contiguous_masters",
         "shardadam_nccl_grads", "shardadam_nccl")
BASELINE, REFERENCE = "compute_only", "ddp_fused"
SHARDED_STEP = {"fsdp2", "zero1", *(i for i in IMPLS if i.startswith("shardadam"))}  # each rank updates 1/N
WEIGHT_DECAY = 0.1
WARMUP = 3
BF16 = dict(param_sync_dtype=torch.bfloat16)
# --capture: name -> (parameter dtype, DistributedFusedAdam storage options)
STORAGE = {
    "fp32": (torch.float32, {}), "bf16": (torch.bfloat16, BF16),
    "bf16_remainders": (torch.bfloat16, dict(BF16, store_param_remainders=True, store_params=False)),
    "bf16_scaled_states": (torch.bfloat16, dict(BF16, with_scaled_states=True, dtype=torch.float16)),
    "bf16_no_master": (torch.bfloat16, dict(BF16, store_params=False)),
}
CONFIGS, MODES = (REFERENCE, *STORAGE), ("eager", "captured")
MAX_NORM = 1.0
# Eager and captured runs do the same arithmetic, up to the order of atomic additions in a few kernels (different
# implementations of the same training ended 2e-3 apart without capture). A broken capture (stale parameters, a step not
# applied) departs by far more.
LOSS_TOLERANCE = 0.02
FSDP2_OPTIMIZERS = {"shardadam": shardadam.FusedAdam, "torch_fused": partial(torch.optim.AdamW, fused=True),
                    "torch_foreach": partial(torch.optim.AdamW, foreach=True)}
STEP_GOAL = 0.6  # --fsdp2-step: shardadam's step time over torch fused's, at most

# GradScaler warns that it will stop passing itself to step(grad_scaler=...),
# which is how DistributedFusedAdam receives it: once per rank, not actionable here.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


def adamw(params, args, cuda: bool):
    # torch's fused AdamW runs on CUDA; the CPU smoke run uses the default one.
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=WEIGHT_DECAY, fused=cuda or None)


def build_ddp(model, args, cuda, zero1=False):
    """DDP with torch's AdamW, or (zero1) with ZeroRedundancyOptimizer's partition of it."""
    ddp = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if cuda else None)
    if zero1:
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr,
                                            weight_decay=WEIGHT_DECAY, fused=cuda or None)
    return ddp, adamw(ddp.parameters(), args, cuda)


def build_fsdp2(model, args, cuda, reshard_after_forward=False):
    # Not resharded by default: the fastest FSDP2 (ZeRO-2-like), which this
    # benchmark compares; bench_capacity.py reshards (ZeRO-3, the leanest).
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model, adamw(model.parameters(), args, cuda)


def build_shardadam(model, args, cuda, **options):
    # apex's recommended setup: both directions overlapped, all-gathers landing
    # in the parameters themselves (on the copy engines between GPUs of one host).
    return model, shardadam.DistributedFusedAdam(
        model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY, bucket_cap_mb=args.bucket_cap_mb,
        overlap_grad_sync=True, overlap_param_sync=True, contiguous_param_buffer=True, **options)


BUILDERS = {BASELINE: lambda model, args, cuda: (model, adamw(model.parameters(), args, cuda)),
            "ddp_fused": build_ddp, "fsdp2": build_fsdp2, "zero1": partial(build_ddp, zero1=True),
            "shardadam": build_shardadam,
            "shardadam_contiguous_grads": partial(build_shardadam, contiguous_grad_buffer=True),
            "shardadam_contiguous_masters": partial(build_shardadam, contiguous_grad_buffer=True, store_params=True),
            "shardadam_nccl_grads": partial(build_shardadam, grad_sync_copy_engine=False),
            "shardadam_nccl": partial(build_shardadam, grad_sync_copy_engine=False, param_sync_copy_engine=False)}


def run_one(name: str, mode: None, batch: int, args, dev: torch.device, n_params: int) -> dict:
    """`name` on a fresh model: WARMUP iterations, then `iters` timed ones: median ms per iteration and per
    phase (forward+backward, step), the wall-clock mean over the timed loop, memory and losses."""
    cuda = dev.type == "cuda"

    def train():
        module, opt = BUILDERS[name](build_model(args, dev), args, cuda)
        inputs, targets = make_batch(args, batch, dev)

        def iteration(watch) -> torch.Tensor:
            watch.mark()
            loss = lm_loss(module, inputs, targets, cuda)
            loss.backward()
            watch.mark()
            opt.step()
            opt.zero_grad(set_to_none=True)
            watch.mark()
            return loss.detach()
        laps, wall, losses = timed_calls(iteration, cuda, args.iters, WARMUP)
        if isinstance(opt, shardadam.DistributedFusedAdam):
            opt.param_sync()  # overlap_param_sync leaves the last all-gathers running
        fwd_bwd, step = (statistics.median(col) for col in zip(*laps))
        return dict(ms=statistics.median(sum(lap) for lap in laps), fwd_bwd_ms=fwd_bwd, step_ms=step, wall_ms=wall,
                    **memory_figures(opt, cuda)), torch.stack(losses).float().tolist()
    return run_case(dict(impl=name, batch=batch), train, dev, n_params)


def run_captured(config: str, mode: str, batch: int, args, dev: torch.device, n_params: int) -> dict:
    """`config` on a fresh model with a GradScaler and clipping, in `mode`: WARMUP eager iterations (on a side
    stream before a capture: the first learns the bucket order, the scaler makes its tensors), `iters` back to
    back, `iters` more each from an idle device timed on the host; the medians, memory and every loss."""
    cuda = dev.type == "cuda"

    def train():
        scaler, model = torch.amp.GradScaler(dev.type), build_model(args, dev)
        if config == REFERENCE:
            module, opt = build_ddp(model, args, cuda)

            def clip() -> None:  # torch's way: unscale the gradients in place, then clip them
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_NORM)
        else:  # applied inside step() to the unscaled norm; nothing is read back to the host
            dtype, options = STORAGE[config]
            module, opt = build_shardadam(model.to(dtype), args, cuda, capturable=cuda, **options)
            clip = partial(opt.clip_grad_norm, MAX_NORM)
        source = make_batch(args, batch, dev)
        static = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in source]
        load = partial(torch._foreach_copy_, static, source)

        def eager() -> torch.Tensor:
            load()
            opt.zero_grad()
            loss = lm_loss(module, *static, cuda)  # fp32: a bf16 loss is too coarse to show a few iterations' fall
            scaler.scale(loss).backward()
            clip()
            scaler.step(opt)
            scaler.update()
            return loss.detach()
        if mode == "eager":
            warm, step = [eager() for _ in range(WARMUP)], eager
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
            return loss.clone()  # a replay overwrites its static loss
        laps, wall, losses = timed_calls(call, cuda, args.iters)
        host, _, more = timed_calls(call, cuda, args.iters, idle=True, host=True)
        opt.zero_grad()  # gradients freed, as between iterations (DDP keeps them until then)
        return dict(ms=statistics.median(lap for lap, in laps), wall_ms=wall,
                    host_ms=statistics.median(lap for lap, in host), **memory_figures(opt, cuda)), \
            torch.stack(warm + losses + more).float().tolist()
    return run_case(dict(config=config, mode=mode, batch=batch, capturable=cuda and config != REFERENCE), train, dev,
                    n_params, keep_losses=True)


def run_fsdp2_step(name: str, batch: int, args, dev: torch.device, n_params: int) -> dict:
    """A fresh model sharded per block and at the root, WARMUP iterations, then `iters` with the step timed alone (host
    clock, synchronised before and after it; step_host: until step() returned), then `iters` back to back."""
    cuda = dev.type == "cuda"

    def run():
        model = build_model(args, dev)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else \
            MixedPrecisionPolicy()
        for module in [*model.blocks, model]:
            fully_shard(module, reshard_after_forward=False, mp_policy=policy)
        opt = FSDP2_OPTIMIZERS[name](model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY)
        inputs, targets = make_batch(args, batch, dev)

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
    return run_case(dict(impl=name, batch=batch), run, dev, n_params)


def fsdp2_step(args, dev: torch.device, n_params: int, meta: dict) -> None:
    """--fsdp2-step: per batch size, FSDP2_OPTIMIZERS in interleaved rounds; the medians over rounds, every round's
    values, the ratios to torch fused AdamW and the goals."""
    summary, per_round, goals = [], [], []
    for batch in args.batches:
        def one(name):
            r = run_fsdp2_step(name, batch, args, dev, n_params)
            say(f"{name} batch {batch}: " + (f"failed: {r['error']}" if r["error"] else
                f"step {r['step_ms']:.2f} ms (host {r['step_host_ms']:.2f}), iteration {r['iter_ms']:.1f} ms, "
                f"loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}"))
            return r
        rounds = interleaved({name: partial(one, name) for name in FSDP2_OPTIMIZERS}, args.rounds)
        per_round += [[rounds[n][k] for n in rounds] for k in range(args.rounds)]
        rows = {}
        for name, runs in rounds.items():
            failed = [r["error"] for r in runs if r["error"]]
            out = rows[name] = dict(impl=name, batch=batch, error=failed[0] if failed else None)
            if not failed:
                out.update(loss_ok=all(r["loss_ok"] for r in runs), opt_bytes_per_param=runs[0]["opt_bytes_per_param"])
                for key in ("step_ms", "step_host_ms", "iter_ms"):
                    out[key] = statistics.median(r[key] for r in runs)
                    out[key.replace("_ms", "_rounds_ms")] = [r[key] for r in runs]
        ref, mine = rows["torch_fused"], rows["shardadam"]
        for out in rows.values():
            if not (out["error"] or ref["error"]):
                out.update(step_vs_torch_fused=out["step_ms"] / ref["step_ms"],
                           iter_vs_torch_fused=out["iter_ms"] / ref["iter_ms"])
        goals.append(f"goals, batch {batch}: " + (
            f"shardadam step {mine['step_vs_torch_fused']:.3f}x torch fused's (target <= {STEP_GOAL}): "
            f"{mine['step_vs_torch_fused'] <= STEP_GOAL}; iteration {mine['iter_vs_torch_fused']:.3f}x (target < 1): "
            f"{mine['iter_vs_torch_fused'] < 1}; losses finite and falling: {mine['loss_ok']}"
            if "step_vs_torch_fused" in mine else "not measured (shardadam or torch_fused failed)"))
        summary += rows.values()
    say("", results_table(summary, ["impl", "batch"], [
        ("step ms", "step_ms", ".2f"), ("step host ms", "step_host_ms", ".2f"), ("iteration ms", "iter_ms", ".1f"),
        ("step vs fused", "step_vs_torch_fused", ".3f"), ("iteration vs fused", "iter_vs_torch_fused", ".3f"),
        ("opt B/param", "opt_bytes_per_param", ".2f")]), *goals)
    finish(args.out, meta=meta, summary=summary, rounds=per_round)


def add_ratios(results: list[dict], world: int) -> None:
    """vs DDP, and exposed communication: the share of an iteration beyond compute_only's forward+backward
    plus its step (1/N of it for an implementation that shards the optimizer)."""
    by = {(r["impl"], r["batch"]): r for r in results if not r["error"]}
    for r in by.values():
        ddp, base = by.get((REFERENCE, r["batch"])), by.get((BASELINE, r["batch"]))
        r["vs_ddp"] = r["ms"] / ddp["ms"] if ddp else None
        r["exposed_comm"] = None
        if base and r["impl"] != BASELINE:
            compute = base["fwd_bwd_ms"] + base["step_ms"] / (world if r["impl"] in SHARDED_STEP else 1)
            r["compute_only_ms"] = compute
            r["exposed_comm"] = (r["ms"] - compute) / r["ms"]


def goals(results: list[dict], world: int) -> list[str]:
    """The issue's goals for shardadam, one line per implementation and batch size."""
    lines = []
    for r in results:
        if not r["impl"].startswith("shardadam") or r["error"]:
            continue
        others = [o for o in results if o["batch"] == r["batch"] and o["impl"] in IMPLS
                  and not o["impl"].startswith("shardadam") and not o["error"]]
        lines.append(f"{r['impl']} batch {r['batch']}: faster than {len(others)} others: "
                     f"{all(r['ms'] < o['ms'] for o in others)}; vs DDP {fmt(r['vs_ddp'], '.3f')} (target 0.9); "
                     f"exposed comm {pct(r['exposed_comm'])} (target < 10%); "
                     f"optimizer {r['opt_bytes_per_param']:.2f} B/param (12/N = {12 / world:.2f} plus buffers)")
    return lines


def judge_capture(results: list[dict]) -> list[str]:
    """Time and host time against DDP's eager run and, captured, against its own eager run's (and losses); the
    failed checks."""
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


MEMORY_COLUMNS = [("peak GiB", "peak_gib", ".2f"), ("opt B/param", "opt_bytes_per_param", ".2f"),
                  ("resident B/param", "resident_bytes_per_param", ".2f")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(ap)
    ap.add_argument("--batches", help="batch sizes per GPU, comma-separated (default 4,8)")
    ap.add_argument("--iters", type=int, help=f"timed iterations after {WARMUP} warm-up ones (default 10; twice with "
                                              "--capture: GPU time, then host time)")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    ap.add_argument("--capture", action="store_true", help="eager and captured storage modes instead of --impls")
    ap.add_argument("--fsdp2-step", action="store_true", help="FusedAdam against torch's AdamW on FSDP2 instead")
    ap.add_argument("--rounds", type=int, help="--fsdp2-step: interleaved rounds of each optimizer (default 2)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="--capture: comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--modes", default=",".join(MODES),
                    help="--capture: comma-separated subset of " + ",".join(MODES) + f" ({REFERENCE} runs eager only)")
    add_run_args(ap)
    args = parse_gpt_args(ap)
    args.impls = choose(ap, args.impls, IMPLS, "--impls")
    args.configs, args.modes = choose(ap, args.configs, CONFIGS, "--configs"), choose(ap, args.modes, MODES, "--modes")
    if args.capture and args.fsdp2_step:
        ap.error("--capture and --fsdp2-step are two benchmarks: choose one")
    dev, cuda, n_params, meta = start_gpt(args)
    world = dist.get_world_size()
    if args.fsdp2_step:
        return fsdp2_step(args, dev, n_params, meta)
    if args.capture:
        if not cuda and "captured" in args.modes:
            say("captured mode skipped: CUDA graphs need CUDA (this run is eager only, capturable=False)")
        # (config, mode) in order: the reference first, each captured run after its eager one
        modes = [m for m in MODES if m in args.modes and (cuda or m == "eager")]
        runs = [(c, m) for c in CONFIGS if c in args.configs for m in (["eager"] if c == REFERENCE else modes)]
    else:
        runs = [(name, None) for name in [BASELINE] + args.impls]
    results = []
    for batch in args.batches:
        for name, mode in runs:
            r = (run_captured if args.capture else run_one)(name, mode, batch, args, dev, n_params)
            results.append(r)
            figures = f"failed: {r['error']}" if r["error"] else (
                f"{r['ms']:.1f} ms/iter" + (f", host {r['host_ms']:.2f} ms/iter" if mode else "")
                + f", loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}"
                + ("" if mode or r["loss_ok"] else "  (loss not finite, or not falling)"))
            say(f"{name}{f' {mode}' if mode else ''} batch {batch}: {figures}")
    if args.capture:
        failed = judge_capture(results)
        compared = sum(r.get("loss_matches_eager") is not None for r in results)
        say("", results_table(results, ["config", "mode", "batch"], [
            ("ms/iter", "ms", ".1f"), ("vs DDP", "vs_ddp", ".3f"), ("vs eager", "vs_eager", ".3f"),
            ("host ms/iter", "host_ms", ".2f"), ("host vs DDP", "host_vs_ddp", ".3f"),
            ("host vs eager", "host_vs_eager", ".3f"), *MEMORY_COLUMNS,
            ("loss first -> last", lambda r: f"{r['loss_first']:.4f} -> {r['loss_last']:.4f}", None),
            ("loss diff vs eager", "loss_diff_vs_eager", ".2e")], "llrrrrrrrrrrlr"),
            "\n".join(failed) or "every loss finite and falling" + (
                f"; {compared} captured runs within {LOSS_TOLERANCE} of their eager runs' losses" if compared else ""))
    else:
        add_ratios(results, world)
        failed = []
        say("", results_table(results, ["impl", "batch"], [
            ("ms/iter", "ms", ".1f"), ("vs DDP", "vs_ddp", ".3f"), *MEMORY_COLUMNS,
            ("exposed comm", lambda r: pct(r["exposed_comm"]), None)]), *goals(results, world))
    rank0 = dist.get_rank() == 0  # each rank judges its own losses: rank 0 speaks for the run
    finish(args.out, meta=meta, results=results)
    if rank0 and failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
