"""apex's layout of the ranks of ``process_group``: the optimizer state is
sharded over ``distributed_process_group`` and repeated over
``redundant_process_group``.

[Note: redundant replicas] The world is distributed x redundant: each
distributed group is one replica set that holds every shard once, and the
ranks of a redundant group hold the same shard. A gradient is reduced to its
shard within the distributed group, then the replicas of the shard add their
sums over the redundant group, so every rank's shard holds the sum over all
ranks (averaged over all of them with average_grad_sync); the replicas then
step identically, and the parameters are all-gathered within the
distributed group. A norm over the shards is summed over the distributed
group alone: the replicas would count each shard again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class ShardGroups:
    shard: object      # the group the state is sharded over (None: the default group)
    redundant: object  # the group each shard is repeated over, or None
    shard_size: int
    shard_rank: int    # this rank's shard, its rank in ``shard``
    world_size: int    # the ranks of process_group: shard_size x the redundant group's size


def shard_groups(process_group, distributed_process_group, redundant_process_group) -> ShardGroups:
    """The groups of [Note: redundant replicas], checked: ValueError when
    they do not cover process_group (DistributedFusedAdam's and
    DistributedFusedMuon's arguments)."""
    world_size = dist.get_world_size(process_group)
    shard = distributed_process_group if distributed_process_group is not None else process_group
    shard_size = dist.get_world_size(shard)
    redundant_size = dist.get_world_size(redundant_process_group) if redundant_process_group is not None else 1
    if shard_size * redundant_size != world_size:
        raise ValueError(f"distributed_process_group ({shard_size} ranks) x redundant_process_group "
                         f"({redundant_size} ranks) must cover process_group ({world_size} ranks): pass both, "
                         "the ranks sharing a shard as redundant_process_group, or neither")
    return ShardGroups(shard, redundant_process_group, shard_size, dist.get_rank(shard), world_size)
