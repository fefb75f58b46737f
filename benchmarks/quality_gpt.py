#!/usr/bin/env python
"""Training quality of DistributedFusedAdam's storage kinds at scale, side by side in one run.

Goal: each low-bit storage kind ends within 1% of fp32's final loss, and no worse than the peers' optimizers of the same
kind (bitsandbytes, torchao: one rank, the whole model, torch's clip_grad_norm_); Muon + AdamW (DistributedFusedMuon)
beside AdamW, each over --lr-scales, is reported as measured. Judged by "vs fp32": the final loss (mean of the last
tenth of the steps) over fp32's. The GPT of models.py learning Python source byte by byte, from the same seed on the
same global batches with each kind in turn; curves as CSV, SVG and JSON.

    torchrun --nproc_per_node 1 benchmarks/quality_gpt.py --steps 300 --out results/quality_gpt_h200
    torchrun --nproc_per_node 1 benchmarks/quality_gpt.py --kinds "fp32,8-bit blockwise states,bitsandbytes AdamW8bit"
    torchrun --nproc_per_node 1 benchmarks/quality_gpt.py --kinds "fp32,Muon + AdamW" --lr-scales 0.5,1,2
    torchrun --nproc_per_node 2 benchmarks/quality_gpt.py --tiny --steps 30     # smoke run, CPU (gloo) or GPU
"""
from __future__ import annotations

import argparse
import gc
import importlib
import pathlib
import statistics
import time

import torch
import torch.distributed as dist

import shardadam
from harness import fmt, parse_gpt_args, start_gpt
from models import FULL, KINDS, SIZE_KEYS, add_size_args, build_model, lm_loss
from quality_storage import MUON, add_kind_args, muon_groups, report, runs_of, write_curves
from train import corpus, learning_rate, mean_over_ranks, param_groups, rank_slice, sample_batch  # examples/

# The kinds of quality_storage.py that DistributedFusedAdam takes as they are
# (it keeps fp32 masters for bf16 parameters unless they round stochastically).
DISTRIBUTED_KINDS = ("fp32", "FP8 states", "FP8 exp_avg", "8-bit blockwise states", "bf16 stochastic rounding")
# The peers' low-bit AdamW on one rank: name -> (parameter dtype, module, class, options).
PEER_KINDS = {"bitsandbytes AdamW8bit": (torch.float32, "bitsandbytes.optim", "AdamW8bit", {}),
    "torchao AdamW8bit": (torch.float32, "torchao.optim", "AdamW8bit", {}),
    "torchao AdamWFp8": (torch.float32, "torchao.optim", "AdamWFp8", {}),
    "torchao bf16 stochastic rounding": (torch.bfloat16, "torchao.optim", "_AdamW", dict(bf16_stochastic_round=True)),
}
KNOWN = (*DISTRIBUTED_KINDS, *PEER_KINDS, MUON)
SMOOTH = 10  # steps per point of the plotted curves


def build_optimizer(name: str, model: torch.nn.Module, args):
    """The kind's optimizer on `model` and its clipping call."""
    if name in PEER_KINDS:
        _, module, cls, options = PEER_KINDS[name]
        opt = getattr(importlib.import_module(module), cls)(param_groups(model, 0.1), lr=args.lr, **options)
        return opt, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if name == MUON:
        opt = shardadam.DistributedFusedMuon(muon_groups(model, 0.1), lr=args.lr, adjust_lr_fn="match_rms_adamw",
                                             bucket_cap_mb=args.bucket_cap_mb)
        return opt, lambda: opt.clip_grad_norm(1.0)
    opt = shardadam.DistributedFusedAdam(param_groups(model, 0.1), lr=args.lr, bucket_cap_mb=args.bucket_cap_mb,
                                         overlap_grad_sync=True, overlap_param_sync=True,
                                         contiguous_param_buffer=True, **KINDS[name][1])
    return opt, lambda: opt.clip_grad_norm(1.0)


