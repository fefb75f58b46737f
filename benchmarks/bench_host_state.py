#!/usr/bin/env python
"""An optimizer with its state in host memory against its state on the GPU, with the iteration's floors.

Goal (issue): an iteration with state on the host within 1.2x of its largest floor. Judged by the iteration over the
largest floor (forward and backward; the PCIe copies of gradients down and parameters up, both at once; the CPU step
alone), taken within each of --rounds interleaved rounds as the host's speed drifts, and over the CPU step while
both copies run. Per storage kind: state on the GPU, state_device="cpu" and, with --optimizer distributed, stepped
during backward; --torchao adds torchao's CPUOffloadOptimizer, --timeline records one host-state iteration for
svg.py. GPU only.

    python benchmarks/bench_host_state.py --d-model 2048 --layers 24 --out host.json --timeline tl.json
    python benchmarks/bench_host_state.py --optimizer distributed --kinds fp32 --out host_dist.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from functools import partial
from unittest import mock

import torch
import torch.distributed as dist

import shardadam
from harness import init_distributed, run_meta, write_json
from models import BLOCKWISE8, FULL, SIZE_KEYS, add_size_args, build_model, fill_defaults, lm_loss
from shardadam import _fused_buckets, _host_state
from shardadam._rules import AdamRule
from shardadam.distributed import _host_shards
from timing import interleaved, median_ms

KIND_OPTIONS = {"fp32": {}, "8-bit": BLOCKWISE8}
timed = partial(median_ms, dev="cuda")  # wall milliseconds, synchronised around each call


def pcie_copies(nbytes: int) -> dict:
    """Page-locked copies of nbytes each way: the gradients "down", the parameters "up" (one large copy each), and
    "both" queued at once (the link is full duplex; it returns before they end)."""
    host = [torch.empty(nbytes, dtype=torch.uint8).pin_memory() for _ in range(2)]
    dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    down, up = partial(host[0].copy_, dev[0], non_blocking=True), partial(dev[1].copy_, host[1], non_blocking=True)
    side = torch.cuda.Stream()

    def both():
        up()
        with torch.cuda.stream(side):
            down()
        torch.cuda.current_stream().wait_stream(side)
    return dict(down=down, up=up, both=both)


def record_timeline(run, distributed: bool) -> dict:
    """Spans (start, end) in ms from the start of one call of run(note, event): "compute" on the current stream, "down"
    and "up" on the copy streams (CUDA events), "cpu" on the host clock (the CPU engine's launches, from any thread).
    distributed: DistributedFusedAdam's host shards, else FusedAdam's segments."""
    spans, events = {"compute": [], "down": [], "cpu": [], "up": []}, []

    def event(stream=None):
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def spanned(original, lane):
        """original with its span recorded: lane(*args) gives its lane and stream (None: on the host clock)."""
        def wrapped(*a, **k):
            name, stream = lane(*a)
            start = event(stream) if stream is not None else time.perf_counter()
            out = original(*a, **k)
            if stream is not None:
                events.append((name, start, event(stream)))
            else:
                spans[name].append(((start - t0) * 1e3, (time.perf_counter() - t0) * 1e3))
            return out
        return wrapped

    def on_host(*a):
        return "cpu", None
    seg = _host_state._Segment
    patches = [(_host_shards.HostShards, "_copy", lambda shards, stream, *a: (
                    "down" if stream is shards._down else "up", stream)), (AdamRule, "launch", on_host)] \
        if distributed else [(seg, "send_grads_down", lambda s: ("down", s.streams[0])),
                             (seg, "send_params_up", lambda s: ("up", s.streams[1])),
                             (_fused_buckets.Bucket, "launch", on_host)]
    with contextlib.ExitStack() as stack:
        for owner, name, lane in patches:
            stack.enter_context(mock.patch.object(owner, name, spanned(getattr(owner, name), lane)))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        origin = event()
        run(lambda name, start, end: events.append((name, start, end)), event)
        torch.cuda.synchronize()
        total = (time.perf_counter() - t0) * 1e3
    for name, start, end in events:
        spans[name].append((origin.elapsed_time(start), origin.elapsed_time(end)))
    return dict(spans=spans, total_ms=total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(ap)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--kinds", default="fp32,8-bit")
    ap.add_argument("--optimizer", choices=("fused", "distributed"), default="fused")
    ap.add_argument("--torchao", action="store_true", help="also time torchao's CPUOffloadOptimizer (fp32)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds of the host-state iteration interleaved with the host floors (each --reps calls)")
    ap.add_argument("--out")
    ap.add_argument("--timeline", help="write one host-state iteration's timeline here (JSON)")
    args = ap.parse_args()
    fill_defaults(args, FULL, SIZE_KEYS)
    distributed = args.optimizer == "distributed"
    if distributed:  # torchrun: one rank per GPU
        init_distributed("cuda")
    model = build_model(args, "cpu").cuda()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device="cuda")

    def forward_backward():
        lm_loss(model, tokens[:, :-1], tokens[:, 1:], cuda=True).backward()

    def iteration(opt, set_to_none=False):
        return lambda: (opt.zero_grad(set_to_none=set_to_none), forward_backward(), opt.step())

    ranks = dist.get_world_size() if distributed else 1
    result = dict(run_meta("cuda"), model=dict(d_model=args.d_model, layers=args.layers, params=numel,
                                               batch=args.batch, seq=args.seq), optimizer=args.optimizer, kinds={})
    result["compute_ms"] = timed(lambda: (model.zero_grad(set_to_none=False), forward_backward()), reps=args.reps,
                                 warmup=2)
    transfer_bytes = 4 * numel // ranks  # this rank's shard each way
    result["transfer_ms"] = {k: timed(fn, reps=args.reps, warmup=2) for k, fn in pcie_copies(transfer_bytes).items()}
    print(json.dumps({k: v for k, v in result.items() if k != "kinds"}), flush=True)
    for kind in args.kinds.split(","):
        row = {}
        variants = [("gpu_state", {}), ("host_state", dict(state_device="cpu"))] + (
            [("host_state_in_backward", dict(state_device="cpu", host_step_in_backward=True))] if distributed else [])
        goal_where = variants[-1][0]  # the fastest way this optimizer keeps state on the host
        optimizer = shardadam.DistributedFusedAdam if distributed else shardadam.FusedAdam
        for where, extra in variants:
            opt = optimizer(params, lr=1e-5, **KIND_OPTIONS[kind], **extra)
            row[where + "_ms"] = timed(iteration(opt), reps=args.reps, warmup=2)
            if where == "host_state" and not distributed:
                row["host_state_step_ms"] = timed(opt.step, reps=args.reps, warmup=1)
            if where == goal_where and args.timeline and kind == args.kinds.split(",")[0]:
                def one_iteration(note, event, opt=opt):
                    opt.zero_grad(set_to_none=False)
                    start = event()
                    forward_backward()
                    note("compute", start, event())
                    opt.step()
                timeline = record_timeline(one_iteration, distributed)
                timeline.update(model=result["model"], kind=kind, gpu=result["device"], date=result["date"][:10],
                                optimizer=type(opt).__name__ + (", host_step_in_backward" if distributed else ""))
                write_json(args.timeline, indent=None, **timeline)
                del one_iteration  # it holds opt
            if where != goal_where:
                del opt
                torch.cuda.empty_cache()
        # The CPU engine alone on this rank's share of the elements, and the host's memory floor: the same CPU step
        # while the transfers' bytes cross host memory too (the copy engines write the gradients into it and read the
        # parameters out of it), as they must in every iteration.
        cpu_params = [torch.nn.Parameter(torch.zeros(numel // ranks))] if distributed else \
            [torch.nn.Parameter(p.detach().cpu()) for p in params]
        for p in cpu_params:
            p.grad = torch.randn_like(p)
        cpu_step = shardadam.FusedAdam(cpu_params, lr=1e-5, **KIND_OPTIONS[kind]).step
        cpu_step()  # first step: plans and state
        both = pcie_copies(transfer_bytes)["both"]
        # Per round, back to back, each a median of reps: the host-state iteration, the CPU step alone, the CPU step
        # while both copies run, and the copies alone. The host's speed drifts by up to a third between minutes and
        # processes (RESULTS.md), so an iteration is compared with the floors of its own round.
        cases = dict(iteration_ms=iteration(opt), host_step_ms=cpu_step,
                     host_step_with_transfers_ms=lambda: (both(), cpu_step()), transfers_ms=both)
        timings = interleaved({k: partial(timed, fn, reps=args.reps, warmup=1) for k, fn in cases.items()}, args.rounds)
        rounds = row["rounds"] = [{k: v[i] for k, v in timings.items()} for i in range(args.rounds)]
        for r in rounds:
            print("round", json.dumps({k: round(v, 1) for k, v in r.items()}), flush=True)
        del opt, cpu_step, cpu_params, cases, both
        torch.cuda.empty_cache()
        if args.torchao and kind == "fp32":
            from torchao.optim import CPUOffloadOptimizer
            opt = CPUOffloadOptimizer(params, torch.optim.AdamW, lr=1e-5, fused=True)
            # set_to_none: it asks for None
            row["torchao_cpu_offload_ms"] = timed(iteration(opt, set_to_none=True), reps=args.reps, warmup=2)
            row["torchao_over_host_state"] = row["torchao_cpu_offload_ms"] / row["host_state_ms"]
            del opt
            torch.cuda.empty_cache()
        row["host_step_floor_ms"] = statistics.median(r["host_step_ms"] for r in rounds)
        row["host_step_with_transfers_ms"] = statistics.median(r["host_step_with_transfers_ms"] for r in rounds)
        floors = dict(compute=result["compute_ms"], host_step=row["host_step_floor_ms"],
                      transfers=result["transfer_ms"]["both"])
        row["largest_floor"] = max(floors, key=floors.get)
        for prefix, where in [("", "host_state")] + ([("in_backward_", goal_where)] if distributed else []):
            row[f"{prefix or 'iteration_'}over_largest_floor"] = row[where + "_ms"] / max(floors.values())
            row[f"{prefix or 'iteration_'}over_host_memory_floor"] = \
                row[where + "_ms"] / row["host_step_with_transfers_ms"]
            row[f"{prefix}gpu_idle_share"] = 1 - result["compute_ms"] / row[where + "_ms"]
        row["host_over_gpu_state"] = row["host_state_ms"] / row["gpu_state_ms"]
        # The goal's ratio taken within each round, where the host's speed is the same for the iteration and its floors.
        by_round = [r["iteration_ms"] / max(result["compute_ms"], r["transfers_ms"], r["host_step_ms"]) for r in rounds]
        by_round_memory = [r["iteration_ms"] / r["host_step_with_transfers_ms"] for r in rounds]
        row["goal"] = dict(iteration=goal_where, over_largest_floor_by_round=by_round,
                           over_largest_floor_median=statistics.median(by_round),
                           over_host_memory_floor_by_round=by_round_memory,
                           over_host_memory_floor_median=statistics.median(by_round_memory))
        result["kinds"][kind] = row
        print(kind, json.dumps(row), flush=True)
    if not distributed or dist.get_rank() == 0:
        write_json(args.out, **result)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
