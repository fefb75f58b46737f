"""Waits on peers that end in the process group's timeout, said in the engine's terms.

[Note: a peer that never comes] When one rank skips step() or backward()
(a rank-dependent early exit, a batch skipped on one rank, an exception
caught on one rank) or stalls, its peers wait in a collective it never
joins until the process group's timeout, and gloo or NCCL then says only
"Timed out waiting 15000ms for recv operation to complete". The engine
knows more: which collective and bucket the wait was for (InFlight.what in
_transport.py, as the transport names it) and in which call of the
iteration it waited (the engine's public calls and its hooks name their
phase). A timeout met inside those is raised again as PeerTimeout, at the
moment the backend gives up (so within the process group's timeout), on
every rank that waits: naming the collective, the bucket, the phase, the
likely cause and the fix, with the backend's own message kept as the cause.
The innermost wait names the collective; the outermost call names the
phase (step() rather than the grad_sync() it runs).
"""
from __future__ import annotations

import contextlib
import functools
import re

import torch.distributed as dist

__all__ = ["PeerTimeout", "naming_collective", "naming_phase", "timed_out"]

_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def timed_out(error: BaseException) -> bool:
    """Whether a backend error is its collective's timeout (gloo's "Timed out
    waiting ...ms for recv", NCCL's watchdog timeout)."""
    return isinstance(error, RuntimeError) and not isinstance(error, PeerTimeout) and bool(_TIMEOUT.search(str(error)))


class PeerTimeout(RuntimeError):
    """A wait on peers that ended in the process group's timeout ([Note: a peer that never comes])."""

    def __init__(self, collective: str, backend_message: str):
        super().__init__(collective)
        self.collective = collective
        self.phase = "a call"
        self.backend_message = backend_message.strip().splitlines()[0] if backend_message.strip() else ""
        self.rank = dist.get_rank() if dist.is_initialized() else None
        self.world_size = dist.get_world_size() if dist.is_initialized() else None

    def __str__(self) -> str:
        who = f"rank {self.rank} of {self.world_size}" if self.rank is not None else "this rank"
        return (f"{self.phase}: {who} waited in the {self.collective} until the process group's timeout: a peer "
                "rank never joined it. Likely a rank skipped step() or backward() (every rank must run the same "
                "iterations, with the same calls in the same order: look for a rank-dependent early exit, a batch "
                "skipped on one rank, or an exception caught on one rank only), or a rank stalled (hung, or busy "
                "elsewhere). Make every rank run the same iterations; for ranks that are only slow, raise the "
                "timeout (init_process_group(timeout=...)). The backend said: " + self.backend_message)


@contextlib.contextmanager
def naming_collective(collective: str):
    """Around a wait for `collective` (e.g. "gloo reduce-scatter of bucket 3"):
    its timeout raises PeerTimeout."""
    try:
        yield
    except RuntimeError as error:
        if timed_out(error):
            raise PeerTimeout(collective, str(error)) from error
        raise


def naming_phase(phase: str):
    """Decorator of an engine call (phase: e.g. "step()"): a PeerTimeout
    inside it names the call, and any other backend timeout becomes one of
    "collective it ran over the process group"."""
    def decorate(call):
        @functools.wraps(call)
        def named(self, *args, **kwargs):
            try:
                return call(self, *args, **kwargs)
            except PeerTimeout as error:
                error.phase = f"{type(self).__name__}.{phase}"
                raise
            except RuntimeError as error:
                if not timed_out(error):
                    raise
                named_error = PeerTimeout("collective it ran over the process group", str(error))
                named_error.phase = f"{type(self).__name__}.{phase}"
                raise named_error from error
        return named
    return decorate
