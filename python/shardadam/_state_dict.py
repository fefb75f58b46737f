"""Fused optimizers' checkpoints: per-parameter fp32 state, whatever the storage.

Saved: for every parameter with state, each state of the update rule (Adam:
``exp_avg`` and ``exp_avg_sq``, and ``max_exp_avg_sq`` with AMSGrad) as true
fp32 values (fp16 states unscaled),
and ``master_param`` as the exact fp32 master (remainders joined with the bf16
param; fp16 masters unscaled) where the parameter has a separate master.
Groups carry their hyperparameters and step counter as plain numbers. So a
checkpoint loads into any choice of state dtypes, master weights or remainders.
"""
from __future__ import annotations

import math

import torch

from ._fused_buckets import MASTER, REMAINDER
from ._rules import AdamRule
from ._groups import pack_groups, plain_value, set_group_values
from ._state_dict_check import check_state_dict


def pow2_scale_for(amax: float, old_scale: float = 1.0) -> float:
    """The scale the kernels choose (cpp/ops.h): amax * scale just under 2^15."""
    if not amax > 0.0 or not math.isfinite(amax):
        return old_scale
    _, e = math.frexp(amax)
    return math.ldexp(1.0, max(-126, min(126, 15 - e)))


def join_remainders(param_bf16: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 masters that bf16 params and int16 remainders represent."""
    hi = param_bf16.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    lo = remainder.contiguous().to(torch.int64) & 0xFFFF
    hi = (hi - (lo >= 0x8000).to(torch.int64)) & 0xFFFF  # the split rounded the high half up
    bits = (hi << 16) | lo
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return bits.view(torch.float32).reshape(param_bf16.shape)


def split_remainders(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 param rounded to nearest, int16 remainder) of fp32 masters."""
    bits = master.detach().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lo = bits & 0xFFFF
    hi = ((bits >> 16) + (lo >= 0x8000).to(torch.int64)) & 0xFFFF
    as16 = lambda x: torch.where(x >= 0x8000, x - 0x10000, x).to(torch.int16)  # noqa: E731
    return as16(hi).view(torch.bfloat16).reshape(master.shape), as16(lo).reshape(master.shape)


def _fp32(view: torch.Tensor, scale) -> torch.Tensor:
    value = view.to(torch.float32)
    return value / float(scale) if scale is not None else value.clone()


def _bucket_state(b, j: int) -> dict:
    v = b.views[j]
    out = {k: _fp32(v[k], v.get(k + "_scale")) for k in b.states}
    if b.kind == MASTER:
        out["master_param"] = _fp32(v["master_param"], v.get("master_scale"))
    elif b.kind == REMAINDER:
        out["master_param"] = join_remainders(b.params[j].detach(), v["param_remainder"])
    return out


def pack_state(opt, buckets) -> dict:
    groups, index = pack_groups(opt.param_groups, plain_value)
    state = {index[id(p)]: _bucket_state(b, j) for b in buckets for j, p in enumerate(b.params)}
    return {"state": state, "param_groups": groups}


def _store(view: torch.Tensor, value: torch.Tensor, scale_view) -> None:
    """Write true values into a (possibly scaled) state view."""
    value = value.to(device=view.device, dtype=torch.float32)
    if scale_view is not None:
        scale = pow2_scale_for(float(value.abs().max()) if value.numel() else 0.0)
        scale_view.fill_(scale)
        value = value * scale
    view.copy_(value)


def load_buckets_state(opt, layout, state_dict: dict) -> None:
    """Loads a state dict of the same rule: a fused or distributed (portable)
    optimizer's, or torch.optim's (Adam/AdamW for Adam). Everything is checked
    first (_state_dict_check.py): a refused load raises ValueError and changes
    nothing, not even the buckets, which ``layout()`` builds only then; the
    caller's dict is only read."""
    checked = check_state_dict(state_dict, opt.param_groups, opt.rule)
    buckets = layout()
    where = {id(p): (b, j) for b in buckets for j, p in enumerate(b.params)}
    with torch.no_grad():
        for values, group in zip(checked.group_values, opt.param_groups):
            set_group_values(group, values)
        for p, entry in checked.entries:
            if id(p) not in where:
                continue  # frozen: no state
            b, j = where[id(p)]
            views = b.views[j]
            for k in b.states:
                if k in entry:
                    _store(views[k], entry[k], views.get(k + "_scale"))
            master = entry["master"]
            if master is None:
                if b.kind == MASTER:
                    _store(views["master_param"], p.detach(), views.get("master_scale"))
                continue
            if b.kind == MASTER:
                _store(views["master_param"], master, views.get("master_scale"))
                p.copy_(master)
            elif b.kind == REMAINDER:
                hi, lo = split_remainders(master.to(device=p.device, dtype=torch.float32))
                p.copy_(hi)
                views["param_remainder"].copy_(lo)
            else:
                p.copy_(master)


def torch_adam_state_dict(state_dict: dict) -> dict:
    """A FusedAdam or DistributedFusedAdam state dict in torch.optim.Adam/AdamW's
    format: each parameter's state gets the group's step as ``step`` (a float32
    tensor), fp32 masters are dropped (torch has none: load the model's
    parameters from the model checkpoint), groups lose shardadam's keys and
    say ``amsgrad`` when the states have max_exp_avg_sq. FusedAdam's
    ``maximize`` and ``adam_w_mode`` are options of the optimizer, not of the
    groups: construct the torch optimizer to match."""
    state = {}
    steps = {key: g["step"] for g in state_dict["param_groups"] for key in g["params"]}
    for key, entry in state_dict["state"].items():
        out = {k: v.clone() for k, v in entry.items() if k in AdamRule.known_states}
        out["step"] = torch.tensor(float(steps[key]))
        state[key] = out
    groups = []
    for g in state_dict["param_groups"]:
        out = {k: v for k, v in g.items() if k not in ("step", "bias_correction")}
        # torch keeps amsgrad per group (a missing key loads as False)
        out["amsgrad"] = any("max_exp_avg_sq" in state_dict["state"].get(key, {}) for key in g["params"])
        groups.append(out)
    return {"state": state, "param_groups": groups}
