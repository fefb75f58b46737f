"""When GradSync and ParamSync start and wait for buckets, in process: a
real BucketLayout on CPU tensors, no process group, and recording transports
in place of the collectives. Which transport the optimizer's inputs choose,
with stand-ins for the copy-engine peers. The collectives themselves run in
the spawned tests (test_distributed*.py)."""
from __future__ import annotations

import pytest
import torch

from shardadam.distributed._grad_buckets import GradBufferRows, PackedGradBuckets
from shardadam.distributed._rows import BucketRows
from shardadam.distributed._sync import GradSync, ParamSync
from shardadam.distributed._transport import (
    AllGather, BucketReduceScatter, CollectiveAllGather, CollectiveReduceScatter, CopyEngineAllGather,
    CopyEngineReduceScatter, CopyEngineReduceScatterFromGradients, InFlight, choose_all_gather,
    choose_reduce_scatter)
from shardadam.distributed.layout import BucketLayout

# 4 buckets of 256 elements; parameters 1 and 4 span two buckets each:
# bucket 0 = {0, 1}, 1 = {1, 2}, 2 = {3, 4}, 3 = {4, 5}.
NUMELS = (100, 300, 50, 200, 120, 40)
BUCKETS_OF = {0: [0], 1: [0, 1], 2: [1], 3: [2], 4: [2, 3], 5: [3]}


def _layout(world: int = 1) -> BucketLayout:
    layout = BucketLayout(NUMELS, [0] * len(NUMELS), world, 256 * 4 / (1 << 20), {0: 4})
    assert {k: sorted({f.bucket for f in layout.fragments if f.param == k}) for k in BUCKETS_OF} == BUCKETS_OF
    return layout


def _params() -> list:
    return [torch.nn.Parameter(torch.zeros(n)) for n in NUMELS]


class _Work:
    """A work that is already done; its wait() tells its transport."""

    def __init__(self, done):
        self.done = done

    def wait(self) -> bool:
        self.done()
        return True


class RecordingReduceScatter(BucketReduceScatter):
    """The real bucket transport's staging (packed buckets, or the contiguous
    buffer's rows) with a recording collective: it records (bucket, the
    GradSync's round) and writes this rank's piece of the bucket, the sum in
    a world whose other ranks sent zeros."""

    name = "recording reduce-scatter"

    def __init__(self, buckets, world: int = 1, rank: int = 0):
        super().__init__(buckets)
        self.world, self.rank = world, rank
        self.sync = None  # the GradSync driving it, for its round
        self.calls, self.absent, self.waited = [], [], []
        self.in_flight = self.most_in_flight = 0

    def reduce(self, b: int, out: torch.Tensor, absent: list) -> InFlight:
        self.absent.append((b, sorted(f.param for f in absent)))
        return super().reduce(b, out, absent)

    def _reduce(self, out: torch.Tensor, bucket: torch.Tensor, b: int) -> _Work:
        out.copy_(bucket.view(self.world, -1)[self.rank])
        self.calls.append((b, self.sync.round))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return _Work(lambda: self._done(b))

    def _done(self, b: int) -> None:
        self.in_flight -= 1
        self.waited.append(b)


def _grad_sync(params: list, layout: BucketLayout, pipeline_size: int = 2, rank: int = 0, buffer=None, views=None):
    shards = BucketRows.of(torch.zeros(len(layout.buckets), layout.shard_size(0)))
    buckets = (GradBufferRows(params, layout, shards, buffer, views) if buffer is not None
               else PackedGradBuckets(params, layout, shards))
    transport = RecordingReduceScatter(buckets, layout.world_size, rank)
    sync = GradSync(params, layout, shards, None, pipeline_size, transport=transport)
    transport.sync = sync
    return sync, transport


def _grads(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in NUMELS]


def _reduced(layout: BucketLayout, grads: list) -> torch.Tensor:
    """What the shards [buckets, bucket] of a world of 1 hold: each fragment
    of grads (None: zeros) where the layout puts it, zeros elsewhere."""
    want = torch.zeros(len(layout.buckets), layout.bucket_size(0))
    for f in layout.fragments:
        if grads[f.param] is not None:
            want[f.bucket, f.bucket_start:f.bucket_end] = grads[f.param][f.param_start:f.param_end]
    return want


def test_buckets_start_in_bucket_order_whatever_the_arrival_order():
    layout, params = _layout(world=2), _params()
    grads = _grads(0)
    calls = []
    for rank, order in ((0, [5, 4, 3, 2, 1, 0]), (1, [2, 0, 5, 1, 3, 4])):
        sync, transport = _grad_sync(params, layout, rank=rank)
        for k in order:
            sync.pack(k, grads[k])
        sync.finish()
        calls.append(transport.calls)
    assert calls[0] == calls[1] == [(b, 0) for b in range(4)]