def smoothed(curves: dict[str, list[float]]) -> dict[str, list[float]]:
    """The curves as running means over SMOOTH steps (one step's loss on a batch of a few sequences is noisy), values
    above the first loss drawn at it so that a diverging kind leaves the others readable."""
    cap = max(c[0] for c in curves.values())
    windows = {name: [c[max(0, i + 1 - SMOOTH):i + 1] for i in range(len(c))] for name, c in curves.items()}
    return {name: [min(cap, sum(w) / len(w)) for w in ws] for name, ws in windows.items()}


def train_kind(name: str, kind: str, args, data: torch.Tensor, dev: torch.device, cuda: bool) -> dict:
    """One run of a kind from the common seed: the global loss of every step, ms per step (median) and this rank's
    peak GPU memory."""
    dtype = PEER_KINDS[kind][0] if kind in PEER_KINDS else torch.float32 if kind == MUON else KINDS[kind][0]
    model = build_model(args, dev).to(dtype)
    opt, clip = build_optimizer(kind, model, args)
    gen = torch.Generator().manual_seed(args.seed + 1)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    losses, times = [], []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = learning_rate(step, args)
        batch = rank_slice(sample_batch(gen, data, args.batch * dist.get_world_size(), args.seq)).to(dev)
        (loss := lm_loss(model, batch[:, :-1], batch[:, 1:], cuda)).backward()
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(mean_over_ranks(loss))  # synchronises: the step is done
        times.append((time.perf_counter() - t0) * 1e3)
        if dist.get_rank() == 0 and (step % args.log_every == 0 or step == 1):
            print(f"{name:>24} step {step:4d}  loss {losses[-1]:.4f}  {times[-1]:6.1f} ms", flush=True)
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None
    del model, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return dict(losses=losses, ms=statistics.median(times[len(times) // 10:]), peak_gib=peak)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_args(ap)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank and step (default 4)")
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (20 warm-up steps, cosine to 0)")
    ap.add_argument("--bucket-cap-mb", type=float, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chars", type=int, default=4_000_000, help="bytes of Python source to sample from")
    add_kind_args(ap, ",".join(DISTRIBUTED_KINDS), KNOWN)
    ap.add_argument("--out", type=pathlib.Path, help="rank 0 writes <out>.csv, <out>.svg and <out>.json")
    args = parse_gpt_args(ap, FULL, SIZE_KEYS)
    if args.steps < 10:
        ap.error("--steps must be at least 10 (the final loss is the mean of the last tenth)")
    args.log_every = max(1, args.steps // 10)
    dev, cuda, _, meta = start_gpt(args)
    runs = runs_of(ap, args, KNOWN)
    if dist.get_world_size() > 1 and any(kind in PEER_KINDS for _, kind, _ in runs):
        ap.error("--kinds: the peers' optimizers are not distributed: run them with --nproc_per_node 1")
    data = torch.frombuffer(bytearray(corpus(args.chars).encode()), dtype=torch.uint8).long()
    runs = {name: train_kind(name, kind, run_args, data, dev, cuda) for name, kind, run_args in runs}
    if dist.get_rank() == 0:
        curves = {name: r["losses"] for name, r in runs.items()}
        final = report(curves, args.steps, f", {dist.get_world_size()} ranks", {
            "ms / step": [f"{r['ms']:.1f}" for r in runs.values()],
            "peak GiB (rank 0)": [fmt(r["peak_gib"], ".1f") for r in runs.values()]})
        if args.out:
            title = f"GPT {meta['params'] / 1e9:.2f}B, {args.steps} steps, {meta['world_size']} x {meta['device']}"
            write_curves(args.out, curves, f"{title}, DistributedFusedAdam and peers; running mean of {SMOOTH} steps, capped at "
                         "the first loss", smoothed(curves), meta=meta,
                         kinds={name: dict(final=final[name], ms=r["ms"], peak_gib=r["peak_gib"])
                                for name, r in runs.items()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
