"""A watchdog for the GPU-side waits of the copy-engine collectives (_peer.py).

The copy-engine collectives order their copies with counters that a stream
waits on (cuStreamWaitValue64): the wait has no timeout, so a peer that dies
or stalls before raising a counter leaves this rank's streams waiting on the
GPU for ever, and any host thread that synchronises with them (``.item()``,
``torch.cuda.synchronize()``) with them. NCCL's collectives time out instead.

Every group of waits a collective issues is followed, on the same stream, by
a CUDA event, handed to this watchdog with a deadline (now + the collective's
timeout) and what it waits for. One daemon thread per process polls the
events, a few times per timeout and at most a second apart. Events on one
stream complete in the order they were recorded, so each poll queries only
O(log n) events per stream and looks at the first pending one, which is what
the stream waits on; the training thread only records events (no host syncs,
no locks). A wait past its deadline is a failure:

- the message (the collective, the bucket, the peer rank and the counter and
  value it waited for) is logged and recorded on every attached collective;
  each of their later calls (and every CounterWork.wait) raises RuntimeError
  with it, and check() does too, until those collectives are closed;
- every attached collective's counters are released: a value far above any
  real one (POISON) is written into each of them from side streams, so every
  wait already queued passes and the streams, and the host threads blocked
  behind them, go on. The data those streams then move is garbage, which is
  why every later call raises. Their memory is kept for the life of the
  process, since late writes (the release's, a stalled peer's) may still land
  in it. The release runs in a thread of its own: its stream writes can
  queue behind the very waits they release (streams that share a hardware
  queue), and then block the host call that enqueues them;
- if the waits are still pending one timeout after the failure, the release
  did not get through (seen on an H200: the writes queued behind the waits,
  and the training thread stayed blocked in a kernel launch). The process
  then ends with exit code EXIT_STUCK after logging the message, as NCCL's
  watchdog tears a process down, rather than hanging for ever. The polling
  thread decides that at its next poll; as its CUDA queries may themselves
  block behind a stuck release, a timer decides it too, asking CUDA from a
  thread it waits for at most QUERY_LIMIT_S (no answer counts as stuck).

A CUDA error reported while polling (the context is lost, e.g. after a copy
into a dead peer's memory) is recorded the same way, without a release.
"""
from __future__ import annotations

import atexit
import logging
import math
import numbers
import os
import sys
import threading
import time
import weakref
from collections import deque

import torch

DEFAULT_TIMEOUT_S = 600.0  # as NCCL's default
MAX_POLL_S = 1.0  # the watchdog polls at least this often (timeout / 10 when that is shorter)
POISON = 1 << 62  # written into released counters: every wait (GEQ, value far below) passes
EXIT_STUCK = 75  # the exit code of a process whose released waits stayed stuck
QUERY_LIMIT_S = 5.0  # the timer's CUDA question: no answer within this counts as stuck

_log = logging.getLogger("shardadam")


def validate_timeout(timeout) -> float:
    """The copy-engine timeout in seconds: None gives DEFAULT_TIMEOUT_S; else a
    finite number > 0 (ValueError otherwise)."""
    if timeout is None:
        return float(DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout) \
            or not timeout > 0:
        raise ValueError(f"the copy-engine timeout must be a finite number of seconds > 0, got {timeout!r}")
    return float(timeout)


def poll_interval(timeout: float) -> float:
    """How often the watchdog polls for a timeout: a tenth of it, at most MAX_POLL_S."""
    return max(1e-3, min(MAX_POLL_S, timeout / 10))


def _record_cuda_event(stream):
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _release(owners) -> None:
    for owner in owners:
        owner.release()


def _end_process(message: str) -> None:
    """The last resort: the message is out (log handlers and stderr flushed), then exit."""
    for handler in logging.getLogger().handlers + _log.handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_STUCK)


class _Wait:
    """A group of GPU-side waits on one stream, followed there by ``event``:
    counter ``kind`` raised by every rank in ``peers`` to ``value``."""
    __slots__ = ("event", "deadline", "owner", "peers", "kind", "value", "where")

    def __init__(self, event, deadline, owner, peers, kind, value, where):
        self.event, self.deadline, self.owner = event, deadline, owner
        self.peers, self.kind, self.value, self.where = peers, kind, value, where


