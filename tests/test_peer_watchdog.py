"""The watchdog of the copy-engine collectives (distributed/_watchdog.py).

CPU tests drive the watchdog's bookkeeping by hand (fake events whose query()
the test sets, an injected clock, a fake release, poll_once(now)): timeout
detection, the message, the release and "every later call raises" are
decided by the test's own steps, never by sleeps or timers. GPU tests
(marked cuda / multigpu) let a peer die or stall for real: the surviving
rank must raise the watchdog's error instead of hanging; the harness's join
timeouts are only a safety net, the verdict is on the error message.
"""
from __future__ import annotations

import faulthandler
import math
import os
import queue
import re
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import shardadam
from shardadam.distributed import _peer, _watchdog
from shardadam.distributed._peer_gather import LANDED, READY, PeerParamGather
from shardadam.distributed._peer_reduce import ARRIVED, FREED, PeerGradReduce
from shardadam.distributed._rows import BucketRows
from shardadam.distributed._sync import GradSync
from shardadam.distributed.layout import BucketLayout

# ---------------------------------------------------------------- fakes


class FakeEvent:
    """A CUDA event whose completion the test decides."""

    def __init__(self):
        self.done = False
        self.error = None
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        if self.error is not None:
            raise self.error
        return self.done


class FakeStream:
    def __init__(self, handle: int):
        self.cuda_stream = handle


class FakeOwner:
    """What the watchdog needs of a collective (the protocol of Watchdog)."""
    collective = "copy-engine reduce-scatter"
    kind_names = ("ARRIVED", "FREED")

    def __init__(self, timeout: float = 600.0, rank: int = 0, collective: str | None = None, kinds=None):
        self.timeout, self.rank = timeout, rank
        if collective is not None:
            self.collective = collective
        if kinds is not None:
            self.kind_names = kinds
        self.failure = None

    def fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message

    def release(self) -> None:
        raise AssertionError("the tests' watchdogs release through their fake release()")

    def rank_name(self, r: int) -> str:
        return f"rank {r}"


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Harness:
    """A watchdog without a thread, with fake events, clock, release and log."""

    def __init__(self, **kw):
        self.clock = Clock()
        self.events: list[FakeEvent] = []
        self.released: list[list] = []
        self.logged: list[str] = []
        self.dog = _watchdog.Watchdog(clock=self.clock, make_event=self._event, release=self._release,
                                      log=self.logged.append, start_thread=False, **kw)

    def _event(self, stream) -> FakeEvent:
        self.events.append(FakeEvent())
        return self.events[-1]

    def _release(self, owners) -> None:
        self.released.append(list(owners))

    def watching(self, **owner) -> "FakeOwner":
        """A FakeOwner(**owner) attached, with one group of waits registered."""
        watched = FakeOwner(**owner)
        self.dog.attach(watched)
        self.wait(watched)
        return watched

    def wait(self, owner, stream=1, peers=(1,), kind=0, value=7, where=3) -> FakeEvent:
        """Register a group of waits; its event."""
        self.dog.register(owner, FakeStream(stream), peers, kind, value, where)
        return self.events[-1]


MESSAGE = ("copy-engine reduce-scatter, bucket 3: rank 1 did not raise ARRIVED to 7 within 600 s: the peer died "
           "or stalled; the results of this iteration are invalid")


# ---------------------------------------------------------------- timeouts


def test_a_wait_past_its_deadline_fails_names_it_and_releases():
    h = Harness()
    owner = h.watching()
    h.dog.poll_once(now=h.clock.t + 599.999)
    assert h.dog.failure is None and owner.failure is None and not h.released, "failed before the deadline"
    h.dog.check()  # nothing to raise yet
    h.dog.poll_once(now=h.clock.t + 600)
    assert h.dog.failure == MESSAGE
    assert owner.failure == MESSAGE
    assert h.released == [[owner]], "the failed collective's waits must be released, once"
    assert any(MESSAGE in line for line in h.logged), h.logged
    with pytest.raises(RuntimeError) as info:
        h.dog.check()
    assert str(info.value) == MESSAGE


def test_completed_waits_are_dropped_and_never_fail():
    h = Harness()
    owner = FakeOwner()
    h.dog.attach(owner)
    h.wait(owner).done = True
    h.dog.poll_once(now=h.clock.t + 10_000)
    assert h.dog.failure is None and not h.released
    assert not any(h.dog._queues.values()), "a completed wait must be forgotten"


