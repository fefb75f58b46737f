"""Optimizer state in host memory for GPU parameters (``state_device="cpu"``).

[Note: host state] A HostStateBucket keeps, for a set of GPU parameters, a
host copy of each parameter (its *shadow*, in the parameter's dtype) and a
host Bucket (_fused_buckets.py) over the shadows: masters, states, scales
and block maxima all live in host memory and the CPU engine steps them, with
the same element math as the GPU kernels. Only two things cross PCIe per
step: the gradients down and the new parameters up.

A step walks the bucket in segments of about HOST_SEGMENT_ELEMS elements
(whole tensors of one dtype) as a pipeline: while the CPU steps segment k
(the core releases the GIL), the GPU copies segment k+1's gradients down and
segment k-1's parameters up, on two streams of their own (the link carries
both directions at once). Both start after the work queued before the step
(backward wrote the gradients and read the parameters); the current stream
waits for the last parameter copy, so the next forward sees the new values. Many small tensors are
gathered into one device staging buffer first (one multi-tensor copy, then
one transfer); a segment of one tensor is copied directly. Gradients land in
_LOOKAHEAD + 1 host staging slots that the segments share (segment k in slot
k mod the slot count, a slot reused only once its segment was stepped), so
the host holds a few segments of gradients, not a copy of them all. The
shadows and the slots are page-locked (_pinned.py), so the copies are
asynchronous.

The shadow is the master of a parameter that is its own (fp32 params, or
16-bit params without master weights), as the parameter itself is on the
GPU path. The parameter and its shadow are equal after every step. A write
to the parameter through torch (``p.copy_(...)`` under no_grad,
``model.load_state_dict``, ``torch.nn.init``: anything that bumps its version
counter) is noticed at the next step, which reads the parameter back first;
a write through ``p.data`` bypasses the version counter and is overwritten.
When step() returns, no copy is in flight: host memory may be read and
written freely (checkpoints, TE's accessors).

A DTensor parameter (FSDP2's fully_shard, tensor parallelism: [Note: DTensor
parameters] in _dtensor.py) is its local tensor here, as in a device Bucket:
its shadow copies the local shard, the gradient's local tensor comes down
and the new values go up into the parameter's local tensor. Two version
counters are watched: a write through the parameter (``p.copy_``,
``model.load_state_dict``, set_model_state_dict) moves the DTensor's own and
not its local tensor's; a write through ``p.to_local()`` moves the local
tensor's only. state[p] and state_dict() wrap the host views in
DTensors of the parameter's placements (Bucket.exposed_state, the shards'
wrap), so torch.distributed.checkpoint saves, reshards and loads them as the
device state's.
"""
from __future__ import annotations

import contextlib
import os

import torch

from . import kernels
from ._dtensor import PLAIN
from ._fused_buckets import ALIGN_ELEMS, Bucket, GradFit
from ._pinned import pinned_empty
from ._plan import cpu_threads
from . import _addresses
from ._tracked import VERSION

# Elements per pipeline segment: large enough that a transfer runs at PCIe
# speed and the CPU engine's launches are few, small enough that the pipeline
# fills and drains quickly and the device staging stays small (up to
# _LOOKAHEAD + 2 segments of gradients and parameters at once). GPT-1.4B on an
# H200 (benchmarks/RESULTS.md, "Optimizer state in host memory"): 2^22, 2^24,
# 2^26 and 2^28 elements gave 610, 640, 560 and 556 ms per iteration.
HOST_SEGMENT_ELEMS = 1 << 26
# Segments whose gradients are in flight ahead of the one being stepped, and
# the host gradient staging slots that this takes.
_LOOKAHEAD = 2
_SLOTS = _LOOKAHEAD + 1