class Watchdog:
    """Watches the GPU-side waits of the collectives attached to it (one per
    process in use: get()).

    An attached collective (the owner) provides: ``timeout`` (seconds),
    ``collective`` (its name in messages), ``kind_names`` (its counters'
    names), ``rank`` (its rank in its group), ``failure`` (None until
    ``fail(message)`` sets it), ``release()`` (write POISON into its
    counters) and ``rank_name(r)``.

    clock, make_event(stream) (an object whose query() says whether the
    stream's work before it is done), release(owners), end_process(message)
    and log(message) can be replaced (tests); start_thread=False leaves
    polling to poll_once() and runs the release in the polling thread.
    """

    def __init__(self, clock=time.monotonic, make_event=_record_cuda_event, release=_release, log=None,
                 start_thread: bool = True, end_process=_end_process):
        self.clock = clock
        self.make_event = make_event
        self.release = release
        self.end_process = end_process
        self.log = log if log is not None else _log.error
        self.start_thread = start_thread
        self.failure: str | None = None  # the last failure, while a collective it failed is attached
        self._queues: dict = {}  # stream handle -> deque of _Wait, in record order
        self._owners = weakref.WeakSet()  # attached collectives
        self._lock = threading.Lock()  # attach/detach/failure; never taken by register()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._failed_at = None

    # ------------------------------------------------------------ training thread

    def attach(self, owner) -> None:
        """Watch owner's waits from now on (starts the thread if needed)."""
        with self._lock:
            self._owners.add(owner)
            if self.start_thread:
                self._ensure_thread()
        self._wake.set()  # its timeout may ask for a shorter poll

    def detach(self, owner) -> None:
        """Stop watching owner (closed): its pending waits are dropped at the next poll."""
        with self._lock:
            self._owners.discard(owner)
            if self.failure is not None and not any(o.failure is not None for o in self._owners):
                self.failure = None  # every collective that failed is closed

    def register(self, owner, stream, peers: tuple, kind: int, value: int, where=None) -> None:
        """After stream's waits for counter kind to reach value on every rank
        in peers (where: the bucket, or a description): watch them. Cheap:
        one event recorded on the stream, no host sync, no lock."""
        event = self.make_event(stream)
        key = stream.cuda_stream
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues.setdefault(key, deque())
        queue.append(_Wait(event, self.clock() + owner.timeout, owner, peers, kind, value, where))

    def check(self) -> None:
        """Raise RuntimeError with the recorded failure, if there is one (a bool read otherwise)."""
        failure = self.failure
        if failure is not None:
            raise RuntimeError(failure)

    # ------------------------------------------------------------ watchdog thread

    def poll_once(self, now: float | None = None) -> None:
        """Drop the completed waits; fail on the first one past its deadline,
        or release the failed collectives again while their waits stay pending."""
        if now is None:
            now = self.clock()
        expired, stuck = [], []
        for queue in list(self._queues.values()):
            try:
                head = self._advance(queue)
            except Exception as error:  # a CUDA error: the context is probably lost
                self._cuda_error(queue[0] if queue else None, error)
                return
            if head is None:
                continue
            if head.owner.failure is not None:
                stuck.append(head)
            elif now >= head.deadline:
                expired.append(head)
        if expired:
            # The root cause first: a wait on a peer rather than on this rank's
            # own counter (which waits for this rank's own blocked stream), then the oldest.
            head = min(expired, key=lambda w: (all(r == w.owner.rank for r in w.peers), w.deadline))
            self._fail(self.describe(head), now, release=True)
        elif stuck:
            self._end_if_stuck(stuck, now)
        elif self._failed_at is not None and not any(self._queues.values()):
            self._failed_at = None  # everything released has drained

    def _advance(self, queue: deque):
        """Drop the completed waits at the front of queue (they complete in
        the order they were recorded: O(log n) queries) and those of detached
        collectives; the first pending wait, or None."""
        n = len(queue)  # the training thread may append meanwhile: only these n are looked at
        if n == 0:
            return None
        if queue[n - 1].event.query():
            for _ in range(n):
                queue.popleft()
            return None
        low, high = 0, n - 1  # queue[high] is pending: find the first pending one
        while low < high:
            mid = (low + high) // 2
            if queue[mid].event.query():
                low = mid + 1
            else:
                high = mid
        for _ in range(low):
            queue.popleft()
        while queue and queue[0].owner not in self._owners:  # closed: no longer watched
            queue.popleft()
        return queue[0] if queue else None

    def describe(self, wait: _Wait, error: BaseException | None = None) -> str:
        """The failure message for a wait past its deadline (or that met a CUDA error)."""
        owner = wait.owner
        where = f"bucket {wait.where}" if isinstance(wait.where, int) else str(wait.where)
        kind = owner.kind_names[wait.kind]
        peers = [r for r in wait.peers if r != owner.rank]
        if not peers:
            who = "this rank's own stream"
        elif len(peers) == 1:
            who = owner.rank_name(peers[0])
        else:
            who = "one of ranks " + ", ".join(str(r) for r in peers)
        if error is not None:
            return (f"{owner.collective}, {where}: CUDA reported an error while this rank waited for {who} to "
                    f"raise {kind} to {wait.value}: {error}; a peer may have died; the results of this iteration "
                    "are invalid")
        if not peers:
            return (f"{owner.collective}, {where}: this rank's own {kind} did not reach {wait.value} within "
                    f"{owner.timeout:g} s: its copy-engine stream waits for a peer that died or stalled; the "
                    "results of this iteration are invalid")
        return (f"{owner.collective}, {where}: {who} did not raise {kind} to {wait.value} within "
                f"{owner.timeout:g} s: the peer died or stalled; the results of this iteration are invalid")

    def _fail(self, message: str, now: float, release: bool) -> None:
        with self._lock:
            owners = [o for o in self._owners if o.failure is None]
            for owner in owners:
                owner.fail(message)
            self.failure = message
            self._failed_at = now
        self.log(f"shardadam copy-engine watchdog: {message}" +
                 ("; releasing this process's copy-engine waits" if release else ""))
        if release and owners:
            self._try_release(owners)
            if self.start_thread:
                grace = max(o.timeout for o in owners)
                timer = threading.Timer(grace, self._end_unless_drained, args=(grace,))
                timer.daemon = True
                timer.start()

    def _cuda_error(self, wait: _Wait | None, error: BaseException) -> None:
        with self._lock:
            if all(o.failure is not None for o in self._owners):
                return  # already failed (later polls meet the same error)
        if wait is None:
            message = f"copy-engine collectives: CUDA reported an error while polling their waits: {error}"
        else:
            message = self.describe(wait, error)
        self._fail(message, self.clock(), release=False)

    def _end_if_stuck(self, stuck: list, now: float) -> None:
        """Failed collectives' waits still pending one timeout after the
        release: it did not get through, and a host thread blocked behind
        them would hang for ever. End the process (the module docstring)."""
        if self._failed_at is None or now - self._failed_at < max(w.owner.timeout for w in stuck):
            return
        message = (f"shardadam copy-engine watchdog: {len(stuck)} stream(s) still wait "
                   f"{now - self._failed_at:.0f} s after their counters were released ({self.failure}); ending "
                   f"the process with exit code {EXIT_STUCK} rather than hanging")
        self.log(message)
        self.end_process(message)

    def _end_unless_drained(self, grace: float) -> None:
        """The timer's verdict, one timeout after the failure (module docstring)."""
        answer = []
        asking = threading.Thread(target=lambda: answer.append(self._pending()), daemon=True)
        asking.start()
        asking.join(QUERY_LIMIT_S)
        if answer and not answer[0]:
            return  # every wait passed: the release got through
        pending = answer[0] if answer else "CUDA did not answer: its"
        message = (f"shardadam copy-engine watchdog: {pending} stream(s) still wait {grace:g} s after their "
                   f"counters were released ({self.failure}); ending the process with exit code {EXIT_STUCK} "
                   "rather than hanging")
        self.log(message)
        self.end_process(message)

    def _pending(self) -> int:
        """How many streams still have a watched wait pending (CUDA queries)."""
        return sum(1 for queue in list(self._queues.values()) if queue and not queue[-1].event.query())

    def _try_release(self, owners: list) -> None:
        def release() -> None:
            try:
                self.release(owners)
            except Exception as error:
                self.log(f"shardadam copy-engine watchdog: releasing the waits failed: {error!r}")
        if self.start_thread:
            threading.Thread(target=release, name="shardadam-copy-engine-release", daemon=True).start()
        else:
            release()

    # ------------------------------------------------------------ the thread

    def interval(self) -> float:
        return poll_interval(min((o.timeout for o in list(self._owners)), default=DEFAULT_TIMEOUT_S))

    def _ensure_thread(self) -> None:  # under the lock
        self._stopping = False
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._run, name="shardadam-copy-engine-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                # Nothing attached and nothing pending: end (attach() starts another).
                if self._stopping or (not self._owners and not any(list(self._queues.values()))):
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
                interval = self.interval()
            self._wake.wait(interval)
            self._wake.clear()
            if self._stopping:
                continue
            try:
                self.poll_once()
            except Exception as error:  # never let the thread die
                self.log(f"shardadam copy-engine watchdog: polling failed: {error!r}")

    def stop(self, join_s: float = 1.0) -> None:
        """End the thread (interpreter exit)."""
        with self._lock:
            self._stopping = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_s)


_WATCHDOG = Watchdog()


def get() -> Watchdog:
    """This process's watchdog."""
    return _WATCHDOG


def check() -> None:
    """Raise RuntimeError if a copy-engine collective of this process timed
    out (or met a CUDA error) and is still attached; a bool read otherwise."""
    if _WATCHDOG.failure is not None:
        _WATCHDOG.check()


def failure() -> str | None:
    """The recorded failure message, or None."""
    return _WATCHDOG.failure


def _after_fork_in_child() -> None:
    global _WATCHDOG
    _WATCHDOG = Watchdog()  # the parent's thread did not come along


atexit.register(lambda: _WATCHDOG.stop())
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