def test_the_deadline_counts_from_registration_and_uses_the_owners_timeout():
    h = Harness()
    fast, slow = FakeOwner(timeout=2.0), FakeOwner(timeout=600.0)
    h.dog.attach(fast)
    h.dog.attach(slow)
    h.wait(slow, stream=1)
    h.clock.t += 100
    h.wait(fast, stream=2, value=9, where=5)
    h.dog.poll_once(now=h.clock.t + 1.999)
    assert h.dog.failure is None
    h.dog.poll_once(now=h.clock.t + 2.0)
    assert h.dog.failure.startswith("copy-engine reduce-scatter, bucket 5: rank 1 did not raise ARRIVED to 9 "
                                    "within 2 s"), h.dog.failure
    assert fast.failure == slow.failure == h.dog.failure, "a failure fails every attached collective"
    assert h.released == [[fast, slow]] or h.released == [[slow, fast]]


def test_one_poll_queries_few_events_per_stream():
    """Events on one stream complete in order: a poll bisects, it does not query every event."""
    h = Harness()
    owner = FakeOwner(timeout=10.0)
    h.dog.attach(owner)
    for i in range(1000):
        h.wait(owner, value=i + 1, where=i)
        h.clock.t += 1.0
    for e in h.events[:600]:
        e.done = True
    h.dog.poll_once(now=h.clock.t)  # entry 600 was registered at t0 + 600: past its deadline
    assert sum(e.queries for e in h.events) <= 12, "a poll must query O(log n) events per stream"
    assert h.dog.failure.startswith("copy-engine reduce-scatter, bucket 600: rank 1 did not raise ARRIVED to 601 "
                                    "within 10 s"), h.dog.failure
    assert len(h.dog._queues[1]) == 400, "the completed prefix must be dropped"


def test_the_root_cause_is_named_a_peer_wait_before_a_wait_on_this_ranks_own_counter():
    h = Harness()
    owner = FakeOwner()
    h.dog.attach(owner)
    # The caller's stream waits on this rank's own FREED (registered first) ...
    h.wait(owner, stream=1, peers=(0,), kind=FREED, value=4, where=2)
    h.clock.t += 5
    # ... which the copy-engine stream raises once rank 1's ARRIVED comes.
    h.wait(owner, stream=2, peers=(1,), kind=ARRIVED, value=4, where=2)
    h.dog.poll_once(now=h.clock.t + 700)
    assert h.dog.failure.startswith("copy-engine reduce-scatter, bucket 2: rank 1 did not raise ARRIVED to 4"), \
        h.dog.failure


def test_messages_for_several_peers_own_counters_and_descriptions():
    h = Harness()
    gather = FakeOwner(rank=2, collective="copy-engine all-gather", kinds=("READY", "LANDED"))
    from shardadam.distributed._watchdog import _Wait
    several = _Wait(None, 0.0, gather, (0, 1, 2, 3), LANDED, 5, 1)
    assert h.dog.describe(several) == ("copy-engine all-gather, bucket 1: one of ranks 0, 1, 3 did not raise LANDED "
                                       "to 5 within 600 s: the peer died or stalled; the results of this iteration "
                                       "are invalid")
    own = _Wait(None, 0.0, FakeOwner(timeout=2.5), (0,), FREED, 8, 4)
    assert h.dog.describe(own) == ("copy-engine reduce-scatter, bucket 4: this rank's own FREED did not reach 8 "
                                   "within 2.5 s: its copy-engine stream waits for a peer that died or stalled; "
                                   "the results of this iteration are invalid")
    ready = _Wait(None, 0.0, gather, (0, 1, 3), READY, 3, "iteration 3, before its first bucket")
    assert h.dog.describe(ready).startswith("copy-engine all-gather, iteration 3, before its first bucket: one of "
                                            "ranks 0, 1, 3 did not raise READY to 3 within 600 s")


def test_a_cuda_error_while_polling_fails_without_a_release_and_is_logged_once():
    h = Harness()
    owner = FakeOwner()
    h.dog.attach(owner)
    h.wait(owner).error = RuntimeError("CUDA error: an illegal memory access was encountered")
    for _ in range(3):
        h.dog.poll_once(now=h.clock.t + 1)
    assert h.dog.failure.startswith("copy-engine reduce-scatter, bucket 3: CUDA reported an error while this rank "
                                    "waited for rank 1 to raise ARRIVED to 7: CUDA error: an illegal memory "
                                    "access"), h.dog.failure
    assert owner.failure == h.dog.failure
    assert not h.released, "after a CUDA error the counters cannot be written"
    assert len(h.logged) == 1, h.logged


