"""Every check a state-dict load runs before it writes anything, shared by
the fused optimizers' load_state_dict and the distributed optimizers'
load_state_dict and load_sharded_state_dict (see _validate.py's note
"validate, then mutate"). The update rule ([Note: update rules] in _rules.py)
says which states exist and checks the groups' hyperparameters.

Accepted formats (one checker for all of them):
- shardadam's own: FusedAdam's (``master_param``) and DistributedFusedAdam's
  portable one (``param``), with the step in each group;
- torch.optim's (Adam/AdamW, or lion-pytorch's Lion): the step per parameter
  (``state[i]["step"]``, where kept), none in the groups.

Checked: the structure (a dict with 'state' and 'param_groups', each group a
dict with a 'params' list, every state entry a dict), the number of groups and
of parameters in each, that every key appears once and every state entry
belongs to a listed parameter, state names, tensors (a torch.Tensor, strided,
with data (not on the meta device), of a real floating dtype, shaped as its
parameter; for a DTensor parameter a DTensor of its mesh and placements, or a
full tensor, whose local piece is what loads), the states the optimizer keeps present, the groups'
hyperparameters (finite, in range) and the step counters (whole numbers >= 0).
A tensor on another device than the optimizer's is fine: it is copied.

Nothing here writes: the result says what a load will write (normalised group
values, and per parameter the caller's tensors, which are only read).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ._dtensor import local_value
from ._validate import check_betas, check_flag, check_step_count

MASTER_KEYS = ("master_param", "param")  # the fused optimizers' name, the distributed ones' name

_OTHER_MODEL = ("a checkpoint of another model, or of parameter groups built another way: build the optimizer "
                "as the one that saved it")


@dataclass
class CheckedLoad:
    """What a checked load writes. group_values: per live group, the values to
    set (plain numbers, betas a tuple). entries: (parameter, states) for every
    parameter with saved state, where states maps "master" (None when the
    checkpoint has no master) and each saved state name of the rule to the
    caller's tensor."""
    group_values: list = field(default_factory=list)
    entries: list = field(default_factory=list)


def check_state_dict(state_dict, param_groups: list, rule) -> CheckedLoad:
    """Check a state dict against the optimizer's param_groups before a load.
    rule.states: the names the optimizer keeps per parameter (Adam: exp_avg,
    exp_avg_sq and, with AMSGrad, max_exp_avg_sq): a saved entry must hold
    each of them; rule.known_states may be saved (and are otherwise ignored).
    Raises ValueError naming the first problem; writes nothing."""
    known_keys = rule.known_states + MASTER_KEYS + ("step",)
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"state_dict must be an optimizer state dict (a dict with 'state' and 'param_groups'), "
                         f"got {type(state_dict).__name__}")
    missing = [k for k in ("state", "param_groups") if k not in state_dict]
    if missing:
        raise ValueError(f"state_dict is not an optimizer state dict: it needs 'state' and 'param_groups', and "
                         f"has no {' and no '.join(repr(k) for k in missing)} (its keys: {_keys(state_dict)})")
    saved_groups, state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(saved_groups, (list, tuple)):
        raise ValueError(f"state_dict['param_groups'] must be a list of groups, got {type(saved_groups).__name__}")
    if not isinstance(state, Mapping):
        raise ValueError(f"state_dict['state'] must be a dict (parameter key -> its states), got "
                         f"{type(state).__name__}")
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"state_dict has {len(saved_groups)} parameter groups, the optimizer "
                         f"{len(param_groups)}: {_OTHER_MODEL}")
    owner = {}  # saved key -> (group, position, parameter)
    for gi, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        where = f"state_dict['param_groups'][{gi}]"
        if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), (list, tuple)):
            raise ValueError(f"{where} must be a dict with a 'params' list (the keys of its parameters' states), "
                             f"got {_brief(saved)}")
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"{where}['params'] lists {len(saved['params'])} parameters, the optimizer's group "
                             f"{gi} has {len(group['params'])}: {_OTHER_MODEL}")
        for pi, (key, p) in enumerate(zip(saved["params"], group["params"])):
            try:
                seen = owner.get(key)
            except TypeError:
                raise ValueError(f"{where}['params'][{pi}] is {type(key).__name__} {key!r}: parameter keys must be "
                                 f"hashable (torch uses ints)") from None
            if seen is not None:
                raise ValueError(f"{where}['params'][{pi}] is {key!r}, which "
                                 f"state_dict['param_groups'][{seen[0]}]['params'][{seen[1]}] lists too: every "
                                 f"parameter has its own key")
            owner[key] = (gi, pi, p)
    strays = [k for k in state if k not in owner]
    if strays:
        raise ValueError(f"state_dict['state'] has an entry for key {strays[0]!r}, which no group's 'params' lists "
                         f"({len(strays)} such entries): the groups and the states come from different checkpoints")
    checked = CheckedLoad()
    steps = [[] for _ in param_groups]  # torch.optim's per-parameter steps, by group
    for key, (gi, pi, p) in owner.items():
        entry = state.get(key)
        if entry is None or (isinstance(entry, Mapping) and not entry):
            continue  # no state saved for this parameter
        where = f"state_dict['state'][{key!r}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where} must be a dict of the parameter's states, got {type(entry).__name__}")
        unknown = [name for name in entry if name not in known_keys]
        if unknown:
            raise ValueError(f"{where} has an unknown state {unknown[0]!r} (known: {', '.join(known_keys)}): not "
                             f"a state dict of {rule.title}")
        if all(name in entry for name in MASTER_KEYS):
            raise ValueError(f"{where} has both 'master_param' and 'param': keep the one master it should load")
        absent = [name for name in rule.states if name not in entry]
        if absent:
            raise ValueError(f"{where} has no {absent[0]!r}, which the optimizer keeps for its parameter "
                             f"param_groups[{gi}]['params'][{pi}] (a checkpoint without AMSGrad into an optimizer "
                             f"with it, or an incomplete entry)")
        loaded = {"master": None}
        for name, value in entry.items():
            if name == "step":
                steps[gi].append(check_step_count(where, "'step'", value))
                continue
            check_state_tensor(f"{where}[{name!r}]", value, p.shape, f"param_groups[{gi}]['params'][{pi}]")
            value = local_value(f"{where}[{name!r}]", value, p, f"param_groups[{gi}]['params'][{pi}]")
            loaded["master" if name in MASTER_KEYS else name] = value
        checked.entries.append((p, loaded))
    for gi, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        checked.group_values.append(check_group_values(f"state_dict['param_groups'][{gi}]", saved, group, rule,
                                                       steps[gi]))
    return checked


