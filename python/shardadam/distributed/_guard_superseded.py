"""The engine's guard against an older optimizer over the same parameters.

[Note: the newest optimizer takes the gradients] An optimizer built over
parameters that an older DistributedFusedAdam still alive holds (an LR
scheduler or a trainer may keep the old one after the user built a new
one) takes their gradient hand-over: the old one's hooks would otherwise
take each gradient first and leave the new one None (an AttributeError
deep in its step, or zeros). Each parameter maps to the newest optimizer
built over it (looked up once, when a layout is built); an older one that
held any of them is marked: its hooks hand nothing over from then on, and
its step() refuses to run, naming a parameter.
"""
from __future__ import annotations

import weakref

from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["SupersededGuard"]

# parameter -> weakref.ref(SupersededGuard of the newest optimizer over it): keyed by
# identity (tensors compare by value). The guard lives exactly as long as its optimizer.
_HANDED_TO = WeakIdKeyDictionary()


class SupersededGuard:
    """One optimizer's side of [Note: the newest optimizer takes the gradients]:
    ``taken_by`` is the name of the first of its parameters a newer optimizer
    took (None while it is the newest over all of them)."""

    def __init__(self, owner: str):
        self.owner = owner
        self.taken_by: str | None = None

    def take(self, params: list, names: dict) -> None:
        """The parameters hand their gradients to this guard's optimizer from
        now on; an older one alive that held some of them learns which
        (names: id(parameter) -> its name)."""
        this = weakref.ref(self)
        for p in params:
            older = _HANDED_TO.get(p)
            owner = older() if older is not None and older is not this else None
            if owner is not None and not owner.taken_by:
                owner.taken_by = names[id(p)]
            _HANDED_TO[p] = this

    def check(self) -> None:
        """step()'s refusal once a newer optimizer took a parameter."""
        if self.taken_by:
            raise RuntimeError(
                f"{self.taken_by} (and maybe more) belongs to a newer {self.owner} built over it since, which now "
                "takes its gradients: step that one. This one is still alive (an LR scheduler or a trainer may "
                "hold it): let go of it, or build the new one over other parameters")
