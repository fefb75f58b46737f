"""FusedMuon on DTensor parameters sharded by rows (FSDP2's fully_shard).

[Note: Muon on sharded matrices] Muon's momentum and update are
element-wise, but Newton-Schulz needs whole matrices, and under FSDP2 each
rank holds only a block of rows of each (Shard(0) on a 1-D mesh: rank r
holds torch.chunk's r-th piece of dim 0, possibly empty; ``to_local()`` is
those rows, unpadded). A step runs:

1. the momentum pass on the local shards, as for plain tensors: the
   momentum buffer is sharded like its parameter (a DTensor of its
   placements, so get_optimizer_state_dict and DCP reshard it), and the
   Newton-Schulz input of each local row block is written into a send
   buffer, grouped by the rank that owns the matrix;
2. one ``all_to_all_single`` gathers every matrix's row blocks on its owner
   (one collective per step for all matrices, split sizes from the shapes);
3. each owner orthogonalizes its whole matrices, batched per shape
   ([Note: batched Newton-Schulz] in _newton_schulz.py);
4. the reverse ``all_to_all_single`` returns each row block's orthogonalized
   rows to the send buffer it came from;
5. the update pass on the local shards, with the lr ratio of the full
   matrix shape.

A 3-D parameter (a batch of matrices) sharded on dim 0 holds whole matrices
on every rank: those are orthogonalized where they are, without
communication, in the same batches as the owned matrices of their shape.

Ownership balances Newton-Schulz cost (rows * cols * min(rows, cols) per
matrix): every rank starts with the cost of its local 3-D matrices, and the
2-D matrices go largest first to the least loaded rank (ties: the lower
rank, then parameter order). It depends on the shapes and their order only,
so every rank computes the same assignment and the same split sizes without
talking; that needs every rank to step the same parameters, as FSDP2 gives
every rank a gradient (maybe empty) of every parameter.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from . import _dtensor
from ._muon_layout import Batches, Entry
from ._newton_schulz import assign_owners, ns_cost

try:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard
except ImportError:  # pragma: no cover - a torch built without distributed support
    dist = None


def check_param(where: str, p, muon: bool) -> None:
    """A DTensor parameter FusedMuon steps: in a Muon group, rows sharded
    over a 1-D mesh; in an AdamW group (element-wise), FusedAdam's."""
    if not muon:
        _dtensor.check_param(where, p)
        return
    if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
        raise ValueError(f"{where} is a DTensor laid out as {tuple(p.placements)} over {p.device_mesh}: FusedMuon "
                         "orthogonalizes DTensor matrices sharded by rows, Shard(0) on a 1-D mesh (FSDP2's "
                         "fully_shard without shard_placement_fn); redistribute it to [Shard(0)], or give it to a "
                         "group with use_muon=False")
    _dtensor.check_param(where, p)


def row_ranges(n: int, world: int) -> list[tuple[int, int]]:
    """Each rank's [start, end) of a dim of size n sharded as Shard(0)
    (torch.chunk: pieces of ceil(n / world), the last ones short or empty)."""
    piece = -(-n // world)
    return [(min(r * piece, n), min((r + 1) * piece, n)) for r in range(world)]


class ShardedMatrices:
    """The Newton-Schulz inputs and outputs of one mesh's Muon shards, and
    their round trip through the owners ([Note: Muon on sharded matrices]).
    ``views``: each entry's input/output in its local shape (a 2-D entry's
    in the send buffer, a 3-D entry's in a batch); ``owners``: the owner rank
    of each 2-D entry (by index)."""

    def __init__(self, entries: list[Entry], param_groups: list[dict], ns_dtype: torch.dtype, mesh):
        self.group = mesh.get_group(0)
        world, rank = mesh.size(), mesh.get_local_rank()
        device = entries[0].param.device
        keys = [e.batch_key(param_groups) for e in entries]
        order = {k: n for n, k in enumerate(dict.fromkeys(keys))}  # the batch keys by first appearance
        for i, e in enumerate(entries):
            start, end = row_ranges(e.shape[0], world)[rank]
            if e.param.size(0) != end - start:
                raise ValueError(f"a Muon DTensor parameter of shape {tuple(e.shape)} holds {e.param.size(0)} of "
                                 f"dim 0 on rank {rank}, not torch.chunk's {end - start} (rows {start}:{end}): "
                                 "FusedMuon steps DTensors sharded evenly as Shard(0) (distribute_tensor, "
                                 "fully_shard)")
        whole = [i for i, e in enumerate(entries) if e.param.ndim == 3]
        sharded = sorted((i for i, e in enumerate(entries) if e.param.ndim == 2), key=lambda i: (order[keys[i]], i))
        loads = [0] * world
        for i in whole:
            for r, (start, end) in enumerate(row_ranges(entries[i].shape[0], world)):
                loads[r] += (end - start) * ns_cost(entries[i].shape)
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
        # Send buffer: per destination rank, the local rows of the matrices it owns.
        self.send_splits = [0] * world
        self.send = torch.empty(sum(entries[i].param.numel() for i in sharded), dtype=ns_dtype, device=device)
        offset = 0
        for dst in range(world):
            for i in sharded:
                if self.owners[i] == dst:
                    size = entries[i].param.numel()
                    views[i] = self.send[offset:offset + size].view(entries[i].param.shape)
                    offset += size
                    self.send_splits[dst] += size
        # Receive buffer: per source rank, its rows of this rank's matrices, a [n, rows, cols] block per batch.
        self.recv_splits = [0] * world
        self.pieces: list[tuple[torch.Tensor, torch.Tensor]] = []  # (received block, its slot in the batch)
        blocks = []
        for src in range(world):
            for k, batch in batch_of.items():
                rows, cols = k[0]
                start, end = row_ranges(rows, world)[src]
                shape = (batch.size(0), end - start, cols)
                blocks.append((shape, batch[:, start:end]))
                self.recv_splits[src] += shape[0] * shape[1] * cols
        self.recv = torch.empty(sum(self.recv_splits), dtype=ns_dtype, device=device)
        offset = 0
        for shape, slot in blocks:
            size = shape[0] * shape[1] * shape[2]
            if size:
                self.pieces.append((self.recv[offset:offset + size].view(shape), slot))
            offset += size
        self.views = [views[i] for i in range(len(entries))]

    def orthogonalize(self) -> None:
        """Gather, orthogonalize, return ([Note: Muon on sharded matrices])."""
        if self.owners:  # the same on every rank
            dist.all_to_all_single(self.recv, self.send, self.recv_splits, self.send_splits, group=self.group)
            for block, slot in self.pieces:
                slot.copy_(block)
        self.batches.orthogonalize()
        if self.owners:
            for block, slot in self.pieces:
                block.copy_(slot)
            dist.all_to_all_single(self.send, self.recv, self.send_splits, self.recv_splits, group=self.group)