# ---------------------------------------------------------------- after a failure


def _failed(timeout: float = 2.0):
    """A harness whose one collective has just failed (its wait past the
    deadline, released once); end_process recorded instead of run."""
    h = Harness()
    ended = []
    h.dog.end_process = ended.append
    owner = h.watching(timeout=timeout)
    failed_at = h.clock.t + timeout
    h.dog.poll_once(now=failed_at)
    assert len(h.released) == 1 and not ended
    return h, owner, ended, failed_at


def test_waits_still_stuck_one_timeout_after_the_release_end_the_process():
    h, owner, ended, t = _failed()
    h.dog.poll_once(now=t + 1.9)
    assert len(h.released) == 1 and not ended, "neither released again nor ended before one more timeout"
    h.dog.poll_once(now=t + 2.0)
    assert len(ended) == 1 and "still wait 2 s after their counters were released" in ended[0], ended
    assert owner.failure in ended[0] and f"exit code {_watchdog.EXIT_STUCK}" in ended[0]
    assert h.logged[-1] == ended[0], "the reason is logged before the process ends"


@pytest.mark.parametrize("drained", [False, True])
def test_the_timer_ends_the_process_unless_the_released_waits_drained(drained):
    """The timer's verdict (when the polling thread may itself be blocked)."""
    h, owner, ended, _ = _failed()
    for e in h.events:
        e.done = drained
    h.dog._end_unless_drained(2.0)
    if drained:
        assert not ended
    else:
        assert len(ended) == 1 and owner.failure in ended[0] and "still wait 2 s" in ended[0], ended


def test_a_release_that_gets_through_ends_nothing():
    h, owner, ended, t = _failed()
    for e in h.events:
        e.done = True  # the released waits pass
    h.dog.poll_once(now=t + 10_000)
    assert not ended and len(h.released) == 1
    assert owner.failure == h.dog.failure, "the failure stays recorded: the iteration's results are invalid"


def test_a_collective_attached_after_a_failure_is_not_failed_and_closing_the_failed_ones_clears_check():
    h = Harness()
    old = FakeOwner()
    h.dog.attach(old)
    h.wait(old)
    h.dog.poll_once(now=h.clock.t + 600)
    new = FakeOwner()
    h.dog.attach(new)
    assert new.failure is None
    with pytest.raises(RuntimeError):
        h.dog.check()
    h.dog.detach(old)
    h.dog.check()  # the failed collective is closed: nothing left to report
    h.wait(new, stream=5, value=1)
    h.dog.poll_once(now=h.clock.t + 10_000)
    assert new.failure is not None and "ARRIVED to 1" in new.failure, "a new collective is watched on its own"


def test_a_closed_collectives_waits_are_dropped_and_never_fail():
    h = Harness()
    owner, other = FakeOwner(), FakeOwner()
    h.dog.attach(owner)
    h.dog.attach(other)
    h.wait(owner, stream=1)
    h.wait(other, stream=1, value=8)  # behind it on the same stream
    h.dog.detach(owner)
    h.dog.poll_once(now=h.clock.t + 599)
    assert [w.owner for w in h.dog._queues[1]] == [other], "the closed collective's wait must be dropped"
    h.dog.detach(other)
    h.dog.poll_once(now=h.clock.t + 10_000)
    assert h.dog.failure is None and owner.failure is None and other.failure is None and not h.released


# ---------------------------------------------------------------- the timeout argument


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, -math.inf, True, "600", [1]])
def test_timeouts_must_be_finite_and_positive(bad):
    with pytest.raises(ValueError, match="copy-engine timeout"):
        _watchdog.validate_timeout(bad)
    # Before anything is allocated or exchanged (no process group here).
    with pytest.raises(ValueError, match="copy-engine timeout"):
        PeerGradReduce.connect(4, torch.float32, torch.device("cpu"), None, timeout=bad)
    with pytest.raises(ValueError, match="copy-engine timeout"):
        PeerParamGather.connect(torch.zeros(2, 4), None, timeout=bad)


