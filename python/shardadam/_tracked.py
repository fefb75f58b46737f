"""What the optimizers cache about their parameters, and how they notice that
it went stale.

[Note: tracked storage] A plan's table holds raw addresses: the kernels read
and write there without asking torch. Anything that gives a tensor other
memory (``model.to(dtype)``, ``module.to(device)``, ``p.data = t``,
``p.grad.data = t``, ``torch.utils.swap_tensors`` conversions, a new gradient
after ``zero_grad(set_to_none=True)``) would leave the table pointing at
memory the optimizer no longer owns. So every step compares the addresses of
what the table holds with the tensors' current ones, in one C-level pass per
list ([Note: the tensor scan] in _addresses.py), and takes the checked path
only when they differ: it follows the new
memory (a new table, state carried over) where the optimizer can, and raises,
naming the parameter and what changed, where it cannot. The optimizer's own
buffers (states, masters, flat gradients, shards) are never handed out in a
way that lets a caller re-point them under a table.

A parameter *object* replaced in its module (``load_state_dict(assign=True)``,
``module.weight = nn.Parameter(...)``) leaves the old object alive and
unchanged, so no address check can see it: a module parameter-registration
hook (ReplacedParams) notices the replacement of a parameter the optimizer
holds, and the next step refuses to train an object the model no longer uses.
"""
from __future__ import annotations

import operator
import weakref

import torch

from . import _addresses

GRAD = operator.attrgetter("grad")
REQUIRES_GRAD = operator.attrgetter("requires_grad")
VERSION = torch.Tensor._version.__get__


def decoupled_grad(p: torch.Tensor):
    """TransformerEngine's use_decoupled_grad: the gradient in ``p.decoupled_grad``
    (any float dtype, e.g. fp32 for a bf16 parameter); None when absent."""
    return getattr(p, "decoupled_grad", None)


def moved_indices(tensors: list, cached) -> list[int]:
    """Positions whose address differs from the cached ``addresses`` record
    (empty in the common case, found by one C-level pass)."""
    current = _addresses.addresses(tensors)
    if current == cached:
        return []
    now, before = _addresses.pointers(current), _addresses.pointers(cached)
    return [i for i, (a, b) in enumerate(zip(now, before)) if a != b]


def _on_register(module: torch.nn.Module, name: str, param):
    """Module parameter-registration hook (one for the process): runs before
    ``module.name = param`` takes effect, so the attribute still holds the
    parameter being replaced."""
    old = getattr(module, name, None)
    if old is None or old is param:
        return None
    for tracker in list(_TRACKERS):
        if id(old) in tracker.ids:
            tracker.replaced.append(f"{type(module).__name__}.{name} (shape {tuple(old.shape)})")
    return None


# The live trackers. One hook serves them all and is never removed: a tracker
# that goes away leaves the set by itself, and removing a hook from inside
# garbage collection could mutate torch's hook dict while it is iterated.
_TRACKERS: weakref.WeakSet = weakref.WeakSet()
_HOOK: list = []


class ReplacedParams:
    """Notices when a module replaces a parameter this optimizer holds by
    another object (see the note above). ``check()`` raises from then on."""

    def __init__(self, owner: str):
        self.owner = owner
        self.ids: set[int] = set()
        self.replaced: list[str] = []
        if not _HOOK:
            _HOOK.append(torch.nn.modules.module.register_module_parameter_registration_hook(_on_register))
        _TRACKERS.add(self)

    def track(self, params) -> None:
        """The parameters to watch (the optimizer holds them: their ids stay theirs)."""
        self.ids = {id(p) for p in params}

    def check(self) -> None:
        if self.replaced:
            raise RuntimeError(
                f"{self.owner}: the model replaced {self.replaced[0]} by a new Parameter object "
                "(module.load_state_dict(..., assign=True), or assigning module.<name> = ...): the optimizer holds "
                "the old one, which the model no longer uses (torch.optim would keep training it without a word). "
                "Build the optimizer after loading, load with assign=False, or convert with "
                "torch.__future__.set_swap_module_params_on_conversion(True), which keeps the objects")
