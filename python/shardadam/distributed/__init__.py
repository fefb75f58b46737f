"""ZeRO-2 sharding for shardadam: the bucket layout (which bucket and which rank
holds each parameter element) and the DistributedFusedAdam optimizer built on it."""
from .layout import Bucket, BucketLayout, Fragment, ShardFragment
from .optimizer import DistributedFusedAdam

__all__ = ["Bucket", "BucketLayout", "DistributedFusedAdam", "Fragment", "ShardFragment"]