def check_state_tensor(where: str, value, shape, param: str | None = None) -> None:
    """A saved state: a strided torch.Tensor with data, of a real floating
    dtype, of the given shape (None: any). Its device does not matter."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise ValueError(f"{where} is a {value.layout} tensor: save dense tensors (t.to_dense())")
    if value.device.type == "meta":
        raise ValueError(f"{where} is on the meta device and holds no data: load the checkpoint with its data "
                         f"(e.g. torch.load(path, map_location='cpu'))")
    if not value.is_floating_point():  # complex, integer and bool tensors are not
        raise ValueError(f"{where} has dtype {str(value.dtype).replace('torch.', '')}: optimizer states are real "
                         f"floating-point tensors")
    if shape is not None and tuple(value.shape) != tuple(shape):
        of = f"its parameter {param}" if param else "the parameter"
        raise ValueError(f"{where} has shape {tuple(value.shape)}, {of} {tuple(shape)}: {_OTHER_MODEL}")


def check_group_values(where: str, saved: Mapping, group: dict, rule, entry_steps: list | tuple = ()) -> dict:
    """What a saved group sets in a live one, checked: the hyperparameters the
    live group has (plain numbers; a one-element tensor lr is read), and its
    step; without a saved group step (torch.optim.Adam/AdamW), the largest of
    its parameters' steps (all equal after ordinary training)."""
    values = {k: v for k, v in saved.items() if k in group and k != "params"}
    for k, meaning in rule.absent_group_values.items():  # [Note: torch.optim's checkpoint schema] in _rules.py
        if k in group and k not in saved:
            values[k] = meaning
    if "lr" in values and isinstance(values["lr"], torch.Tensor):
        lr = values["lr"]
        if lr.device.type == "meta" or lr.numel() != 1 or not lr.is_floating_point():
            raise ValueError(f"{where}: lr must be a number or a one-element floating tensor, got a "
                             f"{str(lr.dtype).replace('torch.', '')} tensor of shape {tuple(lr.shape)} on "
                             f"{lr.device}")
        values["lr"] = lr.item()
    if "betas" in values:
        betas = values["betas"]
        if isinstance(betas, (list, tuple)):  # one-element tensors (torch allows them) as numbers
            betas = tuple(b.item() if isinstance(b, torch.Tensor) and b.numel() == 1 and b.device.type != "meta"
                          else b for b in betas)
        _as_value_error(check_betas, where, betas)
        values["betas"] = tuple(betas)
    merged = dict(group)
    merged.update({k: v for k, v in values.items() if k in merged})
    _as_value_error(rule.check_group, where, merged)
    for name in ("bias_correction", "maximize"):
        if name in values:
            values[name] = check_flag(where, name, values[name])
    if "step" in values:
        values["step"] = check_step_count(where, "step", values["step"])
    elif entry_steps:
        values["step"] = max(entry_steps)
    return values


def _as_value_error(check, *args) -> None:
    """Loads refuse with ValueError only (a wrong type in a checkpoint is a bad value)."""
    try:
        check(*args)
    except TypeError as e:
        raise ValueError(str(e)) from None


def _keys(d: Mapping) -> str:
    keys = list(d)
    return repr(keys[:6])[:-1] + (", ...]" if len(keys) > 6 else "]")


def _brief(x) -> str:
    if isinstance(x, Mapping):
        return f"a dict with keys {_keys(x)}"
    return type(x).__name__
