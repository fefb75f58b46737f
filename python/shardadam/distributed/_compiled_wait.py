"""The first-use guard's wait as an operator of a compiled graph.

[Note: waits inside compiled graphs] A compiled forward must wait for the
all-gathers that overlap_param_sync leaves running, and a wait in Python
(the module forward-pre hook, the guard's __torch_function__) breaks dynamo's
graph wherever it runs: it waits on collectives and swaps classes, host work
due at every call, not once at tracing. So when dynamo traces an operation on
an armed parameter ([Note: first-use guard] in _first_use.py), the guard puts
this operator into the graph in front of it: shardadam::wait_for_params, which
at run time makes its tensors hold the parameters' current values (waits for
their buckets, as a first use in eager mode does). The operator declares that
it writes those tensors, so every later read of them in the graph depends on
it and no compiler moves a read ahead of the wait. Written in the graph under
no_grad, the mutation stays inside the graph: inductor runs the operator on
the parameters themselves (no copies); AOT autograd without inductor
(aot_eager) hands it copies made before the wait and copies them back after
the graph, so the operator fills a tensor that is not the parameter from the
parameter. The module hooks are no-ops while dynamo traces (_hooks.py): the
parameters they wait for are armed and wait here at their first use, and a
parameter that is not armed is current (dynamo guards on each parameter's
class, so a graph traced with armed parameters runs only while they are).
The operator finds the parameters by their guard's key and their index in it
(integers the graph holds as constants): the tensors it is handed may be
those copies.
"""
from __future__ import annotations

import itertools
import weakref

import torch

__all__ = ["register", "wait_in_graph"]

_KEYS = itertools.count()
_GUARDS: dict = {}  # key -> weakref to a FirstUseGuard


def register(guard) -> int:
    """A key for this guard that the operator resolves while the guard lives."""
    key = next(_KEYS)
    _GUARDS[key] = weakref.ref(guard, lambda _, key=key: _GUARDS.pop(key, None))
    return key


@torch.library.custom_op("shardadam::wait_for_params", mutates_args=("params",))
def _wait_for_params(params: list[torch.Tensor], guard: int, index: list[int]) -> None:
    ref = _GUARDS.get(guard)
    owner = ref() if ref is not None else None
    if owner is None:  # the optimizer is gone: nothing to wait for
        return
    mine = owner.indexed(index)
    owner.first_use(mine)
    with torch._C.DisableTorchFunctionSubclass():
        for t, p in zip(params, mine):
            if t.data_ptr() != p.data_ptr():
                t.copy_(p)


@_wait_for_params.register_fake
def _(params, guard, index) -> None:
    return None


def wait_in_graph(guard, params: list) -> None:
    """Traced by dynamo: the operator for these armed parameters of `guard`."""
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        torch.ops.shardadam.wait_for_params(params, guard.key, [guard.index_of(p) for p in params])