def test_timeout_defaults_and_poll_interval():
    assert _watchdog.DEFAULT_TIMEOUT_S == 600.0
    assert _watchdog.validate_timeout(None) == 600.0
    assert _watchdog.validate_timeout(5) == 5.0 and isinstance(_watchdog.validate_timeout(5), float)
    assert _watchdog.poll_interval(600.0) == 1.0
    assert _watchdog.poll_interval(2.0) == pytest.approx(0.2)


# ---------------------------------------------------------------- the collectives, with fake memory


class _FakeMapped:
    def __init__(self, tensor, rank=0, world=2):
        self.tensor, self.rank, self.world = tensor, rank, world
        self.group, self.failure = None, None
        self.stream = FakeStream(77)
        self.addresses = [1 << 20, 2 << 20]
        self.closed = 0

    def close(self):
        self.closed += 1


class _FakeCounters:
    def __init__(self, rank=0, world=2):
        self.rank, self.world = rank, world
        self.watch, self.failure = None, None
        self.mapped = _FakeMapped(torch.zeros(3, world, dtype=torch.int64), rank, world)
        self.poisoned = self.closed = 0

    def poison(self):
        self.poisoned += 1

    def close(self):
        self.closed += 1


@pytest.fixture
def harness(monkeypatch):
    """The process's watchdog replaced by a Harness one (real release: the collectives' own)."""
    h = Harness()
    h.dog.release = _watchdog._release  # the collectives' release(): their counters' poison()
    monkeypatch.setattr(_watchdog, "_WATCHDOG", h.dog)
    return h


def test_reduce_scatter_fails_then_every_call_raises(harness):
    h = harness
    slots, counters = _FakeMapped(torch.zeros(2, 1, 4)), _FakeCounters()
    peer = PeerGradReduce(slots, counters, depth=2, timeout=2.0)
    assert peer in h.dog._owners and counters.watch is not None
    counters.watch(FakeStream(5), (1,), ARRIVED, 1, 3)  # what wait_for_peers calls after its waits
    h.dog.poll_once(now=h.clock.t + 2.0)
    message = ("copy-engine reduce-scatter, bucket 3: rank 1 did not raise ARRIVED to 1 within 2 s: the peer died or "
               "stalled; the results of this iteration are invalid")
    assert peer.failure == counters.failure == slots.failure == counters.mapped.failure == message
    assert counters.poisoned == 1, "the release writes into the counters"
    with pytest.raises(RuntimeError) as info:
        peer.reduce_scatter(torch.zeros(4), torch.zeros(8), bucket_index=4)
    assert str(info.value) == message
    with pytest.raises(RuntimeError, match=re.escape(message)):
        peer.reduce_scatter_parts(torch.zeros(4), [], [], (None, 4), bucket_index=4)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        _peer.CounterWork(counters, FREED, 1, every_rank=False, where=3).wait()
    with pytest.raises(RuntimeError, match=re.escape(message)):
        peer.check()
    with pytest.raises(RuntimeError, match=re.escape(message)):
        _watchdog.check()
    assert _watchdog.failure() == message
    assert any(t is slots.tensor for t in _peer._KEEP_ALIVE), "failed memory is kept alive"
    peer.close()
    assert slots.closed == 1 and counters.closed == 1 and peer not in h.dog._owners
    _watchdog.check()  # closed: cleared


def test_all_gather_fails_then_every_call_raises(harness):
    h = harness
    buffers, counters = _FakeMapped(torch.zeros(2, 8)), _FakeCounters()
    gather = PeerParamGather(buffers, counters, timeout=5.0)
    counters.watch(FakeStream(5), (1,), READY, 3, "iteration 3, before its first bucket")
    h.dog.poll_once(now=h.clock.t + 5.0)
    message = ("copy-engine all-gather, iteration 3, before its first bucket: rank 1 did not raise READY to 3 within "
               "5 s: the peer died or stalled; the results of this iteration are invalid")
    assert gather.failure == message
    for call in (gather.begin, lambda: gather.bucket(0),
                 lambda: _peer.CounterWork(counters, LANDED, 1, every_rank=True, where=0).wait()):
        with pytest.raises(RuntimeError) as info:
            call()
        assert str(info.value) == message
    gather.close()
    _watchdog.check()


