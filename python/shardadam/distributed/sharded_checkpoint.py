"""The sharded checkpoint format of DistributedFusedAdam, for
torch.distributed.checkpoint (DCP).

Each state (``param`` fp32 master, ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``) is one 1-D DTensor over the flat index space of all
trainable parameters: the parameters in param_groups order (their index in the
portable state dict), each flattened in memory order, one after the other
(``params`` lists them as ``[index, numel]`` pairs, ``shapes`` as ``[index,
shape]``, plus the memory order of dims where it is not row-major). A rank contributes only
the pieces its shards hold, one per shard fragment, at their offsets in that
space. The space does not depend on the number of ranks or the bucket size, so
DCP writes every piece once and, on load, hands each rank the ranges its own
(possibly different) layout needs: a checkpoint written on N ranks loads on M
with no rank holding the full state.

[Note: ragged DTensor pieces] A rank's pieces are not one contiguous range of
the space (each bucket gives it one shard, and the buckets follow each other),
so a plain ``Shard(0)`` DTensor, one torch.chunk-sized block per rank, cannot
describe them. The DTensor's local tensor is torch's LocalShardsWrapper (the
form DCP supports for several pieces per rank at any offsets: it hands DCP
one write item and one chunk per piece); the DTensor is ``Shard(0)`` on a 1-D
DeviceMesh over the optimizer's process group, with the space's global size.
Building it costs no collective (DCP's planning gathers the chunks). A rank
with no piece holds one empty piece at the end of the space (past the end of
dim 0, for ragged_dtensor's N-D tensors): DCP keeps one write item per (key,
offset), so at offset 0 it could drop the real piece that starts there in
favour of the empty one.

A checkpoint of another layout is refused before anything is written:
- by DCP itself, while it plans (before it reads any data): the structure holds
  a small tensor under ``layout_<hash>``, the hash of the ``shapes`` table, so
  dcp.load from a checkpoint of other parameters fails with DCP's
  "Missing key in checkpoint state_dict: <prefix>.layout_<hash>." (a
  checkpoint whose total size differs already fails DCP's size check);
- by check_sharded_checkpoint (check_checkpoint here), called before
  dcp.load, which reads only the checkpoint's tables and names the first
  parameter that differs before DCP plans the load;
- by load_sharded_state_dict, which checks the tables, the groups and every
  piece on every rank, then lets the ranks agree (one small collective), and
  names the first parameter that differs.
Checkpoints written before the layout key and ``shapes`` existed lack them:
strict dcp.load refuses them (missing key); they still load with
``planner=DefaultLoadPlanner(allow_partial_load=True)``, and then only the
``[index, numel]`` table is compared, after dcp.load has written into the
optimizer's fp32 buffers.

    import torch.distributed.checkpoint as dcp
    dcp.save({"model": model.state_dict(), "optim": opt.sharded_state_dict()}, checkpoint_id=path)
    # later, on any number of ranks, after building model and optimizer:
    opt.check_sharded_checkpoint(path)  # another model's checkpoint: named here
    state = {"model": model.state_dict(), "optim": opt.sharded_state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    opt.load_sharded_state_dict(state["optim"])
"""
from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Mapping

import torch
import torch.distributed as dist

from .._groups import pack_groups, param_names, plain_value, set_group_values
from .._state_dict_check import check_group_values, check_state_tensor
from .._torch import memory_order
from ._agreement import validate_then_agree

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

__all__ = ["check_checkpoint", "check_layout_key", "check_sharded_state_dict", "check_tables", "json_list",
           "layout_key", "load_sharded_state_dict", "local_pieces", "ragged_dtensor", "ragged_pieces", "read_tables",
           "refuse_redundant", "shape_row", "sharded_state_dict"]

LAYOUT_PREFIX = "layout_"


def _saved_name(name: str) -> str:
    return "param" if name == "master" else name