def test_a_bucket_starts_as_soon_as_it_is_complete():
    layout, params = _layout(), _params()
    grads = _grads(0)
    sync, transport = _grad_sync(params, layout)
    # Each arrival and the buckets it completes (every earlier one complete too).
    for k, started in ((1, []), (0, [0]), (3, []), (2, [1]), (5, []), (4, [2, 3])):
        before = len(transport.calls)
        sync.pack(k, grads[k])
        assert transport.calls[before:] == [(b, 0) for b in started], f"after parameter {k}"


def test_gradients_that_never_arrive_are_reduced_as_zeros_at_finish():
    layout, params = _layout(), _params()
    grads = _grads(0)
    sync, transport = _grad_sync(params, layout)
    for k in (0, 2, 5):
        sync.pack(k, grads[k])
    assert transport.calls == []
    params[3].grad = grads[3]  # set by hand: finish() hands it over
    sync.finish()
    assert transport.calls == [(b, 0) for b in range(4)]
    assert transport.absent == [(0, [1]), (1, [1]), (2, [4]), (3, [4])]
    arrived = [g if k in (0, 2, 3, 5) else None for k, g in enumerate(grads)]
    assert torch.equal(sync.shards.single, _reduced(layout, arrived))
    assert transport.in_flight == 0


def test_a_second_gradient_starts_round_1_after_flushing_round_0_and_adds_to_it():
    layout, params = _layout(), _params()
    first, second = _grads(0), _grads(1)
    sync, transport = _grad_sync(params, layout)
    for k in (0, 1):  # bucket 0 complete: started in round 0
        sync.pack(k, first[k])
    assert transport.calls == [(0, 0)]
    sync.pack(0, second[0])  # the rest of round 0 flushed (zeros for 2..5), then round 1
    assert transport.calls == [(b, 0) for b in range(4)]
    assert sync.round == 1
    for k in (1, 2, 3, 4, 5):
        sync.pack(k, second[k])
    sync.finish()
    assert transport.calls == [(b, 0) for b in range(4)] + [(b, 1) for b in range(4)]
    round_0 = _reduced(layout, [first[0], first[1], None, None, None, None])
    assert torch.equal(sync.shards.single, round_0 + _reduced(layout, second))
    sync.reset()
    assert sync.round == 0 and transport.in_flight == 0


@pytest.mark.parametrize("pipeline_size", [1, 2, 3])
def test_at_most_pipeline_size_reduce_scatters_stay_in_flight(pipeline_size):
    layout, params = _layout(), _params()
    grads = _grads(0)
    sync, transport = _grad_sync(params, layout, pipeline_size)
    for k in range(len(params)):
        sync.pack(k, grads[k])
        assert transport.in_flight <= pipeline_size
        started = len(transport.calls)
        assert transport.waited == list(range(max(0, started - pipeline_size))), "the oldest are waited for first"
    # Once another starts, the oldest are waited for: at most one more while it starts.
    assert transport.most_in_flight == min(pipeline_size + 1, 4)
    sync.finish()
    assert transport.waited == list(range(4)) and transport.in_flight == 0


def test_the_contiguous_buffer_refuses_a_second_gradient():
    layout, params = _layout(), _params()
    buffer = torch.zeros(len(layout.buckets), layout.bucket_size(0))
    views = [torch.zeros_like(p) for p in params]  # not the buffer's views: copied into its rows
    sync, transport = _grad_sync(params, layout, buffer=buffer, views=views)
    grads = _grads(0)
    sync.pack(0, grads[0])
    with pytest.raises(RuntimeError, match=r"contiguous_grad_buffer=True.*no_sync\(\)"):
        sync.pack(0, grads[0])
    assert transport.calls == []


def test_the_contiguous_buffer_reduces_its_rows_and_copies_in_gradients_that_are_not_its_views():
    layout, params = _layout(), _params()
    buffer = torch.zeros(len(layout.buckets), layout.bucket_size(0))
    views = [torch.zeros(n) for n in NUMELS]  # split parameters: not views
    for f in layout.fragments:
        if f.numel == NUMELS[f.param]:
            views[f.param] = buffer[f.bucket, f.bucket_start:f.bucket_end]
    sync, transport = _grad_sync(params, layout, buffer=buffer, views=views)
    grads = _grads(0)
    for k in range(len(params)):
        if views[k]._base is buffer:
            views[k].copy_(grads[k])  # autograd's accumulation
            sync.pack(k, views[k])
        else:
            sync.pack(k, grads[k])
    sync.finish()
    assert transport.calls == [(b, 0) for b in range(4)]
    assert torch.equal(sync.shards.single, _reduced(layout, grads))