def test_counters_watch_each_group_of_waits_once_and_poison_every_counter(monkeypatch):
    calls = []

    class Core:
        @staticmethod
        def stream_wait_value(device, addr, value, stream):
            calls.append(("wait", addr, value, stream))

        @staticmethod
        def stream_write_value(device, addr, value, stream):
            calls.append(("write", addr, value, stream))

    monkeypatch.setattr(_peer, "_core", Core)
    mapped = _FakeMapped(torch.zeros(3, 2, dtype=torch.int64), rank=0, world=2)
    mapped.addresses = [4096, 8192]
    counters = _peer.PeerCounters(mapped)
    watched = []
    counters.watch = lambda *args: watched.append(args)
    stream = FakeStream(9)
    counters.wait_for_peers(ARRIVED, 5, stream, where=2)
    counters.wait_for_peers(FREED, 6, stream, and_self=True, where=3)
    counters.wait_for(0, FREED, 4, stream, where=7)
    row = 2 * 8
    assert calls == [("wait", 4096 + 8, 5, 9), ("wait", 4096 + row, 6, 9), ("wait", 4096 + row + 8, 6, 9),
                     ("wait", 4096 + row, 4, 9)]
    assert watched == [(stream, (1,), ARRIVED, 5, 2), (stream, (0, 1), FREED, 6, 3), (stream, (0,), FREED, 4, 7)]
    calls.clear()
    monkeypatch.setattr(_peer, "_release_streams", lambda device: [11, 12])
    counters.poison()
    base = mapped.tensor.data_ptr()
    assert calls == [("write", base + 8 * i, _watchdog.POISON, s) for s in (11, 12) for i in range(6)]


class _RecordingPeer:
    """A PeerGradReduce stand-in: which bucket each reduce-scatter was told."""
    world, rank = 2, 0

    def __init__(self):
        self.buckets = []

    class _Work:
        def wait(self):
            return True

    def reduce_scatter(self, out, bucket, bucket_index=None):
        self.buckets.append(bucket_index)
        return self._Work()

    def reduce_scatter_parts(self, out, sends, own, gaps, bucket_index=None):
        self.buckets.append(bucket_index)
        return self._Work()


@pytest.mark.parametrize("contiguous", [False, True], ids=["straight-from-grads", "contiguous-buffer"])
def test_grad_sync_tells_the_copy_engines_each_bucket(contiguous):
    params = [torch.nn.Parameter(torch.randn(n)) for n in (100, 300, 50, 200)]
    layout = BucketLayout([p.numel() for p in params], [0] * len(params), 2, 600 * 4 / (1 << 20), {0: 4})
    n_buckets = len(layout.buckets)
    assert n_buckets > 1
    shards = BucketRows.of(torch.zeros(n_buckets, layout.shard_size(0)))
    peer = _RecordingPeer()
    buffer = views = None
    if contiguous:
        buffer = BucketRows.of(torch.zeros(n_buckets, layout.bucket_size(0)))
        views = [torch.zeros_like(p) for p in params]  # not the buffer's views: packed by copy
    sync = GradSync(params, layout, shards, None, 2, buffer=buffer, views=views, peer=peer)
    for k in reversed(range(len(params))):
        sync.pack(k, torch.randn_like(params[k]))
    sync.finish()
    assert peer.buckets == list(range(n_buckets))


# ---------------------------------------------------------------- the thread


def test_the_thread_detects_a_timeout_by_itself_and_ends_once_nothing_is_watched():
    released, logged = [], []
    done = threading.Event()

    def release(owners):
        released.append(list(owners))
        done.set()

    event = FakeEvent()
    dog = _watchdog.Watchdog(make_event=lambda stream: event, release=release, log=logged.append,
                             end_process=lambda message: None)  # its timer may fire: never end pytest
    owner = FakeOwner(timeout=0.05)
    dog.attach(owner)
    thread = dog._thread
    assert thread is not None and thread.daemon and thread.is_alive()
    dog.register(owner, FakeStream(1), (1,), ARRIVED, 7, 3)
    assert done.wait(30), "the watchdog thread never reported the timeout"  # a safety net: it must come
    assert owner.failure.startswith("copy-engine reduce-scatter, bucket 3: rank 1 did not raise ARRIVED to 7 "
                                    "within 0.05 s")
    event.done = True
    dog.detach(owner)
    thread.join(30)
    assert not thread.is_alive(), "with nothing attached and nothing pending the thread must end"
    owner2 = FakeOwner(timeout=0.05)
    dog.attach(owner2)  # a new collective starts a new thread
    assert dog._thread is not None and dog._thread.is_alive()
    dog.stop(join_s=30)
    assert dog._thread is None or not dog._thread.is_alive()