class _FlatSpace:
    """Where each trainable parameter lies in the checkpoint's flat index
    space, and this rank's shard fragments in that space's order."""

    def __init__(self, opt):
        _, index = pack_groups(opt.param_groups)
        order = sorted(range(len(opt.params)), key=lambda k: index[id(opt.params[k])])
        self.offsets = [0] * len(opt.params)  # by position in opt.params
        self.table, self.shapes, self.starts, self.order = [], [], [], order
        total = 0
        for k in order:
            p = opt.params[k]
            self.offsets[k] = total
            self.starts.append(total)
            self.table.append([index[id(p)], p.numel()])
            self.shapes.append(shape_row(index[id(p)], p))
            total += p.numel()
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


def shape_row(index: int, p: torch.Tensor) -> list:
    """A parameter's row of the shape table: [index, shape], and the dims'
    memory order where it is not row-major (channels_last): the flat space
    holds each parameter in memory order."""
    dims = memory_order(p)
    return [index, list(p.shape)] + ([list(dims)] if list(dims) != sorted(dims) else [])


def ragged_dtensor(pieces: list[torch.Tensor], offsets: list[tuple[int, ...]], shape: tuple[int, ...], mesh,
                   dtype: torch.dtype, device) -> DTensor:
    """A DTensor of global `shape` of which this rank holds `pieces` at
    `offsets` ([Note: ragged DTensor pieces]); a rank without any holds one
    empty piece (of `dtype`, on `device`) past the end of dim 0. Several
    pieces on one rank: 1-D or 2-D tensors only (torch's LocalShardsWrapper
    takes no more dims: [Note: Muon momentum in DCP] in _muon_dcp.py)."""
    if not pieces:
        pieces = [torch.empty((0, *shape[1:]), dtype=dtype, device=device)]
        offsets = [(shape[0], *(0 for _ in shape[1:]))]
    stride = [1] * len(shape)
    for d in reversed(range(len(shape) - 1)):
        stride[d] = stride[d + 1] * shape[d + 1]
    return DTensor.from_local(LocalShardsWrapper(pieces, offsets), mesh, [Shard(0)], run_check=False,
                              shape=torch.Size(shape), stride=tuple(stride))


def refuse_redundant(opt) -> None:
    """No sharded checkpoint with a redundant group (before anything is
    built or written): every replica would write the same pieces."""
    if opt.redundant_group is not None:
        raise NotImplementedError("sharded_state_dict with a redundant_process_group: every replica would "
                                  "write the same pieces; use state_dict() (portable)")


def sharded_state_dict(opt) -> dict:
    """This rank's pieces of every state as one DTensor per state, plus
    the parameter table and the groups. fp32 states are views of the
    optimizer's buffers (dcp.load fills them in place); remainders and scaled
    states go through fp32 copies of whole bucket rows, one per bucket."""
    refuse_redundant(opt)
    if not all(opt._initialized):  # the state a first step would start from
        opt.init_params([p for p, done in zip(opt.params, opt._initialized) if not done])
    space = _FlatSpace(opt)
    groups, _ = pack_groups(opt.param_groups, plain_value)
    state = {}
    if space.total > 0:
        group = opt.dist_group if opt.dist_group is not None else dist.group.WORLD
        where = opt.shard_state_device  # host memory with state_device="cpu": the pieces are loaded in place there
        mesh = DeviceMesh.from_group(group, where.type)
        for name in opt._state_names:
            rows: dict[int, torch.Tensor] = {}
            pieces = [_piece(opt, name, f, rows) for f in space.frags]
            offsets = [(space.start(f),) for f in space.frags]
            state[_saved_name(name)] = ragged_dtensor(pieces, offsets, (space.total,), mesh, torch.float32, where)
    # Strings: DCP would flatten lists and dicts into keys that must already
    # exist, key by key, when loading. The layout key comes before the other
    # new entries, so that DCP names it when a checkpoint lacks it.
    return {"state": state, "params": json.dumps(space.table),
            layout_key(space): torch.tensor([len(space.table), space.total], dtype=torch.int64),
            "shapes": json.dumps(space.shapes), "param_groups": json.dumps(groups)}


