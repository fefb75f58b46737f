"""The sharded checkpoint format of DistributedFusedAdam, for
torch.distributed.checkpoint (DCP).

Each state (``param`` fp32 master, ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``) is one 1-D ShardedTensor over the flat index space of all
trainable parameters: the parameters in param_groups order (their index in the
portable state dict), each flattened in memory order, one after the other
(``params`` lists them as ``[index, numel]`` pairs). A rank contributes only
the pieces its shards hold, one per shard fragment, at their offsets in that
space. The space does not depend on the number of ranks or the bucket size, so
DCP writes every piece once and, on load, hands each rank the ranges its own
(possibly different) layout needs: a checkpoint written on N ranks loads on M
with no rank holding the full state. Building a ShardedTensor costs a
collective (all_gather_object of the pieces' metadata): one per state, not one
per parameter and state.

    import torch.distributed.checkpoint as dcp
    dcp.save({"model": model.state_dict(), "optim": opt.sharded_state_dict()}, checkpoint_id=path)
    # later, on any number of ranks, after building model and optimizer:
    state = {"model": model.state_dict(), "optim": opt.sharded_state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    opt.load_sharded_state_dict(state["optim"])
"""
from __future__ import annotations

import bisect
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


class _FlatSpace:
    """Where each trainable parameter lies in the checkpoint's flat index
    space, and this rank's shard fragments in that space's order."""

    def __init__(self, opt):
        _, index = pack_groups(opt.param_groups)
        order = sorted(range(len(opt.params)), key=lambda k: index[id(opt.params[k])])
        self.offsets = [0] * len(opt.params)  # by position in opt.params
        self.table, self.starts, self.order = [], [], order
        total = 0
        for k in order:
            self.offsets[k] = total
            self.starts.append(total)
            self.table.append([index[id(opt.params[k])], opt.params[k].numel()])
            total += opt.params[k].numel()
        self.total = total
        self.frags = sorted((f for f in opt._shard_fragments if f.numel > 0), key=self.start)

    def start(self, f) -> int:
        return self.offsets[f.param] + f.param_start

    def ranges(self) -> list[tuple[int, int]]:
        return [(self.start(f), self.start(f) + f.numel) for f in self.frags]

    def per_param(self, ranges: list[tuple[int, int]]) -> dict[int, list[tuple[int, int]]]:
        """Ranges grouped by parameter (position in param_groups order), relative to its start."""
        out: dict[int, list[tuple[int, int]]] = {}
        for start, end in ranges:
            i = max(0, bisect.bisect_right(self.starts, start) - 1)  # past empty parameters at the same offset
            out.setdefault(i, []).append((start - self.starts[i], end - self.starts[i]))
        return out


def sharded_state_dict(opt) -> dict:
    """This rank's pieces of every state as one ShardedTensor per state, plus
    the parameter table and the groups. fp32 states are views of the
    optimizer's buffers (dcp.load fills them in place); remainders and scaled
    states go through fp32 copies of whole bucket rows, one per bucket."""
    if opt.redundant_group is not None:
        raise NotImplementedError("sharded_state_dict with a redundant_process_group: every replica would "
                                  "write the same pieces; use state_dict() (portable)")
    if not all(opt._initialized):  # the state a first step would start from
        opt.init_params([p for p, done in zip(opt.params, opt._initialized) if not done])
    rank = dist.get_rank(opt.dist_group)
    device = f"cuda:{opt.device.index}" if opt.device.type == "cuda" else "cpu"
    placement = f"rank:{rank}/{device}"
    space = _FlatSpace(opt)
    groups, _ = pack_groups(opt.param_groups, plain_value)
    state = {}
    if space.total > 0:
        for name in opt._state_names:
            rows: dict[int, torch.Tensor] = {}
            shards = [Shard(_piece(opt, name, f, rows), ShardMetadata([space.start(f)], [f.numel], placement))
                      for f in space.frags]
            state[_saved_name(name)] = init_from_local_shards(shards, space.total, process_group=opt.dist_group)
    # Strings: DCP would flatten lists and dicts into keys that must already
    # exist, key by key, when loading.
    return {"state": state, "params": json.dumps(space.table), "param_groups": json.dumps(groups)}