# ---------------------------------------------------------------- GPU: a peer that dies or stalls


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SAFETY_S = 180  # a rank's whole body; the verdict never depends on it


def _wait_for_failure(limit_s: float = 60.0) -> str | None:
    """The watchdog's message once it is recorded (the host may be released
    by a CUDA error first: the next poll records it)."""
    end = time.monotonic() + limit_s
    while _watchdog.failure() is None and time.monotonic() < end:
        time.sleep(0.05)
    return _watchdog.failure()


def _raises(call) -> str | None:
    try:
        call()
    except RuntimeError as error:
        return str(error)
    return None


def _report_and_exit(out, result) -> None:
    """Put rank 0's result, wait until the queue's feeder thread has sent it,
    then exit without teardown (the peer is gone)."""
    out.put(result)
    out.close()
    out.join_thread()
    os._exit(0)


def _result_of_rank_0(out, rank0):
    """What rank 0 put in the queue, or None once it has ended without (the
    watchdog ended it: EXIT_STUCK) or SAFETY_S passed (a hang: the verdict)."""
    end = time.monotonic() + SAFETY_S
    while time.monotonic() < end:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            if not rank0.is_alive():
                try:
                    return out.get(timeout=1.0)  # it may have put its result just before ending
                except queue.Empty:
                    return None
    return None


