"""Fused optimizers' checkpoints: per-parameter fp32 state, whatever the storage.

Saved: for every parameter with state, each state of the update rule (Adam:
``exp_avg`` and ``exp_avg_sq``, and ``max_exp_avg_sq`` with AMSGrad) as true
fp32 values (fp16 states unscaled),
and ``master_param`` as the exact fp32 master (remainders joined with the bf16
param; fp16 masters unscaled) where the parameter has a separate master.
Groups carry their hyperparameters as plain numbers; the step counter is
saved where the rule's torch optimizer saves it (Adam: per parameter, Lion:
per group; [Note: torch.optim's checkpoint schema] in _rules.py). So a
checkpoint loads into any choice of state dtypes, master weights or remainders.
The states of a DTensor parameter are DTensors of its mesh and placements
([Note: DTensor parameters] in _dtensor.py): torch.distributed.checkpoint
saves and reshards them; a load copies the local pieces.
"""
from __future__ import annotations

import torch

from ._rules import AdamRule
from ._groups import pack_groups, plain_value, set_group_values
from ._state_dict_check import check_state_dict
from ._storage import REMAINDER, SEPARATE, codec, joined_master, split_master, store, true_values


def true_state(b, j: int, name: str) -> torch.Tensor:
    """A new fp32 tensor of the true values of parameter j's state `name` in
    bucket b: a state of the rule, or ``master_param`` (the separate master,
    or the remainders joined with the bf16 parameter)."""
    v = b.views[j]
    if name in b.states:
        return true_values(v[name], **codec(v, name))
    if b.kind == SEPARATE:
        return true_values(v["master_param"], v.get("master_scale"))
    return joined_master(b.params[j].detach(), v["param_remainder"])


def _bucket_state(b, j: int) -> dict:
    names = list(b.states) + (["master_param"] if b.kind in (SEPARATE, REMAINDER) else [])
    return {name: b.shards.wrap(true_state(b, j, name), b.owners[j]) for name in names}


def pack_state(opt, buckets) -> dict:
    """The fused optimizer's state dict, in the schema of the torch optimizer
    its rule replaces ([Note: torch.optim's checkpoint schema] in _rules.py)."""
    groups, index = pack_groups(opt.param_groups, plain_value)
    state = {index[id(p)]: _bucket_state(b, j) for b in buckets for j, p in enumerate(b.owners)}
    opt.rule.to_torch_schema(groups, state)
    return {"state": state, "param_groups": groups}


def load_buckets_state(opt, layout, state_dict: dict) -> None:
    """Loads a state dict of the same rule: a fused or distributed (portable)
    optimizer's, or torch.optim's (Adam/AdamW for Adam). Everything is checked
    first (_state_dict_check.py): a refused load raises ValueError and changes
    nothing, not even the buckets, which ``layout()`` builds only then; the
    caller's dict is only read."""
    checked = check_state_dict(state_dict, opt.param_groups, opt.rule)
    buckets = layout()
    where = {id(p): (b, j) for b in buckets for j, p in enumerate(b.owners)}
    with torch.no_grad():
        for values, group in zip(checked.group_values, opt.param_groups):
            set_group_values(group, values)
        for p, entry in checked.entries:
            if id(p) not in where:
                continue  # frozen: no state
            b, j = where[id(p)]
            p, views = b.params[j], b.views[j]  # a DTensor's local tensor; the entry holds local pieces
            for k in b.states:
                if k in entry:
                    store(views[k], entry[k], **codec(views, k))
            master = entry["master"]
            if master is None:
                if b.kind == SEPARATE:
                    store(views["master_param"], p.detach(), views.get("master_scale"))
                continue
            if b.kind == SEPARATE:
                store(views["master_param"], master, views.get("master_scale"))
                p.copy_(master)
            elif b.kind == REMAINDER:
                split_master(master, p, views["param_remainder"])
            else:
                p.copy_(master)
        for b in buckets:
            b.after_load()


def torch_adam_state_dict(state_dict: dict) -> dict:
    """A FusedAdam or DistributedFusedAdam state dict in torch.optim.Adam/AdamW's
    format: each parameter's state gets the group's step as ``step`` (a float32
    tensor; FusedAdam's state dicts have it already), fp32 masters are dropped (torch has none: load the model's
    parameters from the model checkpoint), groups lose shardadam's keys and
    say ``amsgrad`` when the states have max_exp_avg_sq. FusedAdam's
    ``maximize`` and ``adam_w_mode`` are options of the optimizer, not of the
    groups: construct the torch optimizer to match."""
    state = {}
    steps = {key: g["step"] for g in state_dict["param_groups"] if "step" in g for key in g["params"]}
    for key, entry in state_dict["state"].items():
        out = {k: v.clone() for k, v in entry.items() if k in AdamRule.known_states + ("step",)}
        if "step" not in out:  # DistributedFusedAdam's portable dict: the step is its group's
            out["step"] = torch.tensor(float(steps[key]))
        state[key] = out
    groups = []
    for g in state_dict["param_groups"]:
        out = {k: v for k, v in g.items() if k not in ("step", "bias_correction")}
        # torch keeps amsgrad per group (a missing key loads as False)
        out["amsgrad"] = any("max_exp_avg_sq" in state_dict["state"].get(key, {}) for key in g["params"])
        groups.append(out)
    return {"state": state, "param_groups": groups}
