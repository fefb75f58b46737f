"""The sharded checkpoint format of DistributedFusedAdam, for
torch.distributed.checkpoint (DCP).

Each state of each parameter (``param`` fp32 master, ``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq``) is one ShardedTensor of the parameter's
flattened size (memory order); a rank contributes only the pieces its shards
hold, at their offsets in the parameter. DCP writes every piece once and, on
load, hands each rank the ranges its own (possibly different) layout needs, so
a checkpoint written on N ranks loads on M with no rank holding the full state.

    import torch.distributed.checkpoint as dcp
    dcp.save({"model": model.state_dict(), "optim": opt.sharded_state_dict()}, checkpoint_id=path)
    # later, on any number of ranks, after building model and optimizer:
    state = {"model": model.state_dict(), "optim": opt.sharded_state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    opt.load_sharded_state_dict(state["optim"])
"""
from __future__ import annotations

import json
import warnings

import torch
import torch.distributed as dist

from .._groups import pack_groups, plain_value, set_group_values

with warnings.catch_warnings():  # DCP's resharding of uneven flat pieces needs ShardedTensor
    warnings.simplefilter("ignore")
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

__all__ = ["load_sharded_state_dict", "sharded_state_dict"]


def _saved_name(name: str) -> str:
    return "param" if name == "master" else name


def sharded_state_dict(opt) -> dict:
    """This rank's pieces of every state as ShardedTensors, plus the groups.
    fp32 states are views of the optimizer's buffers (dcp.load fills them in
    place); remainders and scaled states go through fp32 copies."""
    if opt.redundant_group is not None:
        raise NotImplementedError("sharded_state_dict with a redundant_process_group: every replica would "
                                  "write the same pieces; use state_dict() (portable)")
    if not all(opt._initialized):  # the state a first step would start from
        opt.init_params([p for p, done in zip(opt.params, opt._initialized) if not done])
    rank = dist.get_rank(opt.dist_group)
    device = f"cuda:{opt.device.index}" if opt.device.type == "cuda" else "cpu"
    pieces = [[] for _ in opt.params]
    for f in opt._shard_fragments:
        pieces[f.param].append(f)
    groups, index = pack_groups(opt.param_groups, plain_value)
    state = {}
    for k, p in enumerate(opt.params):
        if p.numel() == 0:
            continue  # nothing to save
        entry = {}
        for name in opt._state_names:
            shards = [Shard(_piece(opt, name, f), ShardMetadata([f.param_start], [f.param_end - f.param_start],
                                                                f"rank:{rank}/{device}"))
                      for f in pieces[k]]
            entry[_saved_name(name)] = init_from_local_shards(shards, p.numel(), process_group=opt.dist_group)
        state[str(index[id(p)])] = entry
    # One string: DCP would flatten a list of dicts into keys that must
    # already exist, key by key, when loading.
    return {"state": state, "param_groups": json.dumps(groups)}


def _piece(opt, name: str, f) -> torch.Tensor:
    view = _live_view(opt, name, f)
    return view if view is not None else opt._state_row(name, f.bucket)[f.shard_start:f.shard_end].clone()


def _live_view(opt, name: str, f) -> torch.Tensor | None:
    """Fragment f's piece of a state buffer that holds the fp32 values as they
    are (dcp.load fills it in place); None where the buffer stores them otherwise."""
    buffer = getattr(opt, name)
    if buffer is not None and buffer.dtype == torch.float32 and name not in opt.state_scales:
        return buffer[f.bucket, f.shard_start:f.shard_end]
    return None


@torch.no_grad()
def load_sharded_state_dict(opt, sharded: dict) -> None:
    """After dcp.load filled a sharded_state_dict(opt) structure: write the
    pieces into the optimizer (copies for stored-differently states), restore
    the groups' hyperparameters and steps, and make the parameters the loaded
    masters (this rank's pieces, then the all-gather). Checks everything
    before writing anything."""
    saved_groups = json.loads(sharded["param_groups"])
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"the checkpoint has {len(saved_groups)} parameter groups, the optimizer "
                         f"{len(opt.param_groups)}")
    loaded, pieces = _matched_pieces(opt, sharded["state"])
    for saved, group in zip(saved_groups, opt.param_groups):
        set_group_values(group, {k: (tuple(v) if k == "betas" else v) for k, v in saved.items() if k != "params"})
    for name, f, tensor in pieces:
        live = _live_view(opt, name, f)
        if live is None or live.data_ptr() != tensor.data_ptr():  # else dcp.load already wrote it there
            opt._write_state(name, f, tensor.float())
    for k in loaded:
        opt._initialized[k] = True
    _masters_into_params(opt)


def _matched_pieces(opt, state: dict) -> tuple[list, list]:
    """The loaded parameters (positions in opt.params) and, for every state of
    each, (state name, fragment, loaded piece) pairs. A structure made for
    another layout has other pieces: refused, where zip would drop or misplace them."""
    index = {str(i): p for i, p in enumerate(q for g in opt.param_groups for q in g["params"])}
    position = {id(p): k for k, p in enumerate(opt.params)}
    loaded, pieces = [], []
    for key, entry in state.items():
        k = position[id(index[key])]
        frags = sorted((f for f in opt._shard_fragments if f.param == k), key=lambda f: f.param_start)
        for name in opt._state_names:
            local = sorted(entry[_saved_name(name)].local_shards(), key=lambda s: s.metadata.shard_offsets[0])
            _check_ranges(f"state {key} ({_saved_name(name)})", frags, local)
            pieces += [(name, f, shard.tensor) for f, shard in zip(frags, local)]
        loaded.append(k)
    return loaded, pieces


def _check_ranges(what: str, frags: list, local: list) -> None:
    mine = [(f.param_start, f.param_end) for f in frags]
    given = [(s.metadata.shard_offsets[0], s.metadata.shard_offsets[0] + s.metadata.shard_sizes[0]) for s in local]
    if len(given) != len(mine):
        raise ValueError(f"{what}: the sharded state dict holds {len(given)} pieces on this rank, the optimizer "
                         f"{len(mine)}: load into a sharded_state_dict() of this optimizer")
    if given != mine:
        raise ValueError(f"{what}: the sharded state dict holds the ranges {given} on this rank, the optimizer "
                         f"{mine}: load into a sharded_state_dict() of this optimizer")


def _masters_into_params(opt) -> None:
    """Each rank writes its loaded master pieces into its parameter shards
    (where those are a separate copy) and the parameter all-gather brings
    every parameter up to date."""
    if opt.master is not None and opt.param_shards is not opt.master:
        for b in {f.bucket for f in opt._shard_fragments}:
            row = opt._state_row("master", b)
            for f in opt._shard_fragments:
                if f.bucket == b:
                    opt.param_shards[f.bucket, f.shard_start:f.shard_end].copy_(row[f.shard_start:f.shard_end])
    opt.param_sync()
