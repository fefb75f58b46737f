"""The engine's hooks on the model: the hand-over of each gradient during
backward (a parameter's post-accumulate-grad hook) and the wait for a
module's parameters before its forward (a module forward-pre hook). They
hold the optimizer weakly: no reference cycle through the model's
parameters, so an optimizer that goes out of scope is freed at once, before
the process group is destroyed (gloo can abort at exit otherwise), and takes
its hooks with it."""
from __future__ import annotations

import weakref

import torch

from ._iteration import Params

__all__ = ["Hooks", "grad_ready", "wait_for_own_params"]


def grad_ready(optimizer: weakref.ref, k: int, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of parameter k: hand the gradient over."""
    opt = optimizer()
    if opt is None or opt._superseded.taken_by:  # [Note: the newest optimizer takes the gradients]
        return
    if opt._probe.active:
        # the first iteration synchronises in step(), in the order learnt here
        opt._probe.record(k, synchronised=not opt.iteration.no_sync)
    elif not opt.iteration.no_sync:
        opt._hand_over(k, param)


# Modules whose forward reads a child's parameters without calling the child
# (MultiheadAttention uses out_proj.weight directly): they wait for their
# children's parameters too.
_READS_CHILD_PARAMS = (torch.nn.MultiheadAttention,)


# [Note: hooks outside compiled graphs] The forward-pre hook waits on
# collectives and swaps the first-use guard's classes: host work that must run
# at every call, not once when dynamo traces the module. Traced, inductor
# failed inside it (InternalTorchDynamoError: KeyError in the guard's
# bookkeeping) and aot_eager broke the graph wherever it met untraceable code.
# Disabled for the compiler, it runs eagerly before each module's compiled
# piece: a compiled model trains as the eager one, with a graph break per
# module whose forward runs the hook (tests/test_compile.py).
@torch.compiler.disable
def wait_for_own_params(optimizer: weakref.ref, module: torch.nn.Module, args) -> None:
    """Module forward-pre hook: wait for the all-gathers of this module's parameters."""
    opt = optimizer()
    if opt is not None and opt.iteration.params is not Params.CURRENT:
        opt._make_current(list(module.parameters(recurse=isinstance(module, _READS_CHILD_PARAMS))))


class Hooks:
    """The optimizer's hook handles: on the parameters (post-accumulate-grad)
    and on every module's forward; and its first-use guard, whose armed
    parameters get their classes back when the optimizer goes.

    [Note: hooks die with their optimizer] They are removed by a
    weakref.finalize of the optimizer, not by a __del__: a __del__ also runs
    for objects that share the optimizer's __dict__ (Lightning's
    LightningOptimizer subclasses the optimizer's class and copies its
    __dict__), and such a wrapper, when freed, would remove the hooks of the
    optimizer still training: backward would stop handing gradients over and
    forward would stop waiting for the all-gathers."""

    def __init__(self):
        self.grad: list = []
        self.forward = None
        self.first_use = None

    def remove_grad(self) -> None:
        for handle in self.grad:
            handle.remove()
        self.grad = []

    def remove(self) -> None:
        self.remove_grad()
        if self.forward is not None:
            self.forward.remove()
            self.forward = None
        if self.first_use is not None:
            self.first_use.disarm_all()
