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
"""
from __future__ import annotations

from typing import Callable

import torch

from .._host_state import on_stream, recorded_event, wait_event
from .._pinned import pin
from .._plan import cpu_threads
from ._rows import BucketRows


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

    def grads_reduced(self, b: int) -> None:
        """Bucket b's reduced shard is final as far as the current stream
        knows: copy it down after the work queued so far."""
        self._landed[b] = self._copy(self._down, self.host_grads[b], self.device_grads[b])

    def settle(self) -> None:
        """The current stream goes on after every copy down: the next
        reduce-scatter may overwrite the shards they read."""
        if self._down is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._down)

    def step(self, plans: list, launch: Callable) -> None:
        """launch(plan) for each bucket's plan (None: the bucket holds none of
        this rank's elements), each after its gradients are down, each
        bucket's parameters sent up after it."""
        with cpu_threads(self.threads):
            for b, plan in enumerate(plans):
                if plan is not None:
                    wait_event(self._landed[b])
                    launch(plan)
                    self._send_up(b)
        self._up_done()

    def refresh(self) -> None:
        """Before an all-gather: host parameter rows written outside a step
        (init_params, a checkpoint: ``stale``) go up, every bucket's."""
        if self.stale:
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

    def _copy(self, stream, dst: torch.Tensor, src: torch.Tensor):
        """dst <- src on `stream`, after the work queued on the current stream;
        the event that marks its end (None on the CPU, where it is done)."""
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with on_stream(stream):
            dst.copy_(src, non_blocking=stream is not None)
            return recorded_event(self.device)
