"""Timing shared by the benchmarks: CUDA events on the GPU, the host clock on
the CPU (where a call returns when its work is done), and interleaved rounds.

`dev` is anything that names a device: "cuda" / "cpu", a torch.device, or a bool that says whether it is CUDA."""
from __future__ import annotations

import gc
import statistics
import time
from itertools import pairwise

import torch


def is_cuda(dev) -> bool:
    return dev if isinstance(dev, bool) else torch.device(dev).type == "cuda"


def sync(dev) -> None:
    if is_cuda(dev):
        torch.cuda.synchronize()


def free(dev) -> None:
    gc.collect()  # FSDP2 and DDP leave reference cycles: collect before measuring memory
    if is_cuda(dev):
        torch.cuda.empty_cache()


class Stopwatch:
    """Marks within one call: CUDA events on the GPU (read after the loop: no host sync between calls), the
    host clock on the CPU or with host=True (the time the host spends, whatever the device does)."""

    def __init__(self, dev, host: bool = False):
        self.cuda, self.marks = is_cuda(dev) and not host, []

    def mark(self) -> None:
        self.marks.append(torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter())
        if self.cuda:
            self.marks[-1].record()

    def laps_ms(self) -> list[float]:
        return [a.elapsed_time(b) if self.cuda else (b - a) * 1e3 for a, b in pairwise(self.marks)]


def timed_calls(fn, dev, calls: int, warmup: int = 0, idle: bool = False, host: bool = False):
    """`warmup` calls, then `calls` timed ones, back to back or (idle) each from an idle device; fn(watch) marks
    its phases on the Stopwatch it is given. Returns each timed call's laps in ms, the wall ms per call over the
    timed loop (synchronised around it) and every call's result, warm-up ones included."""
    outputs, watches = [], []
    for i in range(warmup + calls):
        if i == warmup:
            sync(dev)
            t0 = time.perf_counter()
        if idle:
            sync(dev)
        watches.append(Stopwatch(dev, host))
        outputs.append(fn(watches[-1]))
    sync(dev)
    return [w.laps_ms() for w in watches[warmup:]], (time.perf_counter() - t0) * 1e3 / calls, outputs


def time_steps(fn, dev, reps: int, warmup: int) -> list[float]:
    """Milliseconds of each of `reps` back-to-back calls after `warmup` calls."""
    def call(watch):
        watch.mark()
        fn()
        watch.mark()
    return [lap for lap, in timed_calls(call, dev, reps, warmup)[0]]


def clock_ms(fn) -> float:
    """Host milliseconds of one call (on the CPU: until its work is done)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def median_ms(fn, dev, reps: int, warmup: int = 0, sync_after: bool = True, setup=None) -> float:
    """Median ms of one call from an idle device after `warmup` untimed calls: host plus device time (sync_after),
    or the time for the call to return (its host cost). `setup`, if given, runs untimed before every call."""
    times = []
    for _ in range(warmup + reps):
        if setup is not None:
            setup()
        sync(dev)
        times.append(clock_ms(lambda: (fn(), sync(dev) if sync_after else None)))
    sync(dev)
    return statistics.median(times[warmup:])


def time_wall_and_host(fn, dev, reps: int, warmup: int, setup=None) -> tuple[float, float]:
    """(wall ms per call of `reps` back-to-back calls, median ms for the call to return from an idle device);
    `setup`, if given, runs before every call, its own back-to-back time subtracted from the wall figure."""
    call = fn if setup is None else lambda: (setup(), fn())

    def wall_ms(call) -> float:
        sync(dev)
        return clock_ms(lambda: ([call() for _ in range(reps)], sync(dev))) / reps

    for _ in range(warmup):
        call()
    wall = wall_ms(call) - (wall_ms(setup) if setup is not None else 0.0)
    return wall, median_ms(fn, dev, reps, sync_after=False, setup=setup)


def capture_graph(fn, warmup: int):
    """CUDA graphs' recipe: `warmup` calls on a side stream, then one captured; returns the graph, the captured
    call's (static) result and the warm-up calls' results."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outputs = [fn() for _ in range(warmup)]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    return graph, static, outputs


def interleaved(cases: dict, rounds: int) -> dict[str, list]:
    """Each case's result per round, the cases in turn, every other round backwards (A B C C B A): a machine's drift,
    and what running first or last in a round does (a warm GPU, the host's caches), falls on every case alike."""
    out = {name: [] for name in cases}
    for r in range(rounds):
        for name in (list(cases) if r % 2 == 0 else reversed(cases)):
            out[name].append(cases[name]())
    return out
