"""The engine's hooks on the model: the hand-over of each gradient during
backward (a parameter's post-accumulate-grad hook) and the wait for a
module's parameters before its forward (a module forward-pre hook). They
hold the optimizer weakly: no reference cycle through the model's
parameters, so an optimizer that goes out of scope is freed at once, before
the process group is destroyed (gloo can abort at exit otherwise), and takes
its hooks with it.

[Note: hooks on the modules that own the parameters] overlap_param_sync
makes each module's forward wait for the all-gathers of its parameters.
The optimizer is not given the model (apex's constructor), and it used to
reach every module through a global forward-pre hook, which fires for every
module of every model in the process and makes torch.compile(module) warn
("Using `torch.compile(module)` when there are global hooks on modules").
A parameter does not know its modules, so a parameter-registration hook
(not a forward hook: torch.compile does not mind it), installed when
shardadam is imported, remembers weakly every module a parameter was
registered in, and the optimizer hooks the forward of those that hold one
of its parameters (a parameter shared by two modules: both). Where an
owner is unknown (a model built before shardadam was imported, parameters
put into a module's ``_parameters`` directly, or no module at all), the
global hook serves as before.
"""
from __future__ import annotations

import functools
import weakref

import torch

__all__ = ["Hooks", "grad_ready", "owning_modules", "register_forward_waits", "wait_for_own_params"]

# Every live module a parameter was registered in, held weakly. Modules,
# not parameters: a parameter with a weak reference cannot be swapped
# (torch.utils.swap_tensors, which module.to(...) uses under
# torch.__future__.set_swap_module_params_on_conversion(True)).
_MODULES: weakref.WeakSet = weakref.WeakSet()


def _remember_owner(module: torch.nn.Module, name: str, param) -> None:
    """Module parameter-registration hook: `module` holds a parameter from now on."""
    if param is not None:
        _MODULES.add(module)


# One for the process, never removed: ([Note: hooks on the modules that own the parameters]).
torch.nn.modules.module.register_module_parameter_registration_hook(_remember_owner)


def owning_modules(params: list) -> list | None:
    """The modules that hold these parameters now (a parameter shared by
    several: each of them); None when the owner of one of them is unknown."""
    wanted = {id(p) for p in params}  # the caller holds them: their ids are theirs
    found, covered = [], set()
    for module in list(_MODULES):
        held = {id(q) for q in module.parameters(recurse=False)} & wanted
        if held:
            found.append(module)
            covered |= held
    return found if covered == wanted else None


class _Handles:
    """Several hook handles removed as one."""

    def __init__(self, handles: list):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def grad_ready(optimizer: weakref.ref, k: int, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of parameter k: hand the gradient over."""
    opt = optimizer()
    if opt is None or opt._superseded.taken_by:  # [Note: the newest optimizer takes the gradients]
        return
    if opt._probe.active:
        # the first iteration synchronises in step(), in the order learnt here
        opt._probe.record(k, synchronised=not opt.iteration.no_sync)
        if not opt.iteration.no_sync and not opt.contiguous_grad_buffer:
            opt._probe.hold(param)  # [Note: the first backward's gradients in host memory] (_iteration.py)
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
    """Module forward-pre hook: wait for the all-gathers of this module's
    parameters. `optimizer` is any engine that gathers parameters after its
    step (DistributedFusedAdam, DistributedFusedMuon's Muon part): its
    ``params_owed`` says whether a gather is still owed, its
    ``_make_current(params)`` waits for those parameters' buckets."""
    opt = optimizer()
    if opt is not None and opt.params_owed:
        opt._make_current(list(module.parameters(recurse=isinstance(module, _READS_CHILD_PARAMS))))


def register_forward_waits(optimizer: weakref.ref, params: list):
    """wait_for_own_params before the forward of each module that owns one of
    `params`, or of every module where an owner is unknown ([Note: hooks on
    the modules that own the parameters]); returns what removes them."""
    hook = functools.partial(wait_for_own_params, optimizer)
    modules = owning_modules(params)
    if modules is None:
        return torch.nn.modules.module.register_module_forward_pre_hook(hook)
    return _Handles([module.register_forward_pre_hook(hook) for module in modules])


class Hooks:
    """The optimizer's hook handles: on the parameters (post-accumulate-grad)
    and on the forward of the modules that own them; and its first-use guard, whose armed
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