def segment_bounds(params: list, limit: int) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive parameters of one dtype, each run
    ending once it holds `limit` elements (a larger tensor is a run alone)."""
    bounds, start, size = [], 0, 0
    for i, p in enumerate(params):
        if i > start and (p.dtype != params[start].dtype or size + p.numel() > limit):
            bounds.append((start, i))
            start, size = i, 0
        size += p.numel()
    bounds.append((start, len(params)))
    return bounds


def host_step_threads() -> int:
    """[Note: host step threads] The CPU threads a host-state step runs on.
    torchrun sets OMP_NUM_THREADS=1 in every rank when it starts several
    per host, so torch.get_num_threads() would put the whole host step on
    one core. The host step instead shares the cores this process may run
    on (its CPU affinity) among the ranks of its host (LOCAL_WORLD_SIZE, as
    torchrun sets it; 1 otherwise); SHARDADAM_HOST_THREADS, when set, is
    the count."""
    given = os.environ.get("SHARDADAM_HOST_THREADS")
    if given is not None:
        if not given.strip().isdigit() or int(given) < 1:
            raise ValueError(f"SHARDADAM_HOST_THREADS must be a positive integer (the host step's CPU threads), "
                             f"got {given!r}")
        return int(given)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    ranks = int(local) if local.strip().isdigit() and int(local) > 0 else 1
    return max(1, cores // ranks)


def host_state_wanted(state_device, *, capturable: bool, flat_grads: bool = False) -> bool:
    """Whether state_device asks for host state ([Note: host state]; [Note:
    host shards] in distributed/_host_shards.py), refusing what cannot go with it."""
    if state_device is None:
        return False
    try:
        device = torch.device(state_device)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type != "cpu":
        raise ValueError(f"state_device must be None (the state lives with its parameters) or 'cpu' (in host "
                         f"memory), got {state_device!r}")
    if capturable:
        raise ValueError("state_device='cpu' with capturable=True: a host step cannot be captured in a CUDA graph; "
                         "choose one")
    if flat_grads:
        raise ValueError("state_device='cpu' with flat_grads=True is not supported: the host step copies each "
                         "gradient down itself; drop flat_grads")
    return True


class _Segment:
    """Consecutive parameters of one dtype: their shadows, their host Bucket
    and the host end of their transfers."""

    def __init__(self, kind: str, params: list, group_of: list[int], num_groups: int, opts: dict, names: list[str],
                 streams: tuple, slot: int):
        self.params = params
        self.slot = slot  # the gradient staging slot this segment uses
        self.streams = streams  # (down, up): CUDA streams, or None on the CPU
        self.device = params[0].device
        self.numels = [p.numel() for p in params]
        self.offsets, total = [], 0
        for n in self.numels:
            self.offsets.append(total)
            total += -(-n // ALIGN_ELEMS) * ALIGN_ELEMS
        self.total = total
        self.dtype = params[0].dtype
        self.shadow_flat = pinned_empty(total, self.dtype, self.device)
        self.shadows = self._shaped(self.shadow_flat)
        for s, p in zip(self.shadows, params):
            s.copy_(p.detach())
        self._staged: dict[int, torch.Tensor | None] = {}
        self.bucket = Bucket(kind, self.shadows, group_of, num_groups,
                             dict(opts, grad_of=lambda shadow: self._staged.get(id(shadow))), names)
        self._grad_flat: torch.Tensor | None = None  # this segment's part of its slot, in the gradients' dtype
        self._grad_views: list[torch.Tensor] = []
        self._pending: list = []  # this step's device gradients, present ones only, until they are down
        self.down = None  # the event of the gradients' copy in flight

    def prepare(self, grads: list, slot_bytes: torch.Tensor) -> tuple | None:
        """Point the host bucket at this step's gradients in the staging slot
        (`slot_bytes`, uint8; None where a parameter has no gradient) and
        prepare its plan; nothing moves yet."""
        dtypes = {g.dtype for g in grads if g is not None}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32  # mixed: every float widens exactly
        if self._grad_flat is None or self._grad_flat.dtype != dtype:
            self._grad_flat = slot_bytes[:self.total * dtype.itemsize].view(dtype)
            self.bucket.forget_grad_addresses()  # same addresses, new dtype: the plan must hear of it
            self._grad_views = self._shaped(self._grad_flat)
        self._staged = {id(s): (v if g is not None else None)
                        for s, v, g in zip(self.shadows, self._grad_views, grads)}
        # A gradient of another shape but the same elements in order (GradFit allows it) copies as the parameter's.
        self._pending = [(i, g if g.shape == p.shape else g.view(p.shape))
                         for i, (g, p) in enumerate(zip(grads, self.params)) if g is not None]
        return self.bucket.prepare() if self._pending else None

    def _shaped(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat buffer in this segment's layout, one per parameter, of its shape."""
        return [flat[o:o + n].view(p.shape) for o, n, p in zip(self.offsets, self.numels, self.params)]

    def send_grads_down(self) -> None:
        """Queue this step's gradients to the host staging (the down stream)."""
        with on_stream(self.streams[0]):
            if len(self._pending) == 1:
                i, g = self._pending[0]
                self._grad_views[i].copy_(g, non_blocking=True)
            else:
                staging = torch.empty(self.total, dtype=self._grad_flat.dtype, device=self.device)
                views = self._shaped(staging)
                torch._foreach_copy_([views[i] for i, _ in self._pending], [g for _, g in self._pending])
                self._grad_flat.copy_(staging, non_blocking=True)
            self.down = recorded_event(self.device)

    def release_grads(self) -> None:
        """Let go of the device gradients once they are down, so that
        zero_grad(set_to_none=True) frees them as it would without the
        optimizer."""
        self._pending = []

    def send_params_up(self) -> None:
        """Queue the shadows' values into the parameters (the up stream)."""
        with on_stream(self.streams[1]):
            if len(self.params) == 1:
                self.params[0].detach().copy_(self.shadows[0], non_blocking=True)
            else:
                staging = torch.empty(self.total, dtype=self.dtype, device=self.device)
                staging.copy_(self.shadow_flat, non_blocking=True)
                torch._foreach_copy_([p.detach() for p in self.params], self._shaped(staging))