def layout_key(space: "_FlatSpace") -> str:
    """``layout_`` and 16 hex digits of the SHA-256 of the [index, shape]
    table: equal for every world size and bucket size, different for other
    parameters (shapes, count, frozen ones, memory order)."""
    return LAYOUT_PREFIX + hashlib.sha256(json.dumps(space.shapes).encode()).hexdigest()[:16]


def _piece(opt, name: str, f, rows: dict) -> torch.Tensor:
    view = _live_view(opt, name, f)
    if view is not None:
        return view
    if f.bucket not in rows:  # true values, a copy ([Note: storage codecs] in _storage.py)
        rows[f.bucket] = opt._state_row(name, f.bucket)
    return rows[f.bucket][f.shard_start:f.shard_end]


def _live_view(opt, name: str, f) -> torch.Tensor | None:
    """Fragment f's piece of a state buffer that holds the fp32 values as they
    are (dcp.load fills it in place); None where the buffer stores them otherwise."""
    buffer = opt.state_buffer(name)
    if buffer is not None and buffer.dtype == torch.float32 and name not in opt.state_scales:
        return buffer[f.bucket, f.shard_start:f.shard_end]
    return None


@torch.no_grad()
def load_sharded_state_dict(opt, sharded: dict) -> None:
    """After dcp.load filled a sharded_state_dict(opt) structure: write the
    pieces into the optimizer (copies for stored-differently states), restore
    the groups' hyperparameters and steps, and make the parameters the loaded
    masters (this rank's pieces, then the all-gather). Every rank checks
    everything first, then the ranks agree (one small collective): if any
    refuses, every rank raises the same ValueError and none writes anything."""
    group_values, pieces = validate_then_agree("DistributedFusedAdam.load_sharded_state_dict",
                                               lambda: check_sharded_state_dict(opt, sharded), opt.group, opt.device)
    for values, group in zip(group_values, opt.param_groups):
        set_group_values(group, values)
    for name, f, tensor in pieces:
        live = _live_view(opt, name, f)
        if live is None or live.data_ptr() != tensor.data_ptr():
            opt._write_state(name, f, tensor.float())
        elif name == "master":  # dcp.load wrote it there already
            opt._master_written(f)
    for k in range(len(opt.params)):
        opt._initialized[k] = True
    opt.param_sync()  # the parameter shards followed the masters (_write_state): every rank's go to every rank


def check_checkpoint(opt, checkpoint_id, key: str) -> None:
    """The checkpoint's parameter tables against the optimizer's, read alone
    (read_tables) before the caller's dcp.load plans: DCP's own refusal of
    another layout names a key, this one the parameter. Every rank reads the
    same tables and raises alike."""
    tables = read_tables(checkpoint_id, key, opt.dist_group)
    check_tables(opt, _FlatSpace(opt), json_list(tables, "params", "parameter table"),
                 json_list(tables, "shapes", "shape table") if tables["shapes"] else None)


