"""Where a gradient waits for its bucket's reduce-scatter, for the transports
that reduce whole buckets (_transport.py): a temporary bucket it is packed
into, or its row of the contiguous gradient buffer, where autograd already
put it."""
from __future__ import annotations

import torch

from ._flat import FlatGrads


class _GradBuckets:
    """Gradients copied into their buckets' rows [bucket] as they arrive.
    rounds: as ReduceScatter.rounds (_transport.py)."""

    rounds = True

    def __init__(self, params: list, layout, shards):
        """shards: BucketRows (_rows.py), in the buckets' gradient dtypes."""
        self.flat = FlatGrads(params, shards.device)
        frags_of_param = [[] for _ in params]
        for f in layout.fragments:
            frags_of_param[f.param].append(f)
        # Per parameter: (bucket, start, end, the part of the flat gradient or
        # None for all of it), plain tuples for the per-gradient host time.
        self.spans = [[(f.bucket, f.bucket_start, f.bucket_end,
                        None if f.numel == p.numel() else slice(f.param_start, f.param_end))
                       for f in frags] for p, frags in zip(params, frags_of_param)]

    def new_round(self) -> None:
        """Forget what was staged (a new round, or a new iteration)."""

    def stage(self, k: int, grad: torch.Tensor) -> None:
        """Copy parameter k's gradient into its buckets."""
        flat = self.flat(k, grad)
        for b, start, end, piece in self.spans[k]:
            self._row(b)[start:end].copy_(flat if piece is None else flat[piece])

    def take(self, b: int, absent: list) -> torch.Tensor:
        """Bucket b, ready to reduce, and let go of here: its reduce-scatter
        holds it until done. absent: its fragments whose gradients never came."""
        raise NotImplementedError

    def _row(self, b: int) -> torch.Tensor:
        raise NotImplementedError


class PackedGradBuckets(_GradBuckets):
    """Temporary buckets, each in its shard's dtype, allocated when its first
    gradient arrives and let go once taken."""

    def __init__(self, params: list, layout, shards):
        super().__init__(params, layout, shards)
        self.bucket_size = layout.bucket_size(0)  # every key's ([Note: sync classes] in _rows.py)
        self.dtypes, self.device = [row.dtype for row in shards.rows], shards.device
        # What no fragment covers, zeroed per bucket.
        self.gaps = [gaps([(f.bucket_start, f.bucket_end) for f in frags], self.bucket_size, shards.device)
                     for frags in layout.fragments_by_bucket]
        self.new_round()

    def new_round(self) -> None:
        self.buffers = [None] * len(self.gaps)

    def take(self, b: int, absent: list) -> torch.Tensor:
        """Bucket b, with zeros where gradients never came."""
        bucket = self._row(b)
        for f in absent:
            bucket[f.bucket_start:f.bucket_end].zero_()
        self.buffers[b] = None
        return bucket

    def _row(self, b: int) -> torch.Tensor:
        if self.buffers[b] is None:
            # Fragments are overwritten by their gradients: only the alignment
            # padding between them and the tail need zeros (writing the whole
            # bucket would add a bucket's worth of memory traffic to backward).
            buffer = torch.empty(self.bucket_size, dtype=self.dtypes[b], device=self.device)
            between, tail = self.gaps[b]
            if between is not None:
                buffer.index_fill_(0, between, 0)
            if tail < self.bucket_size:
                buffer[tail:].zero_()
            self.buffers[b] = buffer
        return self.buffers[b]


class GradBufferRows(_GradBuckets):
    """The contiguous gradient buffer [buckets, bucket] that autograd
    accumulates into through views (one per parameter), reduce-scattered row
    by row in place. A gradient that is not its view (model.zero_grad()
    dropped it, say) is copied into the row; one that never came is whatever
    the row holds.

    A second gradient in one iteration cannot start a new round: autograd has
    already added it into the buffer, possibly into a bucket being reduced."""

    rounds = False

    def __init__(self, params: list, layout, shards, buffer, views: list):
        super().__init__(params, layout, shards)
        self.buffer = buffer
        self.views = views

    def stage(self, k: int, grad: torch.Tensor) -> None:
        view = self.views[k]
        if grad.data_ptr() != view.data_ptr() or grad.stride() != view.stride():
            super().stage(k, grad)

    def take(self, b: int, absent: list) -> torch.Tensor:
        return self.buffer[b]

    def _row(self, b: int) -> torch.Tensor:
        return self.buffer[b]


def gaps(spans: list, size: int, device) -> tuple[torch.Tensor | None, int]:
    """What no span (start, end) of [0, size) covers: the positions between
    spans (alignment padding: a device index, or None) and where the tail begins."""
    between, end = [], 0
    for start, stop in sorted(spans):
        between.extend(range(end, start))
        end = stop
    index = torch.tensor(between, dtype=torch.int64, device=device) if between else None
    return index, end
