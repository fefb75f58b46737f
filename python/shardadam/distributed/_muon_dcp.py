"""DistributedFusedMuon's sharded checkpoint, for torch.distributed.checkpoint
(DCP): each rank writes only what it holds, without gathering, and a
checkpoint written on N ranks loads on M.

The structure, sharded_state_dict(opt), in sharded_checkpoint.py's
conventions (its tables, layout key, refusals and check before dcp.load):

- ``layout_<hash>``: sharded_checkpoint's layout key, here of the table of
  every parameter the optimizer steps (the Muon ones and the AdamW groups'
  trainable ones, in param_groups order), first, so that dcp.load from a
  checkpoint of other parameters fails while DCP plans, naming that key,
  before it writes anything (the momentum pieces are live views);
- ``state``: ``{"<index>": {"momentum_buffer": DTensor}}`` for each Muon
  parameter, by its index in param_groups order, as in torch's state dict
  ([Note: Muon momentum in DCP]);
- ``stepped``: whether the Muon momentum exists yet (torch's state holds
  none before the first step, and state_dict() follows it);
- ``params``, ``shapes``: that table as ``[index, numel]`` and ``[index,
  shape]`` rows; ``param_groups``: each Muon group's hyperparameters, and
  ``use_muon=False`` for each AdamW group (JSON strings);
- ``adamw``: the AdamW groups' DistributedFusedAdam.sharded_state_dict()
  (their fp32 masters, Adam states, hyperparameters and steps).

[Note: Muon momentum in DCP] Each Muon parameter's momentum is one 2-D
DTensor, of which a rank holds exactly the matrices it owns ([Note:
matrix-atomic ownership] in _muon_owners.py), each as one piece of rows: a
2-D parameter's momentum has the parameter's shape, and the owner holds all
of it; a 3-D parameter's (experts, rows, cols) is saved as its matrices'
rows one after the other, (experts * rows, cols), and the owner of expert i
holds rows i * rows to (i + 1) * rows; a rank without any holds an empty
piece. The owners follow the Newton-Schulz cost, not a torch.chunk split of
dim 0, so a plain ``Shard(0)`` DTensor cannot describe them; ShardedTensor
could, but DCP warns that it is deprecated. This is sharded_checkpoint's
ragged DTensor ([Note: ragged DTensor pieces]: its local tensor is torch's
LocalShardsWrapper, which DCP saves piece by piece and reshards on load,
with gloo as with NCCL). LocalShardsWrapper takes several pieces on one rank only
for 1-D and 2-D tensors (torch 2.13's view raises for more dims, and
DTensor.from_local calls it), hence the rows. DCP writes each matrix once,
from its owner, and on load each rank asks for the matrices it owns at the
new world size, which are whole saved pieces: it reads those and nothing
else. The pieces are views of the owner's momentum slots when the momentum
is stored in the parameter's dtype (dcp.load fills them in place); with
another momentum_dtype they are copies in the parameter's dtype (the
checkpoint holds the parameter's dtype, as state_dict() does), stored into
the slots by load_sharded_state_dict. The calls, in their order, are
DistributedFusedAdam's (sharded_checkpoint.py's docstring; docs/muon.md).
"""
from __future__ import annotations

import json
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from .._groups import pack_groups, plain_value, set_group_values
from .._muon_groups import MUON_KEYS, check_muon_hyper, uses_muon
from .._state_dict_check import check_state_tensor
from ._agreement import validate_then_agree
from .sharded_checkpoint import (check_layout_key, check_sharded_state_dict, check_tables, json_list, layout_key,
                                 matched_groups, ragged_dtensor, ragged_pieces, read_tables, refuse_redundant,
                                 shape_row)

__all__ = ["check_checkpoint", "load_sharded_state_dict", "sharded_state_dict"]

_KEYS = ("state", "stepped", "params", "shapes", "param_groups")


class _Table:
    """Every parameter the optimizer steps, in param_groups order: each Muon
    parameter and the AdamW groups' trainable ones (their DistributedFusedAdam's).
    ``table``, ``shapes`` and ``total`` as sharded_checkpoint's _FlatSpace has them."""

    def __init__(self, opt):
        _, self.index = pack_groups(opt.param_groups)
        stepped = {id(p) for p in (opt._muon.params if opt._muon is not None else ())}
        stepped |= {id(p) for p in (opt._adamw.params if opt._adamw is not None else ())}
        params = [p for g in opt.param_groups for p in g["params"] if id(p) in stepped]
        self.table = [[self.index[id(p)], p.numel()] for p in params]
        self.shapes = [shape_row(self.index[id(p)], p) for p in params]
        self.total = sum(p.numel() for p in params)


