"""Timing helpers shared by the benchmarks: CUDA events on the GPU, the host
clock on the CPU (where calls return when done)."""
from __future__ import annotations

import gc
import statistics
import time

import torch

def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def time_steps(fn, dev: str, reps: int, warmup: int) -> list[float]:
    """Milliseconds of each of `reps` calls after `warmup` calls: CUDA events on
    the GPU, the host clock on the CPU (where the call returns when done)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(reps):
        if dev == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            times.append((start, end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    sync(dev)
    return [s.elapsed_time(e) for s, e in times] if dev == "cuda" else times


def time_wall_and_host(fn, dev: str, reps: int, warmup: int, setup=None) -> tuple[float, float]:
    """(wall ms per step over `reps` back-to-back steps with a sync around them,
    median ms for the Python call to return, from an idle device, no sync).
    `setup`, if given, runs before every call and is not counted: its own
    back-to-back time is subtracted from the wall figure."""
    def run(n, with_fn=True):
        for _ in range(n):
            if setup is not None:
                setup()
            if with_fn:
                fn()

    run(warmup)
    sync(dev)
    t0 = time.perf_counter()
    run(reps)
    sync(dev)
    wall = (time.perf_counter() - t0) * 1e3 / reps
    if setup is not None:
        t0 = time.perf_counter()
        run(reps, with_fn=False)
        sync(dev)
        wall -= (time.perf_counter() - t0) * 1e3 / reps
    host = []
    for _ in range(reps):
        if setup is not None:
            setup()
        sync(dev)
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
    sync(dev)
    return wall, statistics.median(host)


def free(dev: str) -> None:
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
