#!/usr/bin/env python
"""Capacity: the largest GPT that trains on these GPUs, per optimizer and storage kind.

Goal: DistributedFusedAdam's low-bit kinds train larger models than DDP and FSDP2 with fp32 AdamW on the same GPUs,
and FusedAdam with its state in host memory (host:KIND; torchao: its CPUOffloadOptimizer) several times the size.
Judged by the largest depth (and parameters) that trains per candidate, against DDP's. The GPT of models.py at a
fixed width grown in depth, two iterations with finite losses; each attempt a fresh torchrun (an out-of-memory error
leaves torch and NCCL in no state to go on), walking up from --start while the model trains and down while it does
not. Each attempt's line has its GPU peak, host resident memory and seconds per iteration.

    python benchmarks/bench_capacity.py --nproc 2 --out results/capacity_2xh200.jsonl
    python benchmarks/bench_capacity.py --candidates "host:8-bit blockwise states" --batch 1 --layers 48  # host state
    python benchmarks/bench_capacity.py --d-model 64 --heads 4 --vocab 256 --seq 32 --layers 1,2 --start 1  # CPU
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist

import shardadam
from bench_distributed import build_ddp, build_fsdp2, build_shardadam
from harness import agree_on_error, choose, fmt, init_distributed, max_over_ranks, md_table, rss_bytes
from models import BLOCKWISE8, KINDS as STORAGE_KINDS, STOCHASTIC, build_model, lm_loss

# name -> (parameter dtype, DistributedFusedAdam / FusedAdam options)
KINDS = {name: STORAGE_KINDS[name] for name in ("fp32", "FP8 states", "8-bit blockwise states")}
KINDS["bf16 stochastic rounding + 8-bit states"] = (torch.bfloat16, {**STOCHASTIC, **BLOCKWISE8})
CANDIDATES = ("ddp", "fsdp2", *(f"shardadam:{kind}" for kind in KINDS))  # the default: state on the GPUs
HOST_CANDIDATES = (*(f"host:{kind}" for kind in KINDS), "torchao")
GIB = 2**30


def build(candidate: str, model, args, cuda: bool):
    """(module to call, optimizer) for one candidate on a fresh model:
    bench_distributed.py's builders, or an optimizer with its state on the host."""
    if candidate == "ddp":
        return build_ddp(model, args, cuda)
    if candidate == "fsdp2":
        return build_fsdp2(model, args, cuda, reshard_after_forward=True)
    if candidate == "torchao":
        from torchao.optim import CPUOffloadOptimizer
        return model, CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=args.lr, fused=True)
    where, kind = candidate.split(":", 1)
    if where == "host":
        return model, shardadam.FusedAdam(model.parameters(), lr=args.lr, state_device="cpu", **KINDS[kind][1])
    return build_shardadam(model, args, cuda, contiguous_grad_buffer=True, **KINDS[kind][1])