def _saved_shape(p: torch.Tensor) -> tuple[int, int]:
    """The shape a Muon parameter's momentum is saved in: its matrices' rows
    one after the other ([Note: Muon momentum in DCP])."""
    return (p.shape[0] * p.shape[1], p.shape[2]) if p.ndim == 3 else tuple(p.shape)


def _owned(opt) -> dict[int, list]:
    """By Muon parameter: (offsets in its saved shape, momentum view) of each
    matrix this rank owns, in offset order."""
    out: dict[int, list] = {k: [] for k in range(len(opt._muon.params))} if opt._muon is not None else {}
    for m, view in (opt._muon.owned_momentum() if opt._muon is not None else ()):
        out[m.param].append((((m.index or 0) * m.rows, 0), view))
    for pieces in out.values():
        pieces.sort(key=lambda piece: piece[0])
    return out


def _device(opt) -> torch.device:
    return opt._muon.params[0].device if opt._muon is not None else opt._adamw.device


def sharded_state_dict(opt) -> dict:
    """This rank's momentum pieces, the AdamW groups' sharded state dict, the
    tables and the groups ([Note: Muon momentum in DCP]); no collective."""
    refuse_redundant(opt)  # the AdamW part's refusal, for the Muon part too
    table = _Table(opt)
    state = {}
    if opt._muon is not None:
        device = _device(opt)
        mesh = DeviceMesh.from_group(opt.process_group if opt.process_group is not None else dist.group.WORLD,
                                     device.type)
        for k, owned in _owned(opt).items():
            p = opt._muon.params[k]
            pieces = [view if view.dtype == p.dtype else view.to(p.dtype) for _, view in owned]
            dtensor = ragged_dtensor(pieces, [offsets for offsets, _ in owned], _saved_shape(p), mesh, p.dtype, device)
            state[str(table.index[id(p)])] = {"momentum_buffer": dtensor}
    groups = [{**{k: plain_value(g[k]) for k in MUON_KEYS}, "params": saved["params"]} if uses_muon(g)
              else {"use_muon": False, "params": saved["params"]}
              for g, saved in zip(opt.param_groups, pack_groups(opt.param_groups)[0])]
    sharded = {layout_key(table): torch.tensor([len(table.table), table.total], dtype=torch.int64),
               "state": state, "stepped": bool(opt._muon is not None and opt._muon.stepped),
               "params": json.dumps(table.table), "shapes": json.dumps(table.shapes),
               "param_groups": json.dumps(groups)}
    if opt._adamw is not None:
        sharded["adamw"] = opt._adamw.sharded_state_dict()
    return sharded


def check_checkpoint(opt, checkpoint_id, key: str) -> None:
    """Before dcp.load: the checkpoint's tables and groups against the
    optimizer's (a few strings, read alone), naming the first parameter that
    differs; every rank reads the same and raises alike."""
    tables = read_tables(checkpoint_id, key, opt.process_group, ("params", "shapes", "param_groups"))
    _check_tables(opt, tables, _Table(opt))


def _check_tables(opt, sharded: Mapping, table: _Table) -> list:
    """The parameter tables, then the groups: the Muon groups' values to set."""
    check_tables(opt, table, json_list(sharded, "params", "parameter table"),
                 json_list(sharded, "shapes", "shape table"))
    return _group_values(opt, json_list(sharded, "param_groups", "parameter groups"))


def _group_values(opt, saved_groups: list) -> list:
    """Per group: the Muon hyperparameters to set, checked (None for an AdamW
    group: the inner optimizer's dict holds its values)."""
    values = []
    for where, saved, group in matched_groups(opt, saved_groups):
        if uses_muon(saved) != uses_muon(group):
            raise ValueError(f"{where} has use_muon={uses_muon(saved)}, the optimizer's group use_muon="
                             f"{uses_muon(group)}: another model, or groups built another way")
        if not uses_muon(group):
            values.append(None)
            continue
        missing = [k for k in MUON_KEYS if k not in saved]
        if missing:
            raise ValueError(f"{where} lacks {missing}: load a sharded_state_dict() of a DistributedFusedMuon")
        value = {k: saved[k] for k in MUON_KEYS}
        if isinstance(value["ns_coefficients"], list):  # a tuple, through JSON
            value["ns_coefficients"] = tuple(value["ns_coefficients"])
        check_muon_hyper(where, value)
        values.append(value)
    return values