def read_tables(checkpoint_id, key: str, process_group, names: tuple[str, ...] = ("params", "shapes")) -> dict:
    """The string entries `names` of the sharded_state_dict() saved under
    `key` (a few short strings, through a partial dcp.load); "" where the
    checkpoint has none. Refuses a checkpoint without `key`'s ``params``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be the name the sharded_state_dict() was saved under (e.g. 'optim'), got {key!r}")
    tables = dict.fromkeys(names, "")
    dcp.load({key: tables}, checkpoint_id=checkpoint_id, planner=DefaultLoadPlanner(allow_partial_load=True),
             process_group=process_group)
    if not tables["params"]:
        raise ValueError(f"the checkpoint at {checkpoint_id!r} holds no sharded_state_dict() under {key!r} (no "
                         f"'{key}.params' entry): pass the key it was saved under, e.g. "
                         "dcp.save({'optim': opt.sharded_state_dict()}) -> key='optim'")
    return tables


def json_list(sharded: Mapping, key: str, what: str) -> list:
    value = sharded[key]
    try:
        value = json.loads(value) if isinstance(value, (str, bytes)) else value
    except ValueError:
        raise ValueError(f"sharded[{key!r}] is not the JSON {what} that sharded_state_dict() writes") from None
    if not isinstance(value, list):
        raise ValueError(f"sharded[{key!r}] must hold the {what} as a JSON list, got {type(value).__name__}")
    return value


def check_sharded_state_dict(opt, sharded) -> tuple[list, list]:
    """Everything load_sharded_state_dict checks, writing nothing: (the
    groups' values to set, [(state name, fragment, loaded piece)])."""
    if not isinstance(sharded, Mapping) or any(k not in sharded for k in ("state", "params", "param_groups")):
        got = f"a dict with keys {list(sharded)}" if isinstance(sharded, Mapping) else type(sharded).__name__
        raise ValueError("the sharded state dict must be the dict of a sharded_state_dict() of this optimizer "
                         f"(with 'state', 'params' and 'param_groups'), as filled by dcp.load, got {got}")
    group_values = [check_group_values(where, saved, group, opt.rule)
                     for where, saved, group in matched_groups(opt, json_list(sharded, "param_groups", "parameter groups"))]
    space = _FlatSpace(opt)
    check_tables(opt, space, json_list(sharded, "params", "parameter table"),
                 json_list(sharded, "shapes", "shape table") if "shapes" in sharded else None)
    check_layout_key(sharded, space)
    if not isinstance(sharded["state"], Mapping):
        raise ValueError(f"sharded['state'] must be a dict of DTensors, got {type(sharded['state']).__name__}")
    return group_values, _matched_pieces(opt, sharded["state"], space)


def matched_groups(opt, saved_groups: list) -> list[tuple[str, Mapping, dict]]:
    """(where, saved group, the optimizer's group) for each parameter group,
    once the checkpoint is known to hold as many groups, each a dict listing
    as many parameters as the optimizer's."""
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"the checkpoint has {len(saved_groups)} parameter groups, the optimizer "
                         f"{len(opt.param_groups)}: another model, or groups built another way")
    matched = []
    for gi, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
        where = f"sharded['param_groups'][{gi}]"
        if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), list):
            raise ValueError(f"{where} must be a dict with a 'params' list")
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"{where} lists {len(saved['params'])} parameters, the optimizer's group {gi} has "
                             f"{len(group['params'])}: another model, or groups built another way")
        matched.append((where, saved, group))
    return matched


def check_tables(opt, space: _FlatSpace, saved_params: list, saved_shapes: list | None) -> None:
    """The checkpoint's trainable parameters are the optimizer's: same
    indices, numels, shapes and memory orders (older checkpoints, without a
    shape table: numels). Names the first parameter that differs."""
    head = "the checkpoint's trainable parameters (in param_groups order) differ from the optimizer's"
    tail = "another model, or another choice of frozen parameters: build the model and optimizer as the saved ones"
    if len(saved_params) != len(space.table):
        raise ValueError(f"{head}: the checkpoint has {len(saved_params)} trainable parameters "
                         f"{_brief(saved_params)}, the optimizer {len(space.table)} {_brief(space.table)}: {tail}")
    names = dict(enumerate(param_names(opt.param_groups).values()))  # by index in param_groups order
    rows = saved_shapes if saved_shapes is not None else [None] * len(saved_params)
    if len(rows) != len(saved_params):
        raise ValueError(f"{head}: its shape table lists {len(rows)} parameters, its [index, numel] table "
                         f"{len(saved_params)}: a damaged checkpoint")
    for k, (saved, mine, shape_row, my_row) in enumerate(zip(saved_params, space.table, rows, space.shapes)):
        if not (isinstance(saved, list) and len(saved) == 2):
            raise ValueError(f"{head}: entry {k} of its table is {saved!r}, not [index, numel]")
        index = mine[0]
        if saved[0] != index:
            raise ValueError(f"{head}: its trainable parameter #{k} is the one at index {saved[0]} in "
                             f"param_groups order, the optimizer's is {names.get(index)} (index {index}): {tail}")
        what = f"{head}: {names.get(index)} (index {index})"
        if shape_row is not None:
            if not (isinstance(shape_row, list) and len(shape_row) in (2, 3) and shape_row[0] == saved[0]
                    and isinstance(shape_row[1], list) and all(isinstance(n, int) for n in shape_row[1])):
                raise ValueError(f"{head}: entry {k} of its shape table is {shape_row!r}, not [index, shape]")
            if shape_row[1] != my_row[1]:
                raise ValueError(f"{what} has shape {tuple(shape_row[1])} in the checkpoint, {tuple(my_row[1])} in "
                                 f"the optimizer: {tail}")
            if _outer_first(shape_row) != _outer_first(my_row):
                raise ValueError(f"{what} lies in memory with its dims in the order {_outer_first(shape_row)} in "
                                 f"the checkpoint, {_outer_first(my_row)} in the optimizer (outermost first; e.g. "
                                 f"channels_last): convert the model to the saved memory format before building "
                                 f"the optimizer")
        if saved[1] != mine[1]:
            raise ValueError(f"{what} has {saved[1]} elements in the checkpoint, {mine[1]} in the optimizer: {tail}")


