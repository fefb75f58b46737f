"""apex's state-dict format 2 and shardadam's portable state dict.

They hold the same tensors: per parameter (keyed by its index in
param_groups order) full fp32 CPU tensors ``param``, ``exp_avg`` and
``exp_avg_sq``, and the groups' hyperparameters. apex adds a top-level
``"format": 2`` and keeps its one step counter in ``state["step"]``;
shardadam keeps a step per group (``param_groups[i]["step"]``), so that
``state`` holds only per-parameter entries, as torch.optim's state dicts do.
state_dict(state_dict_format=2) writes both counters (apex loads it, and
ignores the groups' extra key); load_state_dict reads either.
"""
from __future__ import annotations

from collections.abc import Mapping

FORMAT = 2


def to_apex(portable: dict) -> dict:
    """apex's format 2 of a portable state dict (the tensors are shared)."""
    steps = [g["step"] for g in portable["param_groups"]]
    step = max(steps) if steps else 0  # every group steps together: they are equal
    return {"state": {"step": step, **portable["state"]}, "param_groups": portable["param_groups"],
            "format": FORMAT}


def from_any(state_dict):
    """A portable state dict of `state_dict`, in apex's format 2 or
    shardadam's: apex's ``state["step"]`` goes to the groups without a step of
    their own, ``"format"`` is dropped. The caller's dict is not modified;
    anything else is returned as is, for the load's checks to judge."""
    if not isinstance(state_dict, Mapping):
        return state_dict
    state, groups = state_dict.get("state"), state_dict.get("param_groups")
    has_step = isinstance(state, Mapping) and "step" in state
    if "format" not in state_dict and not has_step:
        return state_dict
    fmt = state_dict.get("format", FORMAT)
    if fmt != FORMAT:
        raise ValueError(f"state_dict['format'] is {fmt!r}: only format 2 (apex's portable per-parameter format, "
                         f"and shardadam's) loads; apex's format 1 pickles its internal buckets and needs the same "
                         f"world size and options: save it with state_dict(state_dict_format=2)")
    out = {k: v for k, v in state_dict.items() if k != "format"}
    if has_step:
        step = state["step"]
        out["state"] = {k: v for k, v in state.items() if k != "step"}
        if isinstance(groups, (list, tuple)):
            out["param_groups"] = [dict(g, step=step) if isinstance(g, Mapping) and "step" not in g else g
                                   for g in groups]
    return out
