"""FusedMuon on DTensor parameters sharded by rows (FSDP2's fully_shard, and its HSDP).

[Note: Muon on sharded matrices] Muon's momentum and update are
element-wise, but Newton-Schulz needs whole matrices, and under FSDP2 each
rank holds only a block of rows of each (Shard(0) on a 1-D mesh: rank r
holds torch.chunk's r-th piece of dim 0, possibly empty; ``to_local()`` is
those rows, unpadded). HSDP's placements (Replicate(), Shard(0)) on a 2-D
mesh [replicas, shards] repeat those row blocks in every replica: the rank
at (r, s) holds the s-th piece, as every (r', s) does. A step runs, over the
process group of every rank of the mesh (the mesh itself when 1-D, its
flattened form when 2-D):

1. the momentum pass on the local shards, as for plain tensors: the
   momentum buffer is sharded like its parameter (a DTensor of its
   placements, so get_optimizer_state_dict and DCP reshard it), and the
   Newton-Schulz input of each local row block is written into the local
   buffer, grouped by the rank that owns the matrix;
2. one ``all_to_all_single`` gathers every matrix's row blocks on its owner
   (one collective per step for all matrices, split sizes from the shapes);
   under HSDP each replica sends only the matrices its own ranks own, the
   other replicas' copies of the same rows stay home;
3. each owner orthogonalizes its whole matrices, batched per shape
   ([Note: batched Newton-Schulz] in _newton_schulz.py);
4. one ``all_to_all_single`` returns each row block's orthogonalized rows
   to the local buffer of every rank that holds it (the (r, s) of every
   replica r: the owner sends its s-th blocks once per replica);
5. the update pass on the local shards, with the lr ratio of the full
   matrix shape.

HSDP (R replicas): the owners are spread over every rank of the mesh, not
over one replica's ranks, so each matrix is orthogonalized once per step on
the whole mesh instead of once per replica, and a replica gathers only the
matrices its own ranks own (the gather stays inside the replica). The price
is the return: (R - 1) / R of each rank's rows come from owners in other
replicas (in HSDP's usual layout, other nodes), in ns_dtype, which is less
than the all-reduce of the same rows' gradients that FSDP2 runs between the
replicas every step. Gathering inside each replica alone would keep all
traffic there, at R times the Newton-Schulz work, most of a Muon step (109
of 116 ms on GPT-1.4B's shapes, benchmarks/RESULTS.md). The collectives run
on torch's flattened mesh (DeviceMesh._flatten, as FSDP2 flattens named
dims), built once per mesh and kept by it; it needs the mesh's dims named.

A 3-D parameter (a batch of matrices) sharded on dim 0 holds whole matrices
on every rank: those are orthogonalized where they are, without
communication, in the same batches as the owned matrices of their shape
(under HSDP, in every replica: sharing them would send whole matrices that
otherwise never travel).

Ownership balances Newton-Schulz cost (rows * cols * min(rows, cols) per
matrix): every rank starts with the cost of its local 3-D matrices, and the
2-D matrices go largest first to the least loaded rank of the mesh (ties:
the lower rank, then parameter order). It depends on the shapes and their
order only, so every rank computes the same assignment and the same split
sizes without talking; that needs every rank to step the same parameters,
as FSDP2 gives every rank a gradient (maybe empty) of every parameter.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from . import _dtensor
from ._muon_layout import Batches, Entry
from ._newton_schulz import assign_owners, ns_cost

try:
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard
except ImportError:  # pragma: no cover - a torch built without distributed support
    dist = None


def check_param(where: str, p, muon: bool) -> None:
    """A DTensor parameter FusedMuon steps: in a Muon group, rows sharded
    over a 1-D mesh, or over the second dim of a 2-D mesh with named dims
    and replicated over the first (HSDP); in an AdamW group (element-wise),
    FusedAdam's."""
    if not muon:
        _dtensor.check_param(where, p)
        return
    mesh = p.device_mesh
    if tuple(p.placements) not in ((Shard(0),), (Replicate(), Shard(0))):  # FSDP2's, HSDP's
        raise ValueError(f"{where} is a DTensor laid out as {tuple(p.placements)} over {mesh}: FusedMuon "
                         "orthogonalizes DTensor matrices sharded by rows: Shard(0) on a 1-D mesh (FSDP2's "
                         "fully_shard without shard_placement_fn), or (Replicate(), Shard(0)) on a 2-D mesh (FSDP2's "
                         "HSDP: fully_shard on a (replicate, shard) mesh); redistribute it to one of those, or give "
                         "it to a group with use_muon=False")
    if mesh.ndim == 2 and not mesh.mesh_dim_names:
        raise ValueError(f"{where} is laid out as {tuple(p.placements)} over {mesh}, a 2-D mesh without dim names: "
                         "FusedMuon gathers HSDP's rows over the flattened mesh, which torch builds for named dims "
                         "only; build it with init_device_mesh(..., mesh_dim_names=(\"dp_replicate\", \"dp_shard\"))")
    _dtensor.check_param(where, p)


def mesh_group(mesh):
    """The process group over every rank of a Muon parameter's mesh, in the
    mesh's row-major order ([Note: Muon on sharded matrices])."""
    return mesh.get_group(0) if mesh.ndim == 1 else mesh._flatten().get_group(0)


