"""This rank's optimizer state in host memory (``state_device="cpu"``).

[Note: host shards] With state_device="cpu" on GPU parameters, the ZeRO
engine keeps this rank's shard of the masters and of the rule's states in
host memory, and the CPU engine steps it with the element math of the GPU
kernel ([Note: host state] in ../_host_state.py is the single-GPU
optimizers' counterpart). The reduced gradient shards and the parameter
shards stay on the GPU, where the collectives read and write them. Per
bucket, two copies cross PCIe, each on a CUDA stream of its own:

    backward  reduce-scatter b -> grads of b down ......................
    step()                        wait b | CPU steps b | params of b up
                                              wait b+1 | CPU steps b+1 | ...
                                                       then the all-gathers

- Down: once bucket b's reduce-scatter is waited for (GradSync's
  ``on_reduced``), its reduced shard is copied into a page-locked host row
  while backward goes on. A shard that changes again later (a second round
  of gradients in one iteration, the redundant group's all-reduce) is copied
  again after the change, on the same stream.
- Step: bucket by bucket, the host waits for the bucket's gradients, the CPU
  engine steps the bucket's plan (the core releases the GIL) and the new
  parameter shard goes up into the device row the all-gather sends, while
  the CPU steps the next bucket. The current stream then waits for the last
  copy up, so the all-gathers (and the next forward) see the new values;
  the host waits too, so that when step() returns no copy is in flight and
  checkpoints may read and write the host rows.
- What decides a step stays on the GPU: skipped steps, clipping and
  GradScaler read the reduced gradients there, as without host state. The
  kernel's gradient scale comes down as one number per step (a host step
  cannot be captured in a CUDA graph).
- Memory: the host holds the masters, the states, a row of reduced
  gradients per bucket (so that they can go down during backward) and the
  parameter rows the step writes; the GPU holds the reduced gradient shards
  and the parameter shards: 1/N of the gradients and parameters each.

On a CPU device the state is in host memory anyway: state_device="cpu" is
then a no-op placement (runs_pipeline).

[Note: host step in backward] With host_step_in_backward=True the host does
not wait for step(): once backward hands over an iteration's first gradient,
each bucket whose reduced shard is down is stepped on a worker thread (the
core releases the GIL, so backward goes on) and its parameters go up, while
the next buckets are still being reduced:

    backward  reduce-scatter b -> grads of b down -> CPU steps b -> params of b up
                      reduce-scatter b+1 -> grads of b+1 down -> CPU steps b+1 -> ...
    step()    the last buckets' reduce-scatters, wait for the worker, all-gathers

The step's inputs must then be known when backward starts handing over:
the hyperparameters (read at the first hand-over, as the LR schedulers that
step after optimizer.step() leave them), the gradient scale (the averaging
factor only) and every bucket's final gradients. So the engine refuses what
needs all gradients first (clipping, a GradScaler, skipped steps) and a
second reduction of a bucket in one iteration (accumulate in no_sync()), and
step() raises, after completing the step, if the hyperparameters changed
after backward read them. The first iteration, and one whose masters are not
yet taken from the parameters, step in step() as usual: the first one learns
the backward order and shows the refusals before any state has moved.
"""
from __future__ import annotations

import concurrent.futures
import weakref
from typing import Callable

import torch

from .._host_state import on_stream, recorded_event, wait_event
from .._pinned import pin
from .._plan import cpu_threads
from ._rows import BucketRows


SECOND_REDUCTION = (
    "host_step_in_backward=True takes one reduction of each bucket per iteration, and gradients came from "
    "several backward passes without no_sync(): accumulate micro-batches inside optimizer.no_sync(), or build "
    "the optimizer with host_step_in_backward=False")


def check_host_step_in_backward(wanted, *, state_device, overlap_grad_sync: bool,
                                skip_nonfinite_grads: bool) -> None:
    """What host_step_in_backward=True needs ([Note: host step in backward])."""
    if not isinstance(wanted, bool):
        raise TypeError(f"host_step_in_backward must be True or False, got {wanted!r}")
    if not wanted:
        return
    if state_device != "cpu":
        raise ValueError("host_step_in_backward=True steps state in host memory: it needs state_device='cpu'")
    if not overlap_grad_sync:
        raise ValueError("host_step_in_backward=True steps buckets as backward reduces them: it needs "
                         "overlap_grad_sync=True")
    if skip_nonfinite_grads:
        raise ValueError("host_step_in_backward=True steps each bucket before the gradients of the others exist, "
                         "so it cannot skip a step for inf/NaN in them: choose skip_nonfinite_grads or "
                         "host_step_in_backward")


def moved_hyperparameters(read: dict, now: dict) -> str:
    """The kernel arguments that differ between two rule.hyper() dicts ('' if
    none), numbers shown to 6 significant digits."""
    def plain(v):
        return [plain(x) for x in v] if isinstance(v, (list, tuple)) else \
            (v.item() if isinstance(v, torch.Tensor) else v)

    def shown(v):
        return "[" + ", ".join(map(shown, v)) + "]" if isinstance(v, list) else \
            (f"{v:.6g}" if isinstance(v, float) else repr(v))
    return ", ".join(f"{key} {shown(plain(read[key]))} -> {shown(plain(now[key]))}" for key in read
                     if plain(read[key]) != plain(now[key]))