def _check(opt, sharded) -> tuple[list, list, bool]:
    """Everything load_sharded_state_dict checks, writing nothing: (the Muon
    groups' values, [(momentum view, loaded piece)], stepped)."""
    keys = _KEYS + (("adamw",) if opt._adamw is not None else ())
    if not isinstance(sharded, Mapping) or any(k not in sharded for k in keys):
        got = f"a dict with keys {list(sharded)}" if isinstance(sharded, Mapping) else type(sharded).__name__
        raise ValueError(f"the sharded state dict must be the dict of a sharded_state_dict() of this optimizer "
                         f"(with {list(keys)}), as filled by dcp.load, got {got}")
    table = _Table(opt)
    values = _check_tables(opt, sharded, table)
    check_layout_key(sharded, table)
    if not isinstance(sharded["stepped"], bool):
        raise ValueError(f"sharded['stepped'] must be True or False, got {sharded['stepped']!r}")
    pieces = _matched_momentum(opt, sharded["state"])
    if opt._adamw is not None:
        try:
            check_sharded_state_dict(opt._adamw, sharded["adamw"])
        except ValueError as e:
            raise ValueError(f"sharded['adamw'] (the AdamW groups' DistributedFusedAdam): {e}") from None
    return values, pieces, sharded["stepped"]


def _matched_momentum(opt, state) -> list:
    """(momentum view, loaded piece) for every matrix this rank owns; a
    structure made for another world size or model holds other pieces: refused."""
    if not isinstance(state, Mapping):
        raise ValueError(f"sharded['state'] must be a dict of momentum DTensors, got {type(state).__name__}")
    pieces = []
    _, index = pack_groups(opt.param_groups)
    for k, owned in _owned(opt).items():
        p = opt._muon.params[k]
        i = index[id(p)]
        where = f"sharded['state']['{i}']['momentum_buffer']"
        entry = state.get(str(i))
        tensor = entry.get("momentum_buffer") if isinstance(entry, Mapping) else None
        if not isinstance(tensor, DTensor) or not isinstance(tensor.to_local(), LocalShardsWrapper):
            raise ValueError(f"{where} must be the momentum DTensor of a sharded_state_dict() of this optimizer, "
                             f"got {type(tensor).__name__}")
        if tuple(tensor.size()) != _saved_shape(p):
            raise ValueError(f"{where} has shape {tuple(tensor.size())}, {_saved_shape(p)} for the parameter of shape "
                             f"{tuple(p.shape)}: load into a sharded_state_dict() of this optimizer")
        held = ragged_pieces(tensor)
        if [offsets for offsets, _ in held] != [offsets for offsets, _ in owned]:
            raise ValueError(f"{where} holds the pieces at {[o for o, _ in held]} on this rank, which owns the "
                             f"matrices at {[o for o, _ in owned]} (the sharded_state_dict() of another world "
                             "size or model): load into a sharded_state_dict() of this optimizer")
        for (offsets, view), (_, t) in zip(owned, held):
            check_state_tensor(f"{where}'s piece at {offsets}", t, tuple(view.shape))
            pieces.append((view, t))
    return pieces


@torch.no_grad()
def load_sharded_state_dict(opt, sharded: dict) -> None:
    """After dcp.load filled a sharded_state_dict(opt) structure: the AdamW
    groups' state (their DistributedFusedAdam's load), the Muon groups'
    hyperparameters and the owned matrices' momentum. Every rank checks
    everything first, the AdamW part included, then the ranks agree (one
    small collective): if any refuses, every rank raises the same ValueError
    and none writes anything."""
    values, pieces, stepped = validate_then_agree("DistributedFusedMuon.load_sharded_state_dict",
                                                  lambda: _check(opt, sharded), opt.process_group, _device(opt))
    if opt._adamw is not None:
        opt._adamw.load_sharded_state_dict(sharded["adamw"])
    for value, group in zip(values, opt.param_groups):
        if value is not None:
            set_group_values(group, value)
    for view, t in pieces:
        if view.data_ptr() != t.data_ptr() or view.dtype != t.dtype:  # not filled in place by dcp.load
            view.copy_(t)
    if opt._muon is not None:
        opt._muon.stepped = stepped