def _brief(table: list) -> str:
    """The first entries of a parameter table, for messages."""
    return f"{table[:4]}{' ...' if len(table) > 4 else ''}"


def _outer_first(row: list) -> tuple:
    """The memory order of a shape-table row, size-1 dims left out."""
    dims = [d for d in range(len(row[1])) if row[1][d] != 1]
    return tuple(row[2]) if len(row) == 3 else tuple(dims)


def check_layout_key(sharded: Mapping, space: _FlatSpace) -> None:
    mine = layout_key(space)
    keys = [k for k in sharded if isinstance(k, str) and k.startswith(LAYOUT_PREFIX)]
    if not keys:
        return  # a structure of an older version (its tables were compared)
    if mine not in keys:
        raise ValueError(f"the sharded state dict's layout key is {keys[0]!r}, this optimizer's {mine!r}: it "
                         f"was made for another model; load into a sharded_state_dict() of this optimizer")
    value = sharded[mine]
    want = [len(space.table), space.total]
    if not isinstance(value, torch.Tensor) or value.device.type == "meta" or value.tolist() != want:
        raise ValueError(f"sharded[{mine!r}] must be the tensor {want} ([trainable parameters, elements]) that "
                         f"sharded_state_dict() holds, got {value!r}")


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
        local = tensor.to_local() if isinstance(tensor, DTensor) else None
        if not isinstance(local, LocalShardsWrapper):
            raise ValueError(f"sharded['state'][{saved!r}] must be the DTensor of a sharded_state_dict() of "
                             f"this optimizer, got {type(tensor).__name__}")
        if tuple(tensor.size()) != (space.total,):
            raise ValueError(f"state '{saved}' covers {tuple(tensor.size())} elements, the optimizer's parameters "
                             f"{space.total}: load into a sharded_state_dict() of this optimizer")
        held = local_pieces(tensor)
        given = [(start, start + t.numel()) for start, t in held]
        if given != mine:
            raise ValueError(_mismatch(saved, space, given, mine))
        for f, (_, t) in zip(space.frags, held):
            check_state_tensor(f"sharded['state'][{saved!r}]'s piece at offset {space.start(f)}", t, (f.numel,))
            pieces.append((name, f, t))
    return pieces


def local_pieces(tensor: DTensor) -> list[tuple[int, torch.Tensor]]:
    """This rank's pieces of a state of sharded_state_dict(), as (offset in
    the flat space, values) in offset order (ragged_pieces)."""
    return [(offset[0], t) for offset, t in ragged_pieces(tensor)]


def ragged_pieces(tensor: DTensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """This rank's pieces of a ragged_dtensor(), as (offsets, values) in
    offset order; the empty placeholder piece of a rank without any is left
    out ([Note: ragged DTensor pieces])."""
    local = tensor.to_local()
    return sorted(((tuple(offset), t) for offset, t in zip(local.local_offsets(), local.local_shards())
                   if t.numel() > 0), key=lambda piece: piece[0])


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
