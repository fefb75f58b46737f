#!/usr/bin/env python
"""Checkpoint save and load of DistributedFusedAdam: time and peak host/device memory per rank.

Goal: a large model's checkpoint saves and loads in seconds, bit for bit, with at most one bucket of extra device
memory. Judged by each format's save and load seconds and GB/s, and their peak host and device memory (maximum over
ranks). Formats: portable (state_dict(gather_on_root=True), rank 0 writes, every rank reads), its gather on every rank,
and sharded (torch.distributed.checkpoint of sharded_state_dict()). Phases run between barriers; files leave the page
cache before each load; one more iteration between save and load gives the load something to restore, bit for bit.

    torchrun --nproc_per_node 2 benchmarks/bench_checkpoint.py --out results.json --dir /tmp/ckpt
    torchrun --nproc_per_node 2 benchmarks/bench_checkpoint.py --tiny --dir /tmp/ckpt_tiny   # smoke run
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import threading
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import shardadam
from bench_distributed import WEIGHT_DECAY
from harness import (add_run_args, choose, fmt, md_table, parse_gpt_args, release_host_memory, rss_bytes, say,
                     start_gpt, write_json)
from models import FULL, SIZE_KEYS, add_size_args, build_model, lm_loss, make_batch
from shardadam.distributed.sharded_checkpoint import local_pieces
from timing import sync

STATE_BYTES_PER_PARAM = 12  # fp32 master, exp_avg, exp_avg_sq: what every format moves
PORTABLE, EVERY_RANK, SHARDED = "portable", "portable, every rank", "sharded (DCP)"
FORMATS = ("portable", "every-rank", "sharded")  # --formats names of the three
MIB = 2**20


class Phases:
    """Each phase timed on every rank between barriers, its records kept; rank 0 prints each phase's row (maximum over
    ranks) as soon as it ends, and rewrites --out with everything so far."""

    def __init__(self, out: str | None, meta: dict, cuda: bool):
        self.out, self.meta, self.cuda, self.t0, self.records = out, meta, cuda, time.perf_counter(), []

    def run(self, fmt_name: str, name: str, part: str | None, fn, nbytes=None):
        """fn() on every rank; returns fn's result and records its wall seconds and host and device memory at the start
        and at the peak (host: sampled by a thread, as ru_maxrss only ever grows). `part` ("save" or "load") groups
        phases into the totals; nbytes (a number, or a function called after the phase: a file's size) are the bytes it
        moved."""
        release_host_memory()
        sync(self.cuda)
        dist.barrier()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        record = dict(format=fmt_name, phase=name, part=part, bytes=nbytes, file_bytes=None,
                      device_start=torch.cuda.memory_allocated() if self.cuda else None,
                      host_start=rss_bytes(), host_peak=rss_bytes())
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.005):
                record["host_peak"] = max(record["host_peak"], rss_bytes())
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        result = fn()
        sync(self.cuda)
        record["seconds"] = time.perf_counter() - t0
        done.set()
        sampler.join()
        record.update(host_peak=max(record["host_peak"], rss_bytes()),
                      device_peak=torch.cuda.max_memory_allocated() if self.cuda else None)
        self.records.append(record)
        dist.barrier()  # after the record: a rank's time is its own work, not its wait for the others
        if callable(nbytes):  # every rank's files are written now
            record["bytes"] = record["file_bytes"] = nbytes()
        self.report()
        return result

    def report(self, show: bool = True) -> list[dict] | None:
        """Every rank's records so far (one collective, outside the timed phases); rank 0 prints the last phase's row
        (with show), rewrites --out and returns the rows."""
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, self.records)
        if dist.get_rank() != 0:
            return None
        rows, last = summarise(per_rank), self.records[-1]
        for r in rows:
            if show and (r["format"], r["phase"]) == (last["format"], last["phase"]):
                print(f"  {r['format']:<22} {r['phase']:<25} {r['seconds']:8.3f} s   peak host "
                      f"{r['peak_host_mib']:9.1f} MiB   peak device {fmt(r['peak_device_mib'], '9.1f')} MiB",
                      flush=True)
        write_json(self.out, meta=dict(self.meta, wall_seconds=time.perf_counter() - self.t0), rows=rows,
                   records=per_rank)
        return rows


def files(path: str) -> list[str]:
    return [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def train_step(model, opt, inputs, targets, cuda: bool) -> None:
    lm_loss(model, inputs, targets, cuda).backward()
    opt.step()  # overlap_param_sync=False: step() ends with the parameter all-gather
    opt.zero_grad()


def snapshot(model, opt, portable: bool) -> dict:
    """Copies of what a checkpoint must bring back, on this rank: its pieces of every state (together the ranks' pieces
    are the whole state), the groups' steps and hyperparameters, and the model's parameters (load makes them the loaded
    masters); with portable, the whole portable state_dict() as well. Every rank must call it."""
    pieces = [piece.clone() for state in opt.sharded_state_dict()["state"].values() for _, piece in local_pieces(state)]
    return dict(pieces=pieces, groups=[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
                params=[p.detach().clone() for p in model.parameters()],
                portable=opt.state_dict() if portable else None)


def same(a, b) -> bool:
    """Bit for bit (NaNs and signed zeros included), through dicts and lists."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def dcp_read(opt, directory: str) -> dict:
    state = {"optimizer": opt.sharded_state_dict()}  # the template dcp.load fills, in place where it can
    dcp.load(state, checkpoint_id=directory)
    return state


def row(fmt_name: str, name: str, per_rank: list[list[dict]]) -> dict:
    """One table row from each rank's records of it (one phase, or a part's phases in order): the maximum over ranks,
    and every rank's values; peaks above the first record's start, in MiB (None without a device)."""
    def increase(recs, key):
        start = recs[0][f"{key}_start"]
        return None if start is None else (max(r[f"{key}_peak"] for r in recs) - start) / MIB
    seconds = [sum(r["seconds"] for r in recs) for recs in per_rank]
    host, device = ([increase(recs, key) for recs in per_rank] for key in ("host", "device"))
    sizes, file_sizes = ([r[key] for r in per_rank[0] if r[key] is not None] for key in ("bytes", "file_bytes"))
    return dict(format=fmt_name, phase=name, seconds=max(seconds),
                gb_per_s=max(sizes) / max(seconds) / 1e9 if sizes else None,
                peak_host_mib=max(host), peak_device_mib=None if device[0] is None else max(device),
                file_mib=max(file_sizes) / MIB if file_sizes else None,
                per_rank=dict(seconds=seconds, peak_host_mib=host, peak_device_mib=device))


def summarise(per_rank: list[list[dict]]) -> list[dict]:
    """Each phase's row, and after each format a row per part of several phases ("save", "load") that adds them up."""
    rows, first = [], per_rank[0]
    for fmt_name in dict.fromkeys(r["format"] for r in first):
        index = [i for i, r in enumerate(first) if r["format"] == fmt_name]
        rows += [row(fmt_name, first[i]["phase"], [[recs[i]] for recs in per_rank]) for i in index]
        for part in dict.fromkeys(first[i]["part"] for i in index if first[i]["part"]):
            mine = [i for i in index if first[i]["part"] == part]
            if len(mine) > 1:
                name = f"{part} = " + " + ".join(first[i]["phase"] for i in mine)
                rows.append(row(fmt_name, name, [[recs[i] for i in mine] for recs in per_rank]))
    return rows


def main() -> None:
    start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="where the checkpoints are written (and removed once measured)")
    add_size_args(ap)
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help=f"comma-separated subset of {','.join(FORMATS)} (default: all, in this order)")
    add_run_args(ap, lr=None, out="write the results here as JSON (rewritten after every phase)")
    args = parse_gpt_args(ap, FULL, (*SIZE_KEYS, "bucket_cap_mb"))
    formats = choose(ap, args.formats, FORMATS, "--formats")
    # tmpfs would hold the files in host memory
    fs = subprocess.run(["stat", "-f", "-c", "%T", args.dir], capture_output=True, text=True).stdout.strip()
    dev, cuda, n_params, meta = start_gpt(args, note=f"; checkpoints in {os.path.abspath(args.dir)} ({fs})")
    meta.update(dir=os.path.abspath(args.dir), filesystem=fs)
    portable, sharded = (os.path.join(args.dir, f"bench_checkpoint_{name}") for name in ("portable.pt", "sharded"))
    if dist.get_rank() == 0:  # a previous run's directory may hold more ranks' files
        os.makedirs(args.dir, exist_ok=True)
        shutil.rmtree(sharded, ignore_errors=True)
    model = build_model(args, dev)
    opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-4, weight_decay=WEIGHT_DECAY,
                                         bucket_cap_mb=args.bucket_cap_mb, overlap_param_sync=False,
                                         contiguous_param_buffer=True)
    batch = make_batch(args, 1, dev)
    train_step(model, opt, *batch, cuda)
    reference = snapshot(model, opt, portable=args.tiny)
    say(f"set up in {time.perf_counter() - start:.1f} s (process group, model, optimizer, first iteration, "
        f"reference copy of the state)")
    phases = Phases(args.out, meta, cuda)
    state_bytes = STATE_BYTES_PER_PARAM * n_params

    def restored() -> bool:
        """Whether the state equals the reference snapshot on every rank."""
        ok = torch.tensor([same(snapshot(model, opt, args.tiny), reference)], dtype=torch.int32, device=dev)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    def trip(fmt_name: str, path: str, save, write, read, load, state_bytes=None) -> None:
        """A format's save phases (save: (name, fn) making the state, write: (name, fn(state)) writing it to
        path), one more iteration (loading over an unchanged state would prove nothing), its load phases (read:
        (name, fn) reading path out of the page cache, load: (name, fn(read's result))); the restore is checked
        and path removed (--dir needs room for one at a time)."""
        size = lambda: sum(map(os.path.getsize, files(path)))  # noqa: E731
        state = phases.run(fmt_name, save[0], "save", save[1], state_bytes)
        phases.run(fmt_name, write[0], "save", partial(write[1], state), size)
        del state
        train_step(model, opt, *batch, cuda)
        if restored():
            raise RuntimeError("a training iteration left the optimizer state unchanged: the restore check would "
                               "prove nothing")
        for name in files(path) if dist.get_rank() == 0 else []:  # out of the page cache
            fd = os.open(name, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        state = phases.run(fmt_name, read[0], "load", read[1], size)
        phases.run(fmt_name, load[0], "load", partial(load[1], state))
        del state
        if not restored():
            raise RuntimeError(f"{fmt_name}: the loaded optimizer state (or the model's parameters) differs from "
                               "the saved one")
        if dist.get_rank() == 0:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    if "portable" in formats:
        trip(PORTABLE, portable, ("gather", partial(opt.state_dict, gather_on_root=True)),
             ("write", lambda sd: dist.get_rank() == 0 and shardadam.checkpoint.save({"optimizer": sd}, portable)),
             ("read", partial(shardadam.checkpoint.load, portable)),
             ("load_state_dict", lambda ckpt: opt.load_state_dict(ckpt["optimizer"])), state_bytes)
    if "every-rank" in formats:
        phases.run(EVERY_RANK, "gather", None, opt.state_dict, state_bytes)
    if "sharded" in formats:
        trip(SHARDED, sharded, ("sharded_state_dict", opt.sharded_state_dict),
             ("dcp.save", lambda state: dcp.save({"optimizer": state}, checkpoint_id=sharded)),
             ("dcp.load", partial(dcp_read, opt, sharded)),
             ("load_sharded_state_dict", lambda state: opt.load_sharded_state_dict(state["optimizer"])))
    rows = phases.report(show=False)
    if rows is not None:
        checked = [name for name, key in ((PORTABLE, "portable"), (SHARDED, "sharded")) if key in formats]
        print("", md_table(["format", "phase", "seconds", "GB/s", "peak host MiB", "peak device MiB", "file MiB"],
                           [[r["format"], r["phase"], f"{r['seconds']:.3f}", fmt(r["gb_per_s"], ".2f"),
                             f"{r['peak_host_mib']:.1f}", fmt(r["peak_device_mib"], ".1f"), fmt(r["file_mib"], ".1f")]
                            for r in rows], "llrrrrr"), sep="\n")
        if checked:
            print(f"restored bit for bit after a further training iteration: {', '.join(checked)}")
        print(f"whole run {time.perf_counter() - start:.1f} s (from main(): imports excluded)", flush=True)
    del opt, reference  # before the process group goes (gloo can abort at exit otherwise: README)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