def attempt(args) -> None:
    """One model size, one candidate: rank 0 prints a JSON line."""
    dev, cuda = init_distributed()
    result = dict(candidate=args.candidate, d_model=args.d_model, layers=args.layers, heads=args.heads,
                  batch=args.batch, seq=args.seq, ranks=dist.get_world_size())
    error = None
    # GiB of GPU memory allocated after each phase and the peak within it: where it goes.
    phases = result["gib_allocated_and_peak"] = {}
    peaks = [0.0]

    def reached(phase: str) -> None:
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated(dev) / GIB)
            phases[phase] = [round(torch.cuda.memory_allocated(dev) / GIB, 2), round(peaks[-1], 2)]
            torch.cuda.reset_peak_memory_stats(dev)

    try:
        dtype = KINDS[args.candidate.split(":", 1)[1]][0] if ":" in args.candidate else torch.float32
        model = build_model(args, dev, dtype)  # seed 0 on every rank: FSDP2 shards copies
        result["params"] = sum(p.numel() for p in model.parameters())
        reached("model")
        module, opt = build(args.candidate, model, args, cuda)
        reached("optimizer")
        tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), device=dev,
                               generator=torch.Generator(dev).manual_seed(dist.get_rank()))
        losses, seconds = [], []
        for i in range(1, 3):
            t0 = time.perf_counter()
            loss = lm_loss(module, tokens[:, :-1], tokens[:, 1:], cuda)
            reached(f"forward {i}")
            loss.backward()
            reached(f"backward {i}")
            opt.step()
            reached(f"step {i}")
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            seconds.append(time.perf_counter() - t0)
        result.update(losses=losses, seconds_per_iteration=seconds, trains=all(v == v for v in losses))
    except (torch.OutOfMemoryError, RuntimeError) as e:
        where = traceback.extract_tb(e.__traceback__)[-3:]
        error = (f"{type(e).__name__}: {str(e).splitlines()[0][:200]} (after {list(phases)[-1:]}, in "
                 + "; ".join(f"{pathlib.Path(f.filename).name}:{f.lineno} {f.name}" for f in where) + ")")
    error = agree_on_error(error, dev)
    if error:
        result.update(error=error, trains=False)
    peak = max(peaks + [torch.cuda.max_memory_allocated(dev) / GIB]) if cuda else 0.0  # the failing phase's too
    peak, resident = max_over_ranks([peak, rss_bytes() / GIB], dev)
    result.update(gpu_peak_gib=peak if cuda else None, host_resident_gib=resident)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def run_attempt(args, candidate: str, layers: int) -> dict:
    """A fresh torchrun for one size; one that ends without a result (killed, hung past --timeout) does not train."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
           os.path.abspath(__file__), "--attempt", "--candidate", candidate, "--layers", str(layers),
           "--d-model", str(args.d_model), "--heads", str(args.heads), "--vocab", str(args.vocab),
           "--seq", str(args.seq), "--batch", str(args.batch), "--bucket-cap-mb", str(args.bucket_cap_mb)]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout).stdout
    except subprocess.TimeoutExpired:
        out = ""
    lines = [line[len("RESULT "):] for line in out.splitlines() if line.startswith("RESULT ")]
    result = json.loads(lines[-1]) if lines else dict(candidate=candidate, d_model=args.d_model, layers=layers,
                                                      trains=False, error="no result (crashed or timed out)")
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def search(args, candidate: str, record) -> dict | None:
    """The attempt that trains with the most layers of args.layers, walking from --start, or None."""
    depths = args.layers
    i = min(range(len(depths)), key=lambda j: abs(depths[j] - args.start))
    best, tried = None, {}
    while 0 <= i < len(depths) and depths[i] not in tried:
        result = tried[depths[i]] = run_attempt(args, candidate, depths[i])
        record(result)
        if result["trains"]:
            best = result
            i += 1
        else:
            i -= 1
    return best  # the walk ends on a depth it tried already: the boundary, from either side


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=1, help="ranks (GPUs) per attempt")
    ap.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated subset of: "
                    + ", ".join(CANDIDATES + HOST_CANDIDATES) + " (default: those with state on the GPUs)")
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank (default 4)")
    ap.add_argument("--layers", default=",".join(map(str, range(16, 129, 4))),
                    help="depths to try, comma-separated, ascending (default 16 to 128 by 4)")
    ap.add_argument("--start", type=int, default=36, help="the depth each search starts from")
    ap.add_argument("--bucket-cap-mb", type=float, default=100, help="DistributedFusedAdam's bucket size in MiB")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one attempt may take")
    ap.add_argument("--out", help="append every attempt here as a JSON line")
    ap.add_argument("--attempt", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--candidate", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.lr = 1e-4  # what the builders train with: two steps only, any small rate does
    if args.attempt:
        args.layers = int(args.layers)
        attempt(args)
        return
    args.layers = [int(v) for v in str(args.layers).split(",")]
    candidates = choose(ap, args.candidates, CANDIDATES + HOST_CANDIDATES, "--candidates")
    if args.layers != sorted(args.layers):
        ap.error("--layers must be ascending")

    def record(result: dict) -> None:
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")

    best = {c: search(args, c, record) for c in candidates}
    print(f"\nlargest GPT that trains (d_model {args.d_model}, batch {args.batch} x {args.seq} per rank, "
          f"{args.nproc} rank(s)):")
    ddp = best.get("ddp")
    print(md_table(["candidate", "layers", "parameters", "GPU peak, GiB", "host resident, GiB", "parameters vs DDP"], [
        [c, f"none of {args.layers[0]}-{args.layers[-1]}", "-", "-", "-", "-"] if r is None else
        [c, r["layers"], f"{r['params'] / 1e9:.2f}B", fmt(r.get("gpu_peak_gib"), ".1f"),
         fmt(r.get("host_resident_gib"), ".1f"), fmt(r["params"] / ddp["params"] if ddp else None, ".2f")]
        for c, r in best.items()]))


if __name__ == "__main__":
    main()