def _same_gpu_rank(rank: int, world: int, port: int, mode: str, events, out) -> None:
    """Two processes on GPU 0 over gloo: rank 1 dies ("dead") or stalls
    ("stalled") after connecting, before raising any counter; rank 0 runs a
    reduce-scatter of bucket 3 and blocks the host in torch.cuda.synchronize()."""
    rank0_connected, rank1_gone, rank0_done = events
    faulthandler.dump_traceback_later(SAFETY_S, exit=True)
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    peer = PeerGradReduce.connect(4, torch.float32, torch.device("cuda", 0), None, timeout=2.0)
    if rank == 1:
        rank0_connected.wait(SAFETY_S)  # rank 0 is out of connect()'s collectives
        if mode == "stalled" and peer is not None:
            rank0_done.wait(SAFETY_S)  # alive, mapped, never raising a counter
        os._exit(0)
    rank0_connected.set()
    if peer is None:
        _report_and_exit(out, dict(connected=False))
    if mode == "dead":
        rank1_gone.wait(SAFETY_S)  # the parent saw rank 1's process end
    bucket = torch.arange(8, dtype=torch.float32, device="cuda")
    result = torch.empty(4, device="cuda")
    start = time.monotonic()
    work = peer.reduce_scatter(result, bucket, bucket_index=3)
    work.wait()  # the caller's stream waits too
    sync_error = _raises(torch.cuda.synchronize)  # blocked until the watchdog releases the streams
    blocked_s = time.monotonic() - start
    failure = _wait_for_failure()
    _report_and_exit(out, dict(connected=True, failure=failure, sync_error=sync_error, blocked_s=blocked_s,
                               again=_raises(lambda: peer.reduce_scatter(result, bucket, bucket_index=4)),
                               work=_raises(work.wait), check=_raises(_watchdog.check)))


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["dead", "stalled"])
def test_a_dead_or_stalled_peer_fails_the_reduce_scatter_instead_of_hanging(mode, capfd):
    """Rank 0 raises the watchdog's error, or, where the release cannot get
    through to its blocked streams, ends with EXIT_STUCK after logging it:
    either way, never a hang."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rank0_connected, rank1_gone, rank0_done = ctx.Event(), ctx.Event(), ctx.Event()
    port = _free_port()
    procs = [ctx.Process(target=_same_gpu_rank, args=(r, 2, port, mode, (rank0_connected, rank1_gone, rank0_done),
                                                      out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        if mode == "dead":
            procs[1].join(SAFETY_S)
            rank1_gone.set()
        result = _result_of_rank_0(out, procs[0])
    finally:
        rank0_done.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    message = ("copy-engine reduce-scatter, bucket 3: rank 1 did not raise ARRIVED to 1 within 2 s: the peer died or "
               "stalled; the results of this iteration are invalid")
    codes = [p.exitcode for p in procs]
    if result is None:
        assert codes[0] == _watchdog.EXIT_STUCK, f"rank 0 reported nothing (exit codes {codes}): it hung"
        err = capfd.readouterr().err
        assert message in err and "ending the process" in err, err
        return
    if not result["connected"]:
        pytest.skip("two processes on one GPU could not map each other's memory here")
    assert result["failure"] == message, result
    assert result["sync_error"] is None, f"the host's synchronize must return once released: {result}"
    assert result["blocked_s"] >= 2.0, result
    assert result["again"] == result["work"] == result["check"] == message, result


def _optimizer_rank(rank: int, world: int, port: int, kill: str, out) -> None:
    """DistributedFusedAdam on both directions' copy engines over NCCL; rank 1
    dies in iteration 3 (kill: "backward", "forward" or "before-step");
    rank 0 reports what it raised."""
    faulthandler.dump_traceback_later(SAFETY_S, exit=True)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(32, 32), nn.Tanh()]
    model = nn.Sequential(*layers).cuda()
    opt = shardadam.DistributedFusedAdam(
        model.parameters(), lr=1e-3, bucket_cap_mb=4096 * 4 / (1 << 20), grad_sync_copy_engine=True,
        param_sync_copy_engine=True, contiguous_param_buffer=True, overlap_param_sync=True,
        copy_engine_timeout=5.0)
    iteration = [0]

    def die() -> None:
        os._exit(7)

    def in_backward(grad):  # mid-backward: the later layers' buckets may have started
        if iteration[0] == 3:
            die()

    def on_output(module, args, output):
        if output.requires_grad:
            output.register_hook(in_backward)

    def in_forward(module, args):
        if iteration[0] == 3:
            die()

    if rank == 1 and kill == "backward":
        model[5].register_forward_hook(on_output)
    if rank == 1 and kill == "forward":
        model[6].register_forward_pre_hook(in_forward)
    g = torch.Generator().manual_seed(rank)
    raised = None
    start = None
    try:
        for it in range(1, 9):
            iteration[0] = it
            x = torch.randn(16, 32, generator=g).cuda()
            y = torch.randn(16, 32, generator=g).cuda()
            if it == 3:
                start = time.monotonic()
            F.mse_loss(model(x), y).backward()
            if rank == 1 and kill == "before-step" and it == 3:
                torch.cuda.synchronize()  # its reduce-scatter is done: rank 0 waits in the all-gather
                die()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()  # the host blocks behind a waiting stream until the release
    except RuntimeError as error:
        raised = str(error)
    elapsed = None if start is None else time.monotonic() - start
    _report_and_exit(out, dict(raised=raised, failure=_wait_for_failure(), elapsed=elapsed,
                               transports=opt.transports))


@pytest.mark.multigpu
@pytest.mark.parametrize("kill,collective", [
    ("backward", "copy-engine reduce-scatter"),
    # Each iteration ends in torch.cuda.synchronize() on both ranks: rank 1's
    # last all-gather writes landed, so rank 0's forward goes through and its
    # backward's reduce-scatter is the first to wait for the dead rank.
    ("forward", "copy-engine reduce-scatter"),
    ("before-step", "copy-engine all-gather"),
])
def test_distributed_fused_adam_surfaces_a_dead_rank_within_the_timeout(kill, collective, capfd):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_optimizer_rank, args=(r, 2, port, kill, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        result = _result_of_rank_0(out, procs[0])
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    codes = [p.exitcode for p in procs]
    assert codes[1] == 7, f"rank 1 must have died in iteration 3 (exit codes {codes})"
    if result is None:  # the release could not reach the blocked streams: the process ended instead
        assert codes[0] == _watchdog.EXIT_STUCK, f"rank 0 reported nothing (exit codes {codes}): it hung"
        err = capfd.readouterr().err
        assert re.search(rf"{collective}, .* within 5 s: the peer died or stalled", err) and \
            "ending the process" in err, err
        return
    assert result["transports"] == {"grad_sync": "copy-engine reduce-scatter from gradients",
                                    "param_sync": "copy-engine all-gather"}, result
    failure = result["failure"]
    assert failure is not None, f"the watchdog recorded nothing: {result}"
    pattern = (rf"{collective}, (bucket \d+|iteration \d+, before its first bucket): rank 1 did not raise "
               r"(ARRIVED|FREED|READY|LANDED) to \d+ within 5 s: the peer died or stalled; the results of this "
               r"iteration are invalid")
    assert re.fullmatch(pattern, failure), failure
    assert result["raised"] is not None and failure in result["raised"], \
        f"rank 0's training loop must raise the watchdog's error: {result}"
    assert result["elapsed"] >= 5.0, result
