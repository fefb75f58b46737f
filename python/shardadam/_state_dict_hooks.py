"""torch.optim's state-dict hooks around the optimizers' own state_dict()
and load_state_dict().

[Note: state-dict hooks] torch.optim.Optimizer runs the hooks registered
with register_state_dict_pre_hook / register_state_dict_post_hook and
register_load_state_dict_pre_hook / register_load_state_dict_post_hook
inside its state_dict() and load_state_dict(). Every shardadam optimizer
overrides both, so it runs them itself, in torch's order: the pre hooks
before anything is read or checked, a post hook's returned dict replaces the
state dict, and the load pre hooks see a shallow copy of the caller's dict
(the caller's own dict stays as it was). DistributedFusedAdam runs its load
pre hooks inside the check that the ranks agree on, so a hook that raises on
one rank is raised on every rank; with gather_on_root its other ranks get
None from state_dict() and run no post hook.
"""
from __future__ import annotations

from typing import Callable


def state_dict_through_hooks(opt, build: Callable[[], dict | None]) -> dict | None:
    for hook in opt._optimizer_state_dict_pre_hooks.values():
        hook(opt)
    state_dict = build()
    if state_dict is not None:
        for hook in opt._optimizer_state_dict_post_hooks.values():
            returned = hook(opt, state_dict)
            state_dict = state_dict if returned is None else returned
    return state_dict


def through_load_pre_hooks(opt, state_dict: dict) -> dict:
    """What the load reads: state_dict after the load pre hooks."""
    hooks = opt._optimizer_load_state_dict_pre_hooks.values()
    if not hooks:
        return state_dict
    state_dict = state_dict.copy()
    for hook in hooks:
        returned = hook(opt, state_dict)
        state_dict = state_dict if returned is None else returned
    return state_dict


def run_load_post_hooks(opt) -> None:
    for hook in opt._optimizer_load_state_dict_post_hooks.values():
        hook(opt)