def on_stream(stream):
    """The context that makes `stream` current (nothing for None: the CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def recorded_event(device: torch.device):
    """An event recorded on the current stream of a CUDA device (None on the CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def wait_event(event) -> None:
    """The host waits for a recorded event (None: nothing to wait for)."""
    if event is not None:
        event.synchronize()


class HostStateBucket:
    """A bucket of GPU parameters whose optimizer state lives in host memory
    ([Note: host state]); what the fused optimizer and its checkpoints use of
    a Bucket: owners, shards, kind, states, views, exposed_state, params (the
    shadows), prepare, grads_read, launch."""

    exposed_state = Bucket.exposed_state  # views, owners, shards and per_piece as a Bucket's

    def __init__(self, kind: str, params: list, group_of: list[int], num_groups: int, opts: dict,
                 names: list[str], shards=PLAIN):
        self.kind = kind
        self.owners = params
        self.shards = shards
        # What the copies read and write: the parameters, or their local tensors ([Note: host state]).
        self._locals = local = shards.tensors(params)
        self.names = names
        self.device = local[0].device
        self.grad_of = opts["grad_of"]
        self.grad_fit = GradFit(local, names)
        self.param_ptrs = _addresses.addresses(local)
        self.param_shapes = [p.shape for p in local]
        self._bounds = segment_bounds(local, HOST_SEGMENT_ELEMS)
        self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)) \
            if self.device.type == "cuda" else (None, None)
        self.segments = [_Segment(kind, local[a:b], group_of[a:b], num_groups, opts, names[a:b], self._streams,
                                  k % _SLOTS) for k, (a, b) in enumerate(self._bounds)]
        widest = max(dtype.itemsize for dtype in kernels.FLOATS)
        slot_bytes = max(seg.total for seg in self.segments) * widest
        self._slots = [pinned_empty(slot_bytes, torch.uint8, self.device)
                       for _ in range(min(_SLOTS, len(self.segments)))]
        self.states = self.segments[0].bucket.states
        self.per_piece = self.segments[0].bucket.per_piece
        self.views = [v for seg in self.segments for v in seg.bucket.views]
        self._shadows = [s for seg in self.segments for s in seg.shadows]
        self._watched = local if shards is PLAIN else params + local  # [Note: host state]: the counters
        self._versions = list(map(VERSION, self._watched))
        self.threads = opts["host_threads"]  # [Note: host step threads]

    @property
    def params(self) -> list:
        """The shadows (what the host kernels step), up to date with the parameters."""
        self._read_changed_params()
        return self._shadows

    def _read_changed_params(self) -> None:
        """Parameters written through torch since the last step (their version
        moved) are read back into their shadows ([Note: host state])."""
        versions = list(map(VERSION, self._watched))
        if versions == self._versions:
            return
        n = len(self._locals)
        for i in {i % n for i, (now, before) in enumerate(zip(versions, self._versions)) if now != before}:
            self._shadows[i].copy_(self._locals[i].detach())
        self._versions = versions

    def after_load(self) -> None:
        """A checkpoint was loaded into the shadows: the parameters take their values."""
        self._start()
        for seg in self.segments:
            seg.send_params_up()
        self._finish()

    def prepare(self) -> tuple | None:
        """Checks every gradient and prepares every segment's plan before
        anything moves; None when no parameter has a gradient."""
        self._read_changed_params()
        grads = self.shards.grads(self.owners, self.grad_of)
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return None
        self.grad_fit.check([grads[i] for i in present], present)
        ready = [seg.prepare(grads[a:b], self._slots[seg.slot]) for seg, (a, b) in zip(self.segments, self._bounds)]
        return [grads[i] for i in present], ready

    @staticmethod
    def grads_read(prepared: tuple) -> list:
        """The device gradients a prepared step reads (the inf/NaN check runs where they are)."""
        return prepared[0]

    def launch(self, prepared: tuple, hyper: dict, grad_scale, found_inf, unscale_grads: bool = False,
               rounding_seed=None) -> None:
        """The pipelined step ([Note: host state]). grad_scale and found_inf
        are host values here: a capturable step (device scalars) is refused
        with host state."""
        _, ready = prepared
        with cpu_threads(self.threads):
            self._pipeline(ready, hyper, grad_scale, found_inf, unscale_grads, rounding_seed)

    def _pipeline(self, ready: list, hyper: dict, grad_scale, found_inf, unscale_grads: bool, rounding_seed) -> None:
        self._start()
        active = [(seg, r) for seg, r in zip(self.segments, ready) if r is not None]
        sent, filled = 0, set()  # slots holding gradients not yet stepped
        for k, (seg, r) in enumerate(active):
            # active[k] can always go: the slots are filled in order and freed as stepped.
            while sent < len(active) and sent <= k + _LOOKAHEAD and active[sent][0].slot not in filled:
                active[sent][0].send_grads_down()
                filled.add(active[sent][0].slot)
                sent += 1
            wait_event(seg.down)
            seg.bucket.launch(r, hyper, grad_scale, found_inf, unscale_grads=unscale_grads,
                              rounding_seed=rounding_seed)
            filled.discard(seg.slot)
            seg.send_params_up()
        self._finish()

    def _start(self) -> None:
        """The copy streams start after the work queued so far."""
        if self.device.type == "cuda":
            queued = recorded_event(self.device)
            for stream in self._streams:
                stream.wait_event(queued)

    def _finish(self) -> None:
        """The current stream goes on after the parameters' copies; the host
        waits for them too (its memory is free again). The parameters'
        versions are remembered."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_stream(self._streams[1])
            self._streams[1].synchronize()
        for seg in self.segments:
            seg.release_grads()
        self._versions = list(map(VERSION, self._watched))