class RecordingAllGather(AllGather):
    """gather(b) recorded; each work's wait recorded by bucket."""

    name = "recording all-gather"

    def __init__(self, temporary_buckets: bool):
        self.temporary_buckets = temporary_buckets
        self.begun = 0
        self.gathered, self.waited = [], []

    def begin(self) -> None:
        self.begun += 1

    def gather(self, b: int) -> InFlight:
        self.gathered.append(b)
        return InFlight(_Work(lambda: self.waited.append(b)))


def _param_sync(params: list, layout: BucketLayout, temporary_buckets: bool = False):
    shards = BucketRows.of(torch.zeros(len(layout.buckets), layout.shard_size(0)))
    transport = RecordingAllGather(temporary_buckets)
    return ParamSync(params, layout, shards, None, None, transport=transport), transport


def test_param_sync_starts_the_last_bucket_first_and_waits_only_for_the_params_asked():
    layout, params = _layout(), _params()
    sync, transport = _param_sync(params, layout)
    sync.start(depth=1)  # no temporary buckets: nothing to bound
    assert transport.begun == 1 and transport.gathered == [3, 2, 1, 0] and transport.waited == []
    sync.wait_for([params[4]])
    assert transport.waited == [2, 3] and set(sync.pending) == {0, 1}
    sync.wait_for([params[4], params[5]])  # already landed: nothing more
    assert transport.waited == [2, 3]
    sync.finish()
    assert sorted(transport.waited) == [0, 1, 2, 3] and not sync.pending


def test_param_sync_bounds_its_temporary_buckets_by_depth():
    layout, params = _layout(), _params()
    sync, transport = _param_sync(params, layout, temporary_buckets=True)
    sync.start(depth=2)
    assert transport.gathered == [3, 2, 1, 0] and transport.waited == [3, 2] and list(sync.pending) == [1, 0]
    sync.finish()
    sync.start()  # no depth: overlap_param_sync, each module waits for its own
    assert transport.waited == [3, 2, 1, 0] and len(sync.pending) == 4


class _GradPeer:
    """A PeerGradReduce stand-in."""
    world, rank = 2, 1
    closed = False

    def close(self) -> None:
        self.closed = True


class _ParamPeer:
    """A PeerParamGather stand-in."""
    closed = False

    def close(self) -> None:
        self.closed = True


def test_the_reduce_scatter_is_chosen_from_the_peer_and_the_buffer():
    layout, params = _layout(world=2), _params()
    shards = BucketRows.of(torch.zeros(len(layout.buckets), layout.shard_size(0)))
    buffer = BucketRows.of(torch.zeros(len(layout.buckets), layout.bucket_size(0)))
    views = [torch.zeros_like(p) for p in params]
    group = object()  # never used to choose

    packed = choose_reduce_scatter(params, layout, shards, group)
    assert type(packed) is CollectiveReduceScatter and type(packed.buckets) is PackedGradBuckets
    assert packed.group is group and packed.rounds
    rows = choose_reduce_scatter(params, layout, shards, group, None, buffer, views)
    assert type(rows) is CollectiveReduceScatter and type(rows.buckets) is GradBufferRows and not rows.rounds

    peer = _GradPeer()
    engines = choose_reduce_scatter(params, layout, shards, group, peer, buffer, views)
    assert type(engines) is CopyEngineReduceScatter and type(engines.buckets) is GradBufferRows
    assert engines.name == "copy-engine reduce-scatter" and not engines.rounds
    direct = choose_reduce_scatter(params, layout, shards, group, peer)
    assert type(direct) is CopyEngineReduceScatterFromGradients and direct.rounds
    assert direct.name == "copy-engine reduce-scatter from gradients"
    sync = GradSync(params, layout, shards, group, 2, peer=peer)
    assert type(sync.transport) is CopyEngineReduceScatterFromGradients
    sync.close()
    assert peer.closed


def test_the_all_gather_is_chosen_from_the_peer_and_the_buffer():
    layout, params = _layout(world=2), _params()
    buffer = BucketRows.of(torch.zeros(len(layout.buckets), layout.bucket_size(0)))
    shards = buffer.columns(slice(0, layout.shard_size(0)))
    group = object()

    temporary = choose_all_gather(params, layout, shards, None, group)
    assert type(temporary) is CollectiveAllGather and temporary.temporary_buckets and temporary.group is group
    in_place = choose_all_gather(params, layout, shards, buffer, group)
    assert type(in_place) is CollectiveAllGather and not in_place.temporary_buckets
    peer = _ParamPeer()
    engines = choose_all_gather(params, layout, shards, buffer, group, peer)
    assert type(engines) is CopyEngineAllGather and not engines.temporary_buckets
    assert engines.name == "copy-engine all-gather"
    sync = ParamSync(params, layout, shards, buffer, group, peer)
    assert type(sync.transport) is CopyEngineAllGather
    sync.close()
    assert peer.closed
