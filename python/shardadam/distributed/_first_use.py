"""Parameters that are not current yet wait for their all-gather on first use.

[Note: first-use guard] With overlap_param_sync, step() leaves the
all-gathers running and every module's forward-pre hook waits for the
buckets of its own parameters. Some reads never pass through such a hook: a
module whose forward uses parameters it keeps in an nn.ParameterList /
nn.ParameterDict (the container's forward never runs), a forward that reads a
child's parameter without calling the child, and any read outside a forward
(evaluation through a functional call, logging p.sum(), model.state_dict(),
an EMA, torch.save). apex patches attribute access on nn.Parameter itself,
for every parameter of the process, for good. Here, step() swaps the class of
each of this optimizer's parameters for a subclass (of the parameter's own
class) whose __torch_function__ waits for that parameter's buckets, swaps the
class back, and runs the operation: every torch operation on the parameter
(and .data, .detach(), copies, F.embedding, foreach ops...) sees current
values. The forward-pre hooks swap the classes back before the module's
forward runs, so a forward that uses its own parameters pays nothing, and no
parameter carries the subclass once its buckets have landed: the cost is one
Python call per parameter whose first use each iteration comes before its
module's hook, nothing otherwise. Operations that only read metadata
(.grad, .shape, .requires_grad, data_ptr(), ...) neither wait nor swap:
zero_grad() between step() and the next forward does not end the overlap.
The engine's own work on the parameters (the copies out of the all-gather)
runs with subclass __torch_function__ disabled.

The guard sees only what goes through torch's Python dispatch: a C++
extension handed the parameter directly (pybind / nanobind) reads it as it
is, so call param_sync() before such reads outside a forward.
"""
from __future__ import annotations

import weakref

import torch

# Reads and writes that never touch a parameter's values: they pass through.
_METADATA = frozenset([getattr(torch.Tensor, name).__get__ for name in (
    "grad", "requires_grad", "is_leaf", "grad_fn", "shape", "dtype", "device", "layout", "ndim", "is_cuda",
    "_version")] + [torch.Tensor.grad.__set__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,
                    torch.Tensor.nelement, torch.Tensor.stride, torch.Tensor.data_ptr, torch.Tensor.is_contiguous,
                    torch.Tensor.element_size, torch.Tensor.requires_grad_, torch.Tensor.register_hook,
                    torch.Tensor.register_post_accumulate_grad_hook])


def _tensors(value, found: list) -> list:
    """The tensors in an operation's (nested) arguments."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors(v, found)
    return found


class FirstUseGuard:
    """Arms parameters (swaps in the waiting subclass) and disarms them.
    land(params): the owner's wait for those parameters' buckets; the guard
    disarms them afterwards."""

    def __init__(self, land):
        self._land = weakref.WeakMethod(land)  # the owner holds the guard: no cycle back to it
        self._stale_classes: dict = {}  # a parameter's class -> its waiting subclass
        self._armed: dict = {}          # id(param) -> (param, its class)

    @property
    def armed(self) -> bool:
        return bool(self._armed)

    def arm(self, params) -> None:
        for p in params:
            if id(p) not in self._armed:
                cls = type(p)
                self._armed[id(p)] = (p, cls)
                p.__class__ = self._stale_class(cls)

    def disarm(self, params) -> None:
        for p in params:
            entry = self._armed.pop(id(p), None)
            if entry is not None:
                p.__class__ = entry[1]

    def disarm_all(self) -> None:
        self.disarm([p for p, _ in list(self._armed.values())])

    def first_use(self, params: list) -> None:
        """Parameters of this guard's owner met in an operation: wait for
        them. A tensor of this class that the guard never armed (a copy made
        with type(param)(...), e.g. by deepcopy) just gets its class back."""
        mine = [p for p in params if id(p) in self._armed]
        land = self._land()
        if mine and land is not None:
            land(mine)
        self.disarm(mine)
        for p in params:
            if id(p) not in self._armed and type(p) in self._stale_classes.values():
                p.__class__ = type(p).__bases__[0]

    def _stale_class(self, cls: type) -> type:
        stale = self._stale_classes.get(cls)
        if stale is None:
            guard = weakref.ref(self)
            stale = type(cls.__name__, (cls,), {
                "__torch_function__": classmethod(_make_current_first),
                "_shardadam_guard": guard, "__module__": __name__})
            self._stale_classes[cls] = stale
        return stale


def _make_current_first(cls, func, types, args=(), kwargs=None):
    """__torch_function__ of an armed parameter's class ([Note: first-use guard])."""
    kwargs = kwargs or {}
    if func in _METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    by_guard: dict = {}
    for t in _tensors((args, kwargs), []):
        owner = getattr(type(t), "_shardadam_guard", None)
        if owner is not None:
            by_guard.setdefault(owner, []).append(t)
    for owner, params in by_guard.items():
        guard = owner()
        if guard is not None:
            guard.first_use(params)
        else:  # the optimizer is gone: nothing to wait for
            for p in params:
                p.__class__ = type(p).__bases__[0]
    return func(*args, **kwargs)
