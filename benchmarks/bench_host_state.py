#!/usr/bin/env python
"""An optimizer with its state in host memory against its state on the GPU, with the iteration's floors.

Goal (issue): an iteration with state on the host within 1.2x of its largest
floor. Judged by the iteration over the largest floor (forward and backward;
the PCIe copies of gradients down and parameters up, both at once; the CPU step
alone), taken within each of --rounds interleaved rounds as the host's speed
drifts, and over the CPU step while both copies run. Per storage kind: state on
the GPU, state_device="cpu" and, with --optimizer distributed, stepped during
backward; --torchao adds torchao's CPUOffloadOptimizer, --timeline records one
host-state iteration for svg.py. GPU only.

    python benchmarks/bench_host_state.py --d-model 2048 --layers 24 --out host.json --timeline tl.json
    python benchmarks/bench_host_state.py --optimizer distributed --kinds fp32 --out host_dist.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

import shardadam
from harness import init_distributed, init_one_rank, write_json
from models import BLOCKWISE8, FULL, add_size_args, build_model, lm_loss
from shardadam import _fused_buckets, _host_state
from shardadam._rules import AdamRule
from shardadam.distributed import _host_shards
from timing import interleaved, median_ms


def timed(fn, reps: int, warmup: int) -> float:
    """Median wall milliseconds of fn, synchronised around each call."""
    return median_ms(fn, "cuda", reps, warmup)


KIND_OPTIONS = {"fp32": {}, "8-bit": BLOCKWISE8}


class Transfers:
    """Page-locked copies of nbytes each way: the gradients down, the
    parameters up (the pipeline's bytes, as one large copy each)."""

    def __init__(self, nbytes: int):
        self.up_host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        self.up_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.down_host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        self.down_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.side = torch.cuda.Stream()

    def down(self):
        self.down_host.copy_(self.down_dev, non_blocking=True)

    def up(self):
        self.up_dev.copy_(self.up_host, non_blocking=True)

    def both(self):
        """Both queued at once (the link is full duplex); returns before they end."""
        self.up()
        with torch.cuda.stream(self.side):
            self.down()
        torch.cuda.current_stream().wait_stream(self.side)

    def times(self, reps: int) -> dict:
        return dict(down=timed(self.down, reps, 2), up=timed(self.up, reps, 2), both=timed(self.both, reps, 2))


def interleaved_rounds(goal_iteration, cpu_step, transfers: Transfers, rounds: int, reps: int) -> list[dict]:
    """Per round, back to back, each a median of reps: the host-state
    iteration, the CPU step alone, the CPU step while both copies run, and the
    copies alone. The host's speed drifts by up to a third between minutes
    and processes (RESULTS.md), so an iteration is compared with the floors of
    its own round rather than with floors taken minutes apart."""
    cases = dict(iteration_ms=goal_iteration, host_step_ms=cpu_step,
                 host_step_with_transfers_ms=lambda: (transfers.both(), cpu_step()), transfers_ms=transfers.both)
    timings = interleaved({k: partial(timed, fn, reps=reps, warmup=1) for k, fn in cases.items()}, rounds)
    out = [{k: v[i] for k, v in timings.items()} for i in range(rounds)]
    for r in out:
        print("round", json.dumps({k: round(v, 1) for k, v in r.items()}), flush=True)
    return out


def record_timeline(run, distributed: bool) -> dict:
    """Spans (start, end) in ms from the start of one call of run: "compute"
    on the current stream, "down" and "up" on the copy streams (CUDA
    events), "cpu" on the host clock (the CPU engine's launches, from any
    thread). distributed: DistributedFusedAdam's host shards, else FusedAdam's
    segments."""
    spans = {"compute": [], "down": [], "cpu": [], "up": []}
    events = []

    def timing_event(stream=None):
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def around_copy(name, original, stream_index):
        def wrapped(seg):
            start = timing_event(seg.streams[stream_index])
            original(seg)
            events.append((name, start, timing_event(seg.streams[stream_index])))
        return wrapped

    def around_launch(original):
        def wrapped(*a, **k):
            t = time.perf_counter()
            original(*a, **k)
            spans["cpu"].append(((t - t0) * 1e3, (time.perf_counter() - t0) * 1e3))
        return wrapped

    def around_shard_copy(original):
        def wrapped(shards, stream, *a, **k):
            start = timing_event(stream)
            done = original(shards, stream, *a, **k)
            events.append(("down" if stream is shards._down else "up", start, timing_event(stream)))
            return done
        return wrapped

    if distributed:
        patches = [(_host_shards.HostShards, "_copy", around_shard_copy(_host_shards.HostShards._copy)),
                   (AdamRule, "launch", around_launch(AdamRule.launch))]
    else:
        segment = _host_state._Segment
        patches = [(segment, "send_grads_down", around_copy("down", segment.send_grads_down, 0)),
                   (segment, "send_params_up", around_copy("up", segment.send_params_up, 1)),
                   (_fused_buckets.Bucket, "launch", around_launch(_fused_buckets.Bucket.launch))]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, fn in patches:
        setattr(owner, name, fn)
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        origin = timing_event()
        run(lambda name, start, end: events.append((name, start, end)), timing_event)
        torch.cuda.synchronize()
        total = (time.perf_counter() - t0) * 1e3
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    for name, start, end in events:
        spans[name].append((origin.elapsed_time(start), origin.elapsed_time(end)))
    return dict(spans=spans, total_ms=total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(ap, None, FULL)
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

    distributed = args.optimizer == "distributed"
    if distributed and "WORLD_SIZE" in os.environ:  # torchrun: one rank per GPU
        init_distributed("cuda")
    elif distributed:
        init_one_rank("cuda")
    model = build_model(args, "cpu").cuda()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device="cuda")

    def forward_backward():
        lm_loss(model, tokens[:, :-1], tokens[:, 1:], cuda=True).backward()

    def iteration(opt, set_to_none=False):
        def run():
            opt.zero_grad(set_to_none=set_to_none)
            forward_backward()
            opt.step()
        return run

    def make(kind: str, **extra):
        optimizer = shardadam.DistributedFusedAdam if distributed else shardadam.FusedAdam
        return optimizer(params, lr=1e-5, **KIND_OPTIONS[kind], **extra)

    ranks = dist.get_world_size() if distributed else 1
    result = dict(model=dict(d_model=args.d_model, layers=args.layers, params=numel, batch=args.batch,
                             seq=args.seq), gpu=torch.cuda.get_device_name(), threads=torch.get_num_threads(),
                  torch=torch.__version__, date=time.strftime("%Y-%m-%d"), optimizer=args.optimizer, ranks=ranks,
                  kinds={})
    result["compute_ms"] = timed(lambda: (model.zero_grad(set_to_none=False), forward_backward()), args.reps, 2)
    transfer_bytes = 4 * numel // ranks  # this rank's shard each way
    result["transfer_ms"] = Transfers(transfer_bytes).times(args.reps)
    print(json.dumps({k: v for k, v in result.items() if k != "kinds"}), flush=True)
    for kind in args.kinds.split(","):
        row = {}
        variants = [("gpu_state", {}), ("host_state", dict(state_device="cpu"))]
        if distributed:
            variants.append(("host_state_in_backward", dict(state_device="cpu", host_step_in_backward=True)))
        goal_where = variants[-1][0]  # the fastest way this optimizer keeps state on the host
        for where, extra in variants:
            opt = make(kind, **extra)
            row[where + "_ms"] = timed(iteration(opt), args.reps, 2)
            if where == "host_state" and not distributed:
                row["host_state_step_ms"] = timed(opt.step, args.reps, 1)
            if where == goal_where and args.timeline and kind == args.kinds.split(",")[0]:
                def one_iteration(note, timing_event, opt=opt):
                    opt.zero_grad(set_to_none=False)
                    start = timing_event()
                    forward_backward()
                    note("compute", start, timing_event())
                    opt.step()
                timeline = record_timeline(one_iteration, distributed)
                timeline.update(model=result["model"], kind=kind, gpu=result["gpu"], date=result["date"],
                                optimizer=type(opt).__name__ + (", host_step_in_backward" if distributed else ""))
                write_json(args.timeline, indent=None, **timeline)
                del one_iteration  # it holds opt
            if where != goal_where:
                del opt
                torch.cuda.empty_cache()
        goal_opt = opt
        # The CPU engine alone on this rank's share of the elements.
        cpu_params = [torch.nn.Parameter(torch.zeros(numel // ranks))] if distributed else \
            [torch.nn.Parameter(p.detach().cpu()) for p in params]
        for p in cpu_params:
            p.grad = torch.randn_like(p)
        cpu_opt = shardadam.FusedAdam(cpu_params, lr=1e-5, **KIND_OPTIONS[kind])
        t0 = time.perf_counter()
        cpu_opt.step()  # first step: plans and state
        row["host_step_first_ms"] = (time.perf_counter() - t0) * 1e3
        # The host's memory floor: the same CPU step while the transfers' bytes
        # cross host memory too (the copy engines write the gradients into it
        # and read the parameters out of it), as they must in every iteration.
        transfers = Transfers(transfer_bytes)
        row["rounds"] = interleaved_rounds(iteration(goal_opt), cpu_opt.step, transfers, args.rounds, args.reps)
        del goal_opt, opt, cpu_opt, cpu_params, transfers
        torch.cuda.empty_cache()
        if args.torchao and kind == "fp32":
            from torchao.optim import CPUOffloadOptimizer
            opt = CPUOffloadOptimizer(params, torch.optim.AdamW, lr=1e-5, fused=True)
            row["torchao_cpu_offload_ms"] = timed(iteration(opt, set_to_none=True), args.reps, 2)  # it asks for None
            row["torchao_over_host_state"] = row["torchao_cpu_offload_ms"] / row["host_state_ms"]
            del opt
            torch.cuda.empty_cache()
        rounds = row["rounds"]
        row["host_step_floor_ms"] = statistics.median(r["host_step_ms"] for r in rounds)
        row["host_step_with_transfers_ms"] = statistics.median(r["host_step_with_transfers_ms"] for r in rounds)
        floors = dict(compute=result["compute_ms"], host_step=row["host_step_floor_ms"],
                      transfers=result["transfer_ms"]["both"])
        row["largest_floor"] = max(floors, key=floors.get)
        row["iteration_over_largest_floor"] = row["host_state_ms"] / max(floors.values())
        row["iteration_over_host_memory_floor"] = row["host_state_ms"] / row["host_step_with_transfers_ms"]
        row["gpu_idle_share"] = 1 - result["compute_ms"] / row["host_state_ms"]
        row["host_over_gpu_state"] = row["host_state_ms"] / row["gpu_state_ms"]
        if distributed:
            in_backward = row["host_state_in_backward_ms"]
            row["in_backward_over_largest_floor"] = in_backward / max(floors.values())
            row["in_backward_over_host_memory_floor"] = in_backward / row["host_step_with_transfers_ms"]
            row["in_backward_gpu_idle_share"] = 1 - result["compute_ms"] / in_backward
        # The goal's ratio taken within each round, where the host's speed is
        # the same for the iteration and its floors.
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
