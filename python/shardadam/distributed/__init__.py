"""ZeRO-2 sharding for shardadam: the bucket layout (which bucket and which rank
holds each parameter element), and later the DistributedFusedAdam optimizer built on it."""
from .layout import Bucket, BucketLayout, Fragment, ShardFragment

__all__ = ["Bucket", "BucketLayout", "Fragment", "ShardFragment"]
