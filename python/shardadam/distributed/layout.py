"""The ZeRO-2 bucket layout, computed by the compiled core (``_core.BucketLayout``).

Parameters are flattened and packed, in the order given, into buckets of one
dtype-group key each. Every bucket of a key has ``bucket_size(key) =
shard_size(key) * world_size`` elements and rank r owns elements
``[r * shard_size, (r + 1) * shard_size)`` of it. Every parameter starts on an
``alignment``-byte boundary; a parameter that does not fit in the rest of a
bucket continues at offset 0 of the next one(s) of its key. All offsets are in
elements. The layout depends only on the arguments, so every rank computes the
same one without communicating.
"""
from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

from .. import _core

__all__ = ["Bucket", "BucketLayout", "Fragment", "ShardFragment"]


class Bucket(NamedTuple):
    key: int    # dtype-group key of every parameter in the bucket
    index: int  # position among the buckets of this key
    used: int   # high-water mark: every fragment lies in [0, used), padding included


class Fragment(NamedTuple):
    """The part ``[param_start, param_end)`` of a flattened parameter that lies in one bucket."""

    param: int
    param_start: int
    param_end: int
    bucket: int
    bucket_start: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start

    @property
    def bucket_end(self) -> int:
        return self.bucket_start + self.param_end - self.param_start


class ShardFragment(NamedTuple):
    """The part of a fragment that one rank owns; ``shard_start`` is within that rank's shard."""

    param: int
    param_start: int
    param_end: int
    bucket: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start

    @property
    def shard_end(self) -> int:
        return self.shard_start + self.param_end - self.param_start


class BucketLayout:
    """Buckets, fragments and per-rank shard fragments of an ordered parameter list.

    numels: elements of each parameter (>= 0), in packing order.
    keys: dtype-group key (an int) of each parameter; parameters of different
        keys never share a bucket.
    world_size: ranks sharing each bucket (>= 1).
    bucket_cap_mb: target bucket size in MiB of the key's element type; the
        real size is rounded up so each shard is a whole number of alignment units.
    elem_sizes: bytes per element, as ``{key: size}`` or a sequence indexed by key.
    alignment: bytes, a power of two and a multiple of every element size.

    Invalid arguments raise ValueError naming the argument.
    """

    def __init__(self, numels: Sequence[int], keys: Sequence[int], world_size: int,
                 bucket_cap_mb: float, elem_sizes: Mapping[int, int] | Sequence[int],
                 alignment: int = 128):
        if not (bucket_cap_mb > 0 and math.isfinite(bucket_cap_mb)):
            raise ValueError(f"bucket_cap_mb must be positive and finite, got {bucket_cap_mb}")
        if not isinstance(elem_sizes, Mapping):
            elem_sizes = dict(enumerate(elem_sizes))
        # MiB as in torch DDP and apex; ceil so a few bytes still give one element.
        cap_bytes = max(1, math.ceil(bucket_cap_mb * (1 << 20)))
        self._core = _core.BucketLayout(list(numels), list(keys), world_size, cap_bytes,
                                        dict(elem_sizes), alignment)
        self.buckets: list[Bucket] = [Bucket._make(b) for b in self._core.buckets()]
        self.fragments: list[Fragment] = [Fragment._make(f) for f in self._core.fragments()]
        self.fragments_by_bucket: list[list[Fragment]] = [[] for _ in self.buckets]
        for f in self.fragments:
            self.fragments_by_bucket[f.bucket].append(f)

    @property
    def world_size(self) -> int:
        return self._core.world_size

    @property
    def alignment(self) -> int:
        return self._core.alignment

    @property
    def num_params(self) -> int:
        return self._core.num_params

    @property
    def total_numel(self) -> int:
        return self._core.total_numel

    def shard_size(self, key: int) -> int:
        """Elements each rank owns in every bucket of ``key``."""
        return self._core.shard_size(key)

    def bucket_size(self, key: int) -> int:
        """Elements of every bucket of ``key``: ``shard_size(key) * world_size``."""
        return self._core.bucket_size(key)

    def bucket_shard_size(self, bucket: int) -> int:
        """Shard size of a bucket, by its global index."""
        return self._core.shard_size(self.buckets[bucket].key)

    def shard_fragments(self, rank: int) -> list[ShardFragment]:
        """The non-empty pieces of every fragment that ``rank`` owns, in fragment order."""
        return [ShardFragment._make(f) for f in self._core.shard_fragments(rank)]

    def __repr__(self) -> str:
        return (f"BucketLayout(params={self.num_params}, numel={self.total_numel}, "
                f"buckets={len(self.buckets)}, world_size={self.world_size}, "
                f"alignment={self.alignment})")
