"""Copies of an optimizer object: copy.copy, copy.deepcopy, pickle and
torch.save of the optimizer itself.

[Note: copies of an optimizer] torch.optim.Optimizer copies only its
defaults, state and param_groups: every other attribute is lost, so a copy
of a subclass that keeps its own (options, flat buffers, kernel plans) is an
object that fails at its first step. FusedAdam and FusedLion reduce instead
to their constructor call and their state_dict(): the copy is built by the
same constructor over the (copied) groups and loads the (copied) state dict.
Its buffers and plans are its own, so nothing in it refers to the original's
memory; hyperparameters, step counters and state come over exactly (the
state dict round trip is exact in every storage kind), as does
skipped_steps. Like a copy of a torch optimizer it has no hooks (the state
dict goes over without the original's state-dict hooks, which the copy could
not undo), and the LR schedulers stay with the original. copy.deepcopy of the model and the
optimizer in one call gives an optimizer over the copied model's
parameters, as with torch.

DistributedFusedAdam and DistributedFusedLion refuse to be copied: they hold
process groups, hooks on their parameters' gradients and buffers shared with
the parameters, none of which a copy could take over. A new one over the
new model loads the old one's state dict.
"""
from __future__ import annotations


def construction(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A constructor call's arguments but its parameters (the first
    positional argument, or params=): what a copy is built with."""
    return tuple(args[1:]), {k: v for k, v in kwargs.items() if k != "params"}


def reduced(opt) -> tuple:
    """opt.__reduce_ex__: rebuilt(...) over its groups and state dict."""
    args, kwargs = opt._construction
    groups = [dict(g) for g in opt.param_groups]
    return rebuilt, (type(opt), args, kwargs, groups, opt.plain_state_dict(), opt.skipped_steps)


def rebuilt(cls, args: tuple, kwargs: dict, groups: list, state_dict: dict, skipped_steps):
    opt = cls(groups, *args, **kwargs)
    opt.load_state_dict(state_dict)
    opt.skipped_steps = skipped_steps
    return opt


def refuse_copy(opt):
    raise TypeError(
        f"{type(opt).__name__} cannot be copied or pickled: it holds process groups, hooks on its parameters' "
        "gradients and buffers shared with the parameters. Save opt.state_dict() (or sharded_state_dict()) and "
        f"load it into a new {type(opt).__name__} built over the new model ([Note: copies of an optimizer])")