def runs_pipeline(device: torch.device) -> bool:
    """Whether state_device="cpu" on parameters of `device` moves anything:
    only GPU parameters have their state elsewhere."""
    return device.type == "cuda"


def host_rows(buckets: list, size: int, dtype_of_key: dict, device: torch.device) -> BucketRows:
    """Zeroed host rows like BucketRows.allocate's, page-locked for `device`'s copies."""
    rows = BucketRows.allocate(buckets, size, dtype_of_key, "cpu")
    for t in rows.tensors:
        pin(t, device)
    return rows


class HostShards:
    """The host end of this rank's shards ([Note: host shards]).

    device_grads, host_grads: the reduced gradient shards on the GPU and
    their host rows; host_params, device_params: the parameter rows the host
    step writes and the device rows the all-gather sends (BucketRows);
    threads: the CPU engine's for the step."""

    def __init__(self, device: torch.device, device_grads: BucketRows, host_grads: BucketRows,
                 host_params: BucketRows, device_params: BucketRows, threads: int):
        self.device = device
        self.device_grads, self.host_grads = device_grads, host_grads
        self.host_params, self.device_params = host_params, device_params
        cuda = device.type == "cuda"
        self._down = torch.cuda.Stream(device) if cuda else None
        self._up = torch.cuda.Stream(device) if cuda else None
        self._landed = [None] * len(host_grads)  # bucket -> the event of its last copy down
        self.stale = False  # host parameter rows written outside a step, not yet sent up
        self.threads = threads  # [Note: host step threads] in ../_host_state.py
        # [Note: host step in backward]: this iteration's plans and launch while
        # armed, the buckets handed to the worker and their futures.
        self._armed: tuple | None = None
        self._handed = [False] * len(host_grads)
        self._futures: list = []
        self._worker = None

    def arm(self, plans: list, launch: Callable) -> None:
        """Step each bucket of this iteration as soon as its gradients are
        down ([Note: host step in backward]); launch(plan) steps one. The
        copies up follow the work queued so far (the last all-gathers read
        the device rows they write)."""
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shardadam-host-step")
            weakref.finalize(self, self._worker.shutdown, wait=False)
        self._after_queued(self._up)
        self._armed = (plans, launch)
        self._handed = [False] * len(self._handed)

    def grads_reduced(self, b: int) -> None:
        """Bucket b's reduced shard is final as far as the current stream
        knows: copy it down after the work queued so far (and, armed, hand
        it to the worker)."""
        if self._armed is not None and self._handed[b]:
            raise RuntimeError(
                SECOND_REDUCTION + " (the host already stepped this bucket with the first)")
        self._after_queued(self._down)
        self._landed[b] = self._copy(self._down, self.host_grads[b], self.device_grads[b])
        if self._armed is not None:
            self._handed[b] = True
            plans, launch = self._armed
            if plans[b] is not None:
                self._futures.append(self._worker.submit(self._step_bucket, b, plans[b], launch))

    def _step_bucket(self, b: int, plan, launch: Callable) -> None:
        """Bucket b's step once its gradients are down, then its parameters
        up (on the worker, or in step()); the caller ordered the up stream."""
        wait_event(self._landed[b])
        with cpu_threads(self.threads):
            launch(plan)
        self._send_up(b)

    def finish_armed(self) -> None:
        """step() of an armed iteration: every bucket was handed over (the
        reduce-scatters are done); wait for the worker's steps and the copies
        up, then disarm. A worker's error is raised here."""
        futures, self._futures, self._armed = self._futures, [], None
        concurrent.futures.wait(futures)
        self._up_done()
        for f in futures:
            f.result()

    def settle(self) -> None:
        """The current stream goes on after every copy down: the next
        reduce-scatter may overwrite the shards they read."""
        if self._down is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._down)

    def step(self, plans: list, launch: Callable) -> None:
        """launch(plan) for each bucket's plan (None: the bucket holds none of
        this rank's elements), each after its gradients are down, each
        bucket's parameters sent up after it."""
        self._after_queued(self._up)
        for b, plan in enumerate(plans):
            if plan is not None:
                self._step_bucket(b, plan, launch)
        self._up_done()

    def refresh(self) -> None:
        """Before an all-gather: host parameter rows written outside a step
        (init_params, a checkpoint: ``stale``) go up, every bucket's."""
        if self.stale:
            self._after_queued(self._up)
            for b in range(len(self.host_params)):
                self._send_up(b)
            self._up_done()

    def _send_up(self, b: int) -> None:
        self._copy(self._up, self.device_params[b], self.host_params[b])

    def _up_done(self) -> None:
        """The current stream, and the host, go on after the copies up; the
        device rows are the host rows again."""
        if self._up is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._up)
            self._up.synchronize()
        self.stale = False

    def _after_queued(self, stream) -> None:
        """Copies queued on `stream` from now on follow the work queued so far
        on the current stream (None: the CPU, nothing to order)."""
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))

    def _copy(self, stream, dst: torch.Tensor, src: torch.Tensor):
        """dst <- src on `stream`, in that stream's order (_after_queued); the
        event that marks its end (None on the CPU, where it is done). Any
        thread may call it."""
        if stream is None:
            dst.copy_(src)
            return None
        with torch.cuda.device(self.device), on_stream(stream):
            dst.copy_(src, non_blocking=True)
            return recorded_event(self.device)
