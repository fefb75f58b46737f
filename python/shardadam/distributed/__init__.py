"""ZeRO-2 sharding for shardadam: the bucket layout (which bucket and which rank
holds each parameter element), the engine built on it (ShardedOptimizer) and
its optimizers."""
from .adam import DistributedFusedAdam
from .layout import Bucket, BucketLayout, Fragment, ShardFragment
from .lion import DistributedFusedLion
from .muon import DistributedFusedMuon
from .optimizer import ShardedOptimizer
from ._rows import BucketRows

__all__ = ["Bucket", "BucketLayout", "BucketRows", "DistributedFusedAdam", "DistributedFusedLion", "DistributedFusedMuon", "Fragment",
           "ShardFragment", "ShardedOptimizer"]