def _piece(opt, name: str, f, rows: dict) -> torch.Tensor:
    view = _live_view(opt, name, f)
    if view is not None:
        return view
    if f.bucket not in rows:
        row = opt._state_row(name, f.bucket)
        if _shares_buffer(opt, row):  # store_params=False with fp32 parameters: the shard itself
            row = row.clone()
        rows[f.bucket] = row
    return rows[f.bucket][f.shard_start:f.shard_end]


def _shares_buffer(opt, t: torch.Tensor) -> bool:
    buffers = (opt.master, opt.exp_avg, opt.exp_avg_sq, opt.max_exp_avg_sq, opt.param_shards, opt.remainders)
    ptr = t.untyped_storage().data_ptr()
    return any(b is not None and b.untyped_storage().data_ptr() == ptr for b in buffers)


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
    space = _FlatSpace(opt)
    saved_params = json.loads(sharded["params"]) if "params" in sharded else None
    if saved_params != space.table:
        raise ValueError(f"the checkpoint's trainable parameters ([index, numel] in param_groups order) are "
                         f"{_brief(saved_params)}, the optimizer's {_brief(space.table)}: another model, or "
                         f"another choice of frozen parameters")
    pieces = _matched_pieces(opt, sharded["state"], space)
    for saved, group in zip(saved_groups, opt.param_groups):
        set_group_values(group, {k: (tuple(v) if k == "betas" else v) for k, v in saved.items() if k != "params"})
    for name, f, tensor in pieces:
        live = _live_view(opt, name, f)
        if live is None or live.data_ptr() != tensor.data_ptr():  # else dcp.load already wrote it there
            opt._write_state(name, f, tensor.float())
    for k in range(len(opt.params)):
        opt._initialized[k] = True
    _masters_into_params(opt)


def _brief(table) -> str:
    if not isinstance(table, list):
        return repr(table)
    return f"{len(table)} parameters {table[:4]}{' ...' if len(table) > 4 else ''}"


def _matched_pieces(opt, state: dict, space: _FlatSpace) -> list:
    """(state name, fragment, loaded piece) for every state and piece of this
    rank. A structure made for another layout has other pieces: refused,
    where zip would drop or misplace them."""
    pieces = []
    mine = space.ranges()
    for name in opt._state_names if space.total > 0 else ():
        saved = _saved_name(name)
        if saved not in state:
            raise ValueError(f"the sharded state dict has no state '{saved}': load into a sharded_state_dict() "
                             f"of this optimizer")
        tensor = state[saved]
        if tuple(tensor.size()) != (space.total,):
            raise ValueError(f"state '{saved}' covers {tuple(tensor.size())} elements, the optimizer's parameters "
                             f"{space.total}: load into a sharded_state_dict() of this optimizer")
        local = sorted(tensor.local_shards(), key=lambda s: s.metadata.shard_offsets[0])
        given = [(s.metadata.shard_offsets[0], s.metadata.shard_offsets[0] + s.metadata.shard_sizes[0]) for s in local]
        if given != mine:
            raise ValueError(_mismatch(saved, space, given, mine))
        pieces += [(name, f, shard.tensor) for f, shard in zip(space.frags, local)]
    return pieces


def _mismatch(saved: str, space: _FlatSpace, given: list, mine: list) -> str:
    """The first parameter whose pieces on this rank differ, in its own offsets."""
    have, want = space.per_param(given), space.per_param(mine)
    for i in sorted(set(have) | set(want)):
        g, m = have.get(i, []), want.get(i, [])
        if g == m:
            continue
        what = f"state {space.table[i][0]} ({saved})"
        hint = "load into a sharded_state_dict() of this optimizer"
        if len(g) != len(m):
            return f"{what}: the sharded state dict holds {len(g)} pieces on this rank, the optimizer {len(m)}: {hint}"
        return f"{what}: the sharded state dict holds the ranges {g} on this rank, the optimizer {m}: {hint}"
    return f"state '{saved}': the sharded state dict holds other pieces on this rank than the optimizer"


def _masters_into_params(opt) -> None:
    """Each rank writes its loaded master pieces into its parameter shards
    (where those are a separate copy) and the parameter all-gather brings
    every parameter up to date."""
    if opt.master is not None and opt.param_shards is not opt.master:
        for b, frags in enumerate(opt._shard_fragments_by_bucket):
            if not frags:
                continue
            row = opt._state_row("master", b)
            for f in frags:
                opt.param_shards[f.bucket, f.shard_start:f.shard_end].copy_(row[f.shard_start:f.shard_end])
    opt.param_sync()