def row_ranges(n: int, world: int) -> list[tuple[int, int]]:
    """Each rank's [start, end) of a dim of size n sharded as Shard(0)
    (torch.chunk: pieces of ceil(n / world), the last ones short or empty)."""
    piece = -(-n // world)
    return [(min(r * piece, n), min((r + 1) * piece, n)) for r in range(world)]


class ShardedMatrices:
    """The Newton-Schulz inputs and outputs of one mesh's Muon shards, and
    their round trip through the owners ([Note: Muon on sharded matrices]).
    Ranks are those of the mesh's group, row-major: rank g sits in replica
    g // shards and holds row piece g % shards. ``views``: each entry's
    input/output in its local shape (a 2-D entry's in the local buffer, a 3-D
    entry's in a batch); ``owners``: the owner rank of each 2-D entry (by
    index)."""

    def __init__(self, entries: list[Entry], param_groups: list[dict], ns_dtype: torch.dtype, mesh):
        self.group = mesh_group(mesh)
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        shards = mesh.size(mesh.ndim - 1)
        replicas, (replica, shard) = world // shards, divmod(rank, shards)
        device = entries[0].param.device
        keys = [e.batch_key(param_groups) for e in entries]
        order = {k: n for n, k in enumerate(dict.fromkeys(keys))}  # the batch keys by first appearance
        for i, e in enumerate(entries):
            start, end = row_ranges(e.shape[0], shards)[shard]
            if e.param.size(0) != end - start:
                raise ValueError(f"a Muon DTensor parameter of shape {tuple(e.shape)} holds {e.param.size(0)} of "
                                 f"dim 0 on rank {rank}, not torch.chunk's {end - start} (rows {start}:{end}): "
                                 "FusedMuon steps DTensors sharded evenly as Shard(0) (distribute_tensor, "
                                 "fully_shard)")
        whole = [i for i, e in enumerate(entries) if e.param.ndim == 3]
        sharded = sorted((i for i, e in enumerate(entries) if e.param.ndim == 2), key=lambda i: (order[keys[i]], i))
        loads = [0] * world
        for i in whole:
            for g in range(world):
                start, end = row_ranges(entries[i].shape[0], shards)[g % shards]
                loads[g] += (end - start) * ns_cost(entries[i].shape)
        self.owners = dict(zip(sharded, assign_owners([ns_cost(entries[i].shape) for i in sharded], loads)))
        owned: dict[tuple, int] = defaultdict(int)  # this rank's matrices per batch key
        for i in sharded:
            owned[keys[i]] += self.owners[i] == rank
        counts = defaultdict(int, owned)
        for i in whole:
            counts[keys[i]] += entries[i].param.size(0)
        self.batches = Batches(counts, ns_dtype, device)
        # Owned matrices first in each batch, in `sharded` order: the order every sender uses.
        batch_of = {k: self.batches.take(k, n) for k, n in owned.items() if n}
        views = {i: self.batches.take(keys[i], entries[i].param.size(0)).view(entries[i].param.shape) for i in whole}
        # Local buffer: per owner rank, the local rows of the matrices it owns.
        self.local_splits = [0] * world
        self.local = torch.empty(sum(entries[i].param.numel() for i in sharded), dtype=ns_dtype, device=device)
        offset = 0
        for dst in range(world):
            for i in sharded:
                if self.owners[i] == dst:
                    size = entries[i].param.numel()
                    views[i] = self.local[offset:offset + size].view(entries[i].param.shape)
                    offset += size
                    self.local_splits[dst] += size
        # This replica's owners are the ranks [replica * shards, (replica + 1) * shards): a slice of the local buffer.
        self.gather_send_splits = [n if g // shards == replica else 0 for g, n in enumerate(self.local_splits)]
        start = sum(self.local_splits[:replica * shards])
        self.gather_send = self.local[start:start + sum(self.gather_send_splits)]
        # Owned blocks: per shard, its rows of this rank's matrices, a [n, rows, cols] block per batch; one
        # copy per replica, each returned to that replica's ranks (the gather fills this replica's copy).
        piece_splits = [0] * shards
        blocks = []
        for src in range(shards):
            for k, batch in batch_of.items():
                rows, cols = k[0]
                start, end = row_ranges(rows, shards)[src]
                shape = (batch.size(0), end - start, cols)
                blocks.append((shape, batch[:, start:end]))
                piece_splits[src] += shape[0] * shape[1] * cols
        self.owned = torch.empty((replicas, sum(piece_splits)), dtype=ns_dtype, device=device)
        self.return_send_splits = piece_splits * replicas
        self.gather_recv_splits = [piece_splits[g % shards] if g // shards == replica else 0 for g in range(world)]
        self.pieces: list[tuple[torch.Tensor, torch.Tensor]] = []  # (block in every copy, its slot in the batch)
        offset = 0
        for shape, slot in blocks:
            size = shape[0] * shape[1] * shape[2]
            if size:
                self.pieces.append((self.owned[:, offset:offset + size].view((replicas,) + shape), slot))
            offset += size
        self.replica = replica
        self.views = [views[i] for i in range(len(entries))]

    def orthogonalize(self) -> None:
        """Gather, orthogonalize, return ([Note: Muon on sharded matrices])."""
        if self.owners:  # the same on every rank
            dist.all_to_all_single(self.owned[self.replica], self.gather_send, self.gather_recv_splits,
                                   self.gather_send_splits, group=self.group)
            for blocks, slot in self.pieces:
                slot.copy_(blocks[self.replica])
        self.batches.orthogonalize()
        if self.owners:
            for blocks, slot in self.pieces:
                blocks.copy_(slot)  # into every replica's copy
            dist.all_to_all_single(self.local, self.owned.view(-1), self.local_splits, self.return_send_splits,
                                   group=self.group)
