#!/usr/bin/env python
"""DistributedFusedAdam against DDP + fused AdamW, FSDP2 and ZeroRedundancyOptimizer, in one run.

A GPT-style model (default: d_model 2048, 24 layers, 16 heads, vocab 50304,
sequence 1024, untied head: about 1.4B parameters; fp32 parameters, bf16
autocast on the GPU) trained for a few iterations with each implementation in
turn, the model rebuilt from the same seed each time:

- ddp_fused: DistributedDataParallel + torch.optim.AdamW(fused=True)
- fsdp2:     fully_shard(reshard_after_forward=False) per block and root + AdamW(fused=True)
- zero1:     DistributedDataParallel + ZeroRedundancyOptimizer(AdamW, fused=True)
- shardadam: shardadam.DistributedFusedAdam (no wrapper: it broadcasts the
             parameters and synchronises the gradients itself); between GPUs
             of one host its reduce-scatter and all-gather run on the copy engines
- shardadam_contiguous_grads: the same, autograd accumulating into the buckets
  (fp32: the parameter shard is the master and, reduced by NCCL, the reduced
  gradient shard is the rank's part of the gradient buffer: 8 + 8/N bytes)
- shardadam_contiguous_masters: the same with store_params=True (an fp32
  master of its own, 4/N bytes more)
- shardadam_nccl_grads: the same, the reduce-scatter on NCCL (grad_sync_copy_engine=False)
- shardadam_nccl: the same, both on NCCL (grad_ and param_sync_copy_engine=False)

plus compute_only, the same iteration on one rank's model with no collective
at all (the baseline for exposed communication). For every implementation and
batch size per GPU: median ms per iteration, ratio to ddp_fused, peak memory,
optimizer bytes per parameter, resident bytes per parameter, exposed
communication, and rank 0's first and last loss (checked: every loss finite,
the last below the first).

    torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --out results.json
    torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --impls ddp_fused,shardadam --batches 8
    torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --tiny      # smoke run, CPU (gloo) or GPU

NCCL with one GPU per rank (cuda:LOCAL_RANK) when CUDA is available, gloo on
the CPU otherwise (fp32, no autocast: the CPU run checks the wiring, its
timings mean little).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from itertools import pairwise

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import shardadam
from shardadam.distributed import BucketRows

IMPLS = ("ddp_fused", "fsdp2", "zero1", "shardadam", "shardadam_contiguous_grads", "shardadam_contiguous_masters",
         "shardadam_nccl_grads", "shardadam_nccl")
BASELINE = "compute_only"
SHARDED_STEP = {"fsdp2", "zero1", *(i for i in IMPLS if i.startswith("shardadam"))}  # each rank updates 1/N of the parameters
WEIGHT_DECAY = 0.1
WARMUP = 3

# The tiny model's 135k parameters fill several 0.1 MiB buckets, some parameters
# split across two, as the full model fills 100 MiB ones.
FULL = dict(d_model=2048, layers=24, heads=16, vocab=50304, seq=1024, batches="4,8", iters=10, bucket_cap_mb=100)
TINY = dict(d_model=64, layers=2, heads=4, vocab=256, seq=32, batches="2", iters=5, bucket_cap_mb=0.1)


# ------------------------------------------------------------------ model

class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and learned position embeddings, blocks, final LayerNorm, untied LM head."""

    def __init__(self, d: int, layers: int, heads: int, vocab: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for m in self.modules():  # GPT-2's init: the first loss is then about ln(vocab)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(args, dev: torch.device) -> GPT:
    # The same seed on every rank: FSDP2 shards each rank's own copy, so the
    # copies must be equal; DDP and DistributedFusedAdam broadcast rank 0's anyway.
    torch.manual_seed(args.seed)
    with dev:
        return GPT(args.d_model, args.layers, args.heads, args.vocab, args.seq)


def make_batch(args, batch: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed batch of random tokens per rank, reused every iteration: the
    model memorises it, so the loss falls within a few iterations (on fresh
    uniform tokens it would start at its minimum, ln(vocab), and stay there)."""
    g = torch.Generator(device=dev).manual_seed(args.seed + 1 + dist.get_rank())
    tokens = torch.randint(args.vocab, (batch, args.seq + 1), generator=g, device=dev)
    return tokens[:, :-1], tokens[:, 1:]


# ------------------------------------------------------------------ implementations

def fused(cuda: bool) -> dict:
    # torch's fused AdamW runs on CUDA; the CPU smoke run uses the default one.
    return dict(fused=True) if cuda else {}


def build_compute_only(model, args, cuda):
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY, **fused(cuda))


def build_ddp_fused(model, args, cuda):
    ddp = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if cuda else None)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY, **fused(cuda))


def build_fsdp2(model, args, cuda, reshard_after_forward=False):
    # Not resharded by default: the fastest FSDP2 (ZeRO-2-like), which this
    # benchmark compares; bench_capacity.py reshards (ZeRO-3, the leanest).
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY, **fused(cuda))


def build_zero1(model, args, cuda):
    ddp = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if cuda else None)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr,
                                  weight_decay=WEIGHT_DECAY, **fused(cuda))
    return ddp, opt


def build_shardadam(model, args, cuda, **options):
    # apex's recommended setup: both directions overlapped, all-gathers landing
    # in the parameters themselves (on the copy engines between GPUs of one host).
    opt = shardadam.DistributedFusedAdam(model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY,
                                         bucket_cap_mb=args.bucket_cap_mb, overlap_grad_sync=True,
                                         overlap_param_sync=True, contiguous_param_buffer=True, **options)
    return model, opt


BUILDERS = {BASELINE: build_compute_only, "ddp_fused": build_ddp_fused, "fsdp2": build_fsdp2,
            "zero1": build_zero1, "shardadam": build_shardadam,
            # the same, with gradients accumulated by autograd straight into the buckets
            "shardadam_contiguous_grads": functools.partial(build_shardadam, contiguous_grad_buffer=True),
            "shardadam_contiguous_masters": functools.partial(build_shardadam, contiguous_grad_buffer=True,
                                                              store_params=True),
            # the same, with the reduce-scatter (and the all-gather) on NCCL instead of the copy engines
            "shardadam_nccl_grads": functools.partial(build_shardadam, grad_sync_copy_engine=False),
            "shardadam_nccl": functools.partial(build_shardadam, grad_sync_copy_engine=False,
                                                param_sync_copy_engine=False)}


# ------------------------------------------------------------------ measurement

class Stopwatch:
    """Marks within one iteration: CUDA events on the GPU (read after the loop,
    so timing adds no host sync between iterations), the host clock on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def laps_ms(self) -> list[float]:
        if self.cuda:
            return [a.elapsed_time(b) for a, b in pairwise(self.marks)]
        return [(b - a) * 1e3 for a, b in pairwise(self.marks)]


def make_iteration(module, opt, inputs, targets, cuda: bool):
    """One training iteration, marked after backward and after the optimizer step."""
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def iteration(watch: Stopwatch) -> torch.Tensor:
        watch.mark()
        with amp:
            logits = module(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        watch.mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        watch.mark()
        return loss.detach()
    return iteration


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def measure(iteration, cuda: bool, iters: int) -> dict:
    """WARMUP iterations, then `iters` timed ones: median ms per iteration and per
    phase (forward+backward, step), the wall-clock mean over the timed loop
    (synchronised around it), and every iteration's loss."""
    losses, watches = [], []
    for i in range(WARMUP + iters):
        if i == WARMUP:
            sync(cuda)
            t0 = time.perf_counter()
        watch = Stopwatch(cuda)
        losses.append(iteration(watch))
        watches.append(watch)
    sync(cuda)
    wall = (time.perf_counter() - t0) * 1e3 / iters
    laps = [w.laps_ms() for w in watches[WARMUP:]]
    fwd_bwd, step = (statistics.median(col) for col in zip(*laps))
    return dict(ms=statistics.median(sum(lap) for lap in laps), fwd_bwd_ms=fwd_bwd, step_ms=step,
                wall_ms=wall, losses=torch.stack(losses).float().tolist())


def held_tensors(opt) -> list[torch.Tensor]:
    """The tensors an optimizer keeps between steps: torch optimizers' `state`
    (ZeroRedundancyOptimizer keeps this rank's partition in its inner
    optimizer, `opt.optim`; FSDP2's states are DTensors), FusedAdam's and
    FusedLion's flat buckets (with state on the host, their segments'
    buckets), and DistributedFusedAdam's attributes: sharded states (by name
    in `states`, fp16 scales in `state_scales`), masters, shards and buffers
    (BucketRows). Its `state` is empty and its state_dict() gathers the full
    states on every rank, so there is no public per-rank view to read."""
    inner = getattr(opt, "optim", opt)
    tensors = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    for b in getattr(opt, "_buckets", None) or []:
        for bucket in [b] + [seg.bucket for seg in getattr(b, "segments", [])]:
            tensors += [t for t in vars(bucket).values() if torch.is_tensor(t)]
            for held in ("states", "scales", "blocks"):
                for v in getattr(bucket, held, {}).values():
                    tensors += v if isinstance(v, list) else [v]
    tensors += [v for v in vars(opt).values() if torch.is_tensor(v)]
    tensors += [t for v in vars(opt).values() if isinstance(v, BucketRows) for t in v.tensors]
    for held in (getattr(opt, "states", None), getattr(opt, "state_scales", None)):
        tensors += list((held or {}).values()) if isinstance(held, dict) else []
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def optimizer_bytes(opt) -> int:
    """Bytes of the tensors the optimizer keeps on this rank between steps
    (held_tensors), each storage once, leaving out DistributedFusedAdam's
    param_buffer and grad_buffer and the shards that are parts of them: they
    hold the model's own parameters and gradients, not optimizer memory."""
    model = {t.untyped_storage().data_ptr() for name in ("param_buffer", "grad_buffer")
             if isinstance(getattr(opt, name, None), BucketRows) for t in getattr(opt, name).tensors}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held_tensors(opt) if t.numel()}
    return sum(size for ptr, size in storages.items() if ptr not in model)  # each storage once


def agree_on_error(error: str | None, dev: torch.device) -> str | None:
    """Every rank skips an implementation that failed on any rank, so that all
    ranks go on to the same next collective. This covers failures that hit the
    ranks at the same point (an unsupported option, out of memory); a rank that
    fails while the others wait inside a collective leaves them waiting until
    the process group's timeout."""
    failed = torch.tensor([error is not None], dtype=torch.int32, device=dev)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    return error or ("failed on another rank" if failed.item() else None)


def max_over_ranks(values: list[float], dev: torch.device) -> list[float]:
    """The slowest rank sets the pace of a data-parallel job, the fullest one its memory."""
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def free(cuda: bool) -> None:
    gc.collect()  # FSDP2 and DDP leave reference cycles: collect before measuring memory
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_one(name: str, batch: int, args, dev: torch.device, n_params: int) -> dict:
    """Build `name` on a fresh model, train it, and report its figures."""
    cuda = dev.type == "cuda"
    free(cuda)
    error = None
    try:
        module, opt = BUILDERS[name](build_model(args, dev), args, cuda)
        inputs, targets = make_batch(args, batch, dev)
        timing = measure(make_iteration(module, opt, inputs, targets, cuda), cuda, args.iters)
        if isinstance(opt, shardadam.DistributedFusedAdam):
            opt.param_sync()  # overlap_param_sync leaves the last all-gathers running
    except Exception as e:  # recorded, and the other implementations still run
        traceback.print_exc()
        error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    result = dict(impl=name, batch=batch, error=agree_on_error(error, dev))
    if result["error"]:
        return result
    sync(cuda)
    # Between iterations (gradients freed): parameters, optimizer states, buffers.
    resident = torch.cuda.memory_allocated() if cuda else 0
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    ms, fwd_bwd, step, wall, opt_bytes, peak, resident = max_over_ranks(
        [timing["ms"], timing["fwd_bwd_ms"], timing["step_ms"], timing["wall_ms"], optimizer_bytes(opt), peak,
         resident], dev)
    losses = timing["losses"]  # rank 0's: each rank has its own batch
    result.update(ms=ms, fwd_bwd_ms=fwd_bwd, step_ms=step, wall_ms=wall, opt_bytes_per_param=opt_bytes / n_params,
                  peak_gib=peak / 2**30 if cuda else None,
                  resident_bytes_per_param=resident / n_params if cuda else None,
                  loss_first=losses[0], loss_last=losses[-1],
                  loss_ok=all(math.isfinite(x) for x in losses) and losses[-1] < losses[0])
    return result


def add_ratios(results: list[dict], world: int) -> None:
    """vs DDP, and exposed communication: the share of an iteration beyond its
    compute. Compute is the compute_only run's forward+backward plus its local
    step, or 1/N of that step for an implementation that shards the optimizer;
    whatever else an iteration takes (collectives not hidden behind compute, and
    the implementation's own gradient packing and parameter copies) is exposed."""
    by = {(r["impl"], r["batch"]): r for r in results if not r["error"]}
    for r in by.values():
        ddp, base = by.get(("ddp_fused", r["batch"])), by.get((BASELINE, r["batch"]))
        r["vs_ddp"] = r["ms"] / ddp["ms"] if ddp else None
        r["exposed_comm"] = None
        if base and r["impl"] != BASELINE:
            compute = base["fwd_bwd_ms"] + base["step_ms"] / (world if r["impl"] in SHARDED_STEP else 1)
            r["compute_only_ms"] = compute
            r["exposed_comm"] = (r["ms"] - compute) / r["ms"]


# ------------------------------------------------------------------ report

def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(results: list[dict]) -> str:
    lines = ["| impl | batch | ms/iter | vs DDP | peak GiB | opt B/param | resident B/param | exposed comm |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r["error"]:
            lines.append(f"| {r['impl']} | {r['batch']} | failed: {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['impl']} | {r['batch']} | {r['ms']:.1f} | {fmt(r['vs_ddp'], '.3f')} | "
                     f"{fmt(r['peak_gib'], '.2f')} | {r['opt_bytes_per_param']:.2f} | "
                     f"{fmt(r['resident_bytes_per_param'], '.2f')} | {pct(r['exposed_comm'])} |")
    return "\n".join(lines)


def goals(results: list[dict], world: int) -> list[str]:
    """The issue's goals for shardadam, one line per batch size."""
    lines = []
    for r in results:
        if not r["impl"].startswith("shardadam") or r["error"]:
            continue
        others = [o for o in results if o["batch"] == r["batch"] and o["impl"] in IMPLS
                  and not o["impl"].startswith("shardadam") and not o["error"]]
        fastest = all(r["ms"] < o["ms"] for o in others)
        lines.append(f"{r['impl']} batch {r['batch']}: faster than {len(others)} others: {fastest}; "
                     f"vs DDP {fmt(r['vs_ddp'], '.3f')} (target 0.9); "
                     f"exposed comm {pct(r['exposed_comm'])} (target < 10%); "
                     f"optimizer {r['opt_bytes_per_param']:.2f} B/param (12/N = {12 / world:.2f} plus buffers)")
    return lines


# ------------------------------------------------------------------ main

def add_size_args(ap: argparse.ArgumentParser) -> None:
    """The GPT's size options, shared by the benchmarks built on this model."""
    ap.add_argument("--tiny", action="store_true", help=f"smoke run, CPU or GPU: {TINY}")
    for name, what in (("d-model", "model width"), ("layers", "transformer blocks"), ("heads", "attention heads"),
                       ("vocab", "vocabulary"), ("seq", "sequence length")):
        key = name.replace("-", "_")
        ap.add_argument(f"--{name}", type=int, help=f"{what} (default {FULL[key]}; --tiny {TINY[key]})")


def fill_defaults(args, full: dict, keys=None) -> None:
    """Whatever was not given (of `keys`, default all), from TINY with --tiny,
    else from `full`: explicit arguments win."""
    defaults = TINY if args.tiny else full
    for key in keys or defaults:
        if getattr(args, key, None) is None:
            setattr(args, key, defaults[key])


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(ap)
    ap.add_argument("--batches", help="batch sizes per GPU, comma-separated (default 4,8)")
    ap.add_argument("--iters", type=int, help=f"timed iterations after {WARMUP} warm-up ones (default 10)")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--bucket-cap-mb", type=float, help="DistributedFusedAdam's bucket size in MiB (default 100)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args()
    fill_defaults(args, FULL)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.impls = args.impls.split(",")
    if args.iters < 1:
        ap.error("--iters must be at least 1")
    unknown = set(args.impls) - set(IMPLS)
    if unknown:
        ap.error(f"unknown --impls {sorted(unknown)}; choose from {IMPLS}")
    return args


def run_meta(args, dev: torch.device, cuda: bool, n_params: int) -> dict:
    """Where, when and how a benchmark ran, for its JSON."""
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=shlex.join(sys.argv), torch=torch.__version__, cuda=torch.version.cuda,
                nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                shardadam=shardadam.__version__, python=platform.python_version(),
                device=torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
                backend=dist.get_backend(), world_size=dist.get_world_size(), params=n_params,
                config={k: v for k, v in vars(args).items() if k != "out"})


def describe(meta: dict, args) -> str:
    """The first line rank 0 prints: the machine and the model."""
    return (f"{meta['device']} x {meta['world_size']} ({meta['backend']}), torch {meta['torch']}, shardadam "
            f"{meta['shardadam']}: GPT d_model {args.d_model}, {args.layers} layers, {args.heads} heads, "
            f"vocab {args.vocab}, seq {args.seq}: {meta['params']:,} parameters")


def init_distributed() -> tuple[torch.device, bool]:
    """The process group of a torchrun process: NCCL with one GPU per process
    (cuda:LOCAL_RANK) when CUDA is available, gloo on the CPU otherwise."""
    cuda = torch.cuda.is_available()
    if cuda:
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    return dev, cuda


def main() -> None:
    args = parse_args()
    dev, cuda = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    n_params = sum(p.numel() for p in build_model(args, torch.device("meta")).parameters())
    meta = run_meta(args, dev, cuda, n_params)
    if rank == 0:
        print(describe(meta, args), flush=True)

    results = []
    for batch in args.batches:
        for name in [BASELINE] + args.impls:
            r = run_one(name, batch, args, dev, n_params)
            results.append(r)
            if rank == 0:
                status = (f"failed: {r['error']}" if r["error"] else
                          f"{r['ms']:.1f} ms/iter, loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}"
                          f"{'' if r['loss_ok'] else '  (loss not finite, or not falling)'}")
                print(f"{name} batch {batch}: {status}", flush=True)
    add_ratios(results, world)

    if rank == 0:
        print()
        print(table(results))
        print("\n".join(goals(results, world)))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(meta=meta, results=results), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
