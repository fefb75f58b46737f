"""The ZeRO-2 bucket layout (cpp/bucket_layout.cpp via shardadam.distributed).

Property tests draw random parameter lists, world sizes, capacities and dtype
keys and check the layout's invariants with vectorised numpy; example tests pin
down splits across many buckets, exact fits, W=1 and every validation error.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardadam import _core
from shardadam.distributed import Bucket, BucketLayout, Fragment, ShardFragment

MIB = 1 << 20


def cap_mb(nbytes: int) -> float:
    """bucket_cap_mb that the wrapper turns back into exactly nbytes."""
    return nbytes / MIB


def expected_shard_size(cap_bytes: int, world: int, elem: int, alignment: int, need: int | None = None) -> int:
    """need: elements the key's parameters take with aligned starts; a bucket
    never gets bigger than that (None: no such limit)."""
    align = alignment // elem
    cap = -(-cap_bytes // elem)
    if need is not None:
        cap = max(1, min(cap, need))
    per_rank = -(-cap // world)
    return -(-per_rank // align) * align


def aligned_need(numels, keys, key: int, elem: int, alignment: int) -> int:
    align = alignment // elem
    return sum(-(-n // align) * align for n, k in zip(numels, keys) if k == key)


def reference_layout(numels, keys, world, cap_bytes, elem_sizes, alignment):
    """The packing rule written out plainly: (buckets, fragments) as tuples."""
    buckets, frags, last, count = [], [], {}, {}
    for i, (n, k) in enumerate(zip(numels, keys)):
        need = aligned_need(numels, keys, k, elem_sizes[k], alignment)
        size = expected_shard_size(cap_bytes, world, elem_sizes[k], alignment, need) * world
        align = alignment // elem_sizes[k]
        done = 0
        while done < n:
            start = -(-buckets[last[k]][2] // align) * align if k in last else size
            if start >= size:
                last[k] = len(buckets)
                buckets.append([k, count.get(k, 0), 0])
                count[k] = count.get(k, 0) + 1
                start = 0
            length = min(n - done, size - start)
            frags.append((i, done, done + length, last[k], start))
            buckets[last[k]][2] = start + length
            done += length
    return [tuple(b) for b in buckets], frags


# ---------------------------------------------------------------- strategies

@st.composite
def layouts(draw):
    world = draw(st.one_of(st.sampled_from([1, 2, 3, 4, 8]), st.integers(1, 64)))
    key_ids = draw(st.lists(st.integers(-3, 20), min_size=1, max_size=3, unique=True))
    elem_sizes = {k: draw(st.sampled_from([2, 4])) for k in key_ids}
    alignment = draw(st.sampled_from([128, 128, 128, 4, 8, 16, 64, 256]))
    cap_bytes = draw(st.one_of(st.integers(1, 512), st.integers(1, 1 << 16), st.integers(1, 1 << 23)))
    numels, keys = [], []
    for _ in range(draw(st.integers(0, 50))):
        k = draw(st.sampled_from(key_ids))
        shard = expected_shard_size(cap_bytes, world, elem_sizes[k], alignment)
        size = shard * world
        align = alignment // elem_sizes[k]
        # Bounded by 16 buckets so that the number of fragments (and the test) stays small.
        top = min(10**6, 16 * size)
        exact = [m for m in (size, 2 * size, 3 * size, size - align, size + 1, shard, shard - 1, align)
                 if 0 <= m <= 10**6]
        n = draw(st.one_of(st.integers(0, 8), st.integers(0, 300), st.integers(0, top), st.sampled_from(exact)))
        numels.append(n)
        keys.append(k)
    return numels, keys, world, cap_bytes, elem_sizes, alignment


# ---------------------------------------------------------------- checks

def sort_by(*cols):
    return np.lexsort(cols[::-1])  # first column is the primary key


def check_tiles_params(param, start, end, numels):
    """Pieces (sorted by param, start) cover each parameter [0, numel) exactly once."""
    assert np.all(end > start)
    first = np.ones(len(param), bool)
    first[1:] = param[1:] != param[:-1]
    last = np.ones(len(param), bool)
    last[:-1] = param[1:] != param[:-1]
    prev_end = np.zeros(len(param), np.int64)
    prev_end[1:] = end[:-1]
    assert np.array_equal(start, np.where(first, 0, prev_end)), "gap or overlap within a parameter"
    assert np.array_equal(end[last], numels[param[last]]), "a parameter is not covered to its end"
    covered = np.unique(param)
    assert np.array_equal(covered, np.flatnonzero(numels > 0)), "zero-size params have pieces, or a param has none"


def check_disjoint(bucket, start, end):
    """Ranges (sorted by bucket, start) never overlap within a bucket."""
    same = bucket[1:] == bucket[:-1]
    assert np.all(~same | (start[1:] >= end[:-1])), "two pieces overlap in a bucket"


def check_layout(numels, keys, world, cap_bytes, elem_sizes, alignment):
    layout = BucketLayout(numels, keys, world, cap_mb(cap_bytes), elem_sizes, alignment)
    numels_a = np.asarray(numels, np.int64).reshape(-1)
    keys_a = np.asarray(keys, np.int64).reshape(-1)
    shard = {k: expected_shard_size(cap_bytes, world, e, alignment, aligned_need(numels, keys, k, e, alignment))
             for k, e in elem_sizes.items()}
    for k in elem_sizes:
        assert layout.shard_size(k) == shard[k]
        assert layout.bucket_size(k) == shard[k] * world

    # The exact packing rule: aligned starts, tight packing, splits at offset 0.
    ref_buckets, ref_frags = reference_layout(numels, keys, world, cap_bytes, elem_sizes, alignment)
    assert layout.buckets == ref_buckets
    assert layout.fragments == ref_frags
    assert layout.fragments_by_bucket == [[f for f in ref_frags if f[3] == b] for b in range(len(ref_buckets))]

    B = np.asarray(layout.buckets, np.int64).reshape(-1, 3)
    F = np.asarray(layout.fragments, np.int64).reshape(-1, 5)
    b_key, b_index, b_used = B.T
    f_param, f_ps, f_pe, f_b, f_bs = F.T
    f_be = f_bs + (f_pe - f_ps)
    b_shard = np.array([shard[k] for k in b_key.tolist()], np.int64)
    b_align = np.array([alignment // elem_sizes[k] for k in b_key.tolist()], np.int64)

    # Buckets: numbered per key in creation order; none is empty.
    for k in elem_sizes:
        assert np.array_equal(b_index[b_key == k], np.arange(np.count_nonzero(b_key == k)))
    assert len(B) == 0 or np.array_equal(np.unique(f_b), np.arange(len(B)))

    # Fragments: one key per bucket, inside the bucket, aligned, disjoint.
    assert np.array_equal(b_key[f_b], keys_a[f_param]), "a bucket holds two keys"
    assert np.all(f_be <= b_shard[f_b] * world), "a fragment crosses its bucket's end"
    assert np.all(f_bs % b_align[f_b] == 0), "a fragment starts unaligned"
    high = np.zeros(len(B), np.int64)
    np.maximum.at(high, f_b, f_be)
    assert np.array_equal(high, b_used)
    o = sort_by(f_param, f_ps)
    check_tiles_params(f_param[o], f_ps[o], f_pe[o], numels_a)
    o = sort_by(f_b, f_bs)
    check_disjoint(f_b[o], f_bs[o], f_be[o])

    # Shards: every element lands in exactly one rank's shard, at the position
    # its fragment puts it, within [0, shard_size).
    per_rank = []
    for r in range(world):
        S = np.asarray(layout.shard_fragments(r), np.int64).reshape(-1, 5)
        assert np.all(np.diff(S[:, 0] * (numels_a.max(initial=0) + 1) + S[:, 1]) > 0), "not in fragment order"
        per_rank.append(np.column_stack([S, np.full(len(S), r, np.int64)]))
    S = np.concatenate(per_rank) if per_rank else np.zeros((0, 6), np.int64)
    s_param, s_ps, s_pe, s_b, s_ss, s_rank = S.T
    s_len = s_pe - s_ps
    assert np.all(s_ss >= 0) and np.all(s_ss + s_len <= b_shard[s_b]), "a shard fragment leaves its shard"
    assert int(s_len.sum()) == int(numels_a.sum())
    o = sort_by(s_param, s_ps)
    check_tiles_params(s_param[o], s_ps[o], s_pe[o], numels_a)
    pos = s_rank * b_shard[s_b] + s_ss  # bucket coordinates
    o = sort_by(s_b, pos)
    check_disjoint(s_b[o], pos[o], pos[o] + s_len[o])
    # The fragment that holds each shard piece maps it to the same bucket position.
    scale = numels_a.max(initial=0) + 1
    fo = sort_by(f_param, f_ps)
    f_keys = f_param[fo] * scale + f_ps[fo]
    hit = fo[np.searchsorted(f_keys, s_param * scale + s_ps, side="right") - 1] if len(S) else np.zeros(0, int)
    assert np.array_equal(f_param[hit], s_param)
    assert np.all(s_pe <= f_pe[hit])
    assert np.array_equal(f_b[hit], s_b)
    assert np.array_equal(f_bs[hit] + (s_ps - f_ps[hit]), pos)
    return layout


# ---------------------------------------------------------------- property tests

@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_layout_properties(case):
    check_layout(*case)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 10**6), max_size=50), st.integers(1, 64), st.integers(1, 1 << 24))
def test_world_size_only_changes_shards(numels, world, cap_bytes):
    """With W ranks and capacity C, the layout equals W=1 with shard size W*shard
    (smaller when the whole model fits in one bucket: the fragments stay the same)."""
    many = BucketLayout(numels, [0] * len(numels), world, cap_mb(cap_bytes), {0: 4})
    size = many.bucket_size(0)
    one = BucketLayout(numels, [0] * len(numels), 1, cap_mb(4 * size), {0: 4})
    assert one.bucket_size(0) == size or (one.bucket_size(0) < size and len(many.buckets) <= 1)
    assert one.fragments == many.fragments


def test_model_smaller_than_a_bucket_gets_a_bucket_of_its_size():
    # 100 MiB capacity, 3 fp32 params of 10, 200 and 5 elements, alignment 32
    # elements: 32 + 224 + 32 = 288 needed; 2 shards of 144 rounded up to 160.
    layout = BucketLayout([10, 200, 5], [0, 0, 0], 2, 100.0, {0: 4})
    assert layout.bucket_size(0) == 320
    assert [b.used for b in layout.buckets] == [32 + 224 + 5]


# ---------------------------------------------------------------- examples

def test_param_larger_than_several_buckets():
    # fp32, W=4, 512 bytes: shard 32, bucket 128 elements, alignment 32.
    layout = check_layout([10, 1000, 5], [0, 0, 0], 4, 512, {0: 4}, 128)
    assert layout.bucket_size(0) == 128
    assert layout.fragments[:3] == [
        Fragment(0, 0, 10, 0, 0),
        Fragment(1, 0, 96, 0, 32),      # aligned after param 0, fills bucket 0
        Fragment(1, 96, 224, 1, 0),     # continues at offset 0 of the next bucket
    ]
    assert layout.fragments[-2:] == [Fragment(1, 992, 1000, 8, 0), Fragment(2, 0, 5, 8, 32)]
    assert len(layout.buckets) == 9 and layout.buckets[-1] == Bucket(0, 8, 37)
    assert all(f.numel == 128 and f.bucket_end == 128 for f in layout.fragments[2:9])
    r1 = layout.shard_fragments(1)
    assert r1[0] == ShardFragment(1, 0, 32, 0, 0)  # bucket 0, elements [32, 64)
    assert r1[1] == ShardFragment(1, 128, 160, 1, 0)
    assert all(isinstance(f, ShardFragment) and f.shard_end <= 32 for f in r1)
    assert sum(f.numel for r in range(4) for f in layout.shard_fragments(r)) == 1015


def test_exact_fits():
    # bf16, W=2, 256 bytes: shard 64, bucket 128 elements, alignment 64.
    layout = check_layout([128, 128, 64, 64, 63, 1, 65, 1], [0] * 8, 2, 256, {0: 2}, 128)
    got = [tuple(f) for f in layout.fragments]
    assert got == [
        (0, 0, 128, 0, 0),
        (1, 0, 128, 1, 0),
        (2, 0, 64, 2, 0),
        (3, 0, 64, 2, 64),
        (4, 0, 63, 3, 0),
        (5, 0, 1, 3, 64),
        (6, 0, 65, 4, 0),
        (7, 0, 1, 5, 0),    # aligned start after 65 is 128 = bucket end: a new bucket
    ]
    assert [b.used for b in layout.buckets] == [128, 128, 128, 65, 65, 1]


def test_world_size_one():
    layout = check_layout([7, 0, 300, 33], [0, 0, 0, 0], 1, 1000, {0: 4}, 128)
    assert layout.shard_size(0) == layout.bucket_size(0) == 256
    assert [tuple(f) for f in layout.shard_fragments(0)] == [tuple(f) for f in layout.fragments]


def test_keys_never_share_a_bucket():
    # Bucket 0 of key 0 has room, yet the key-1 param opens its own bucket
    # (apex's bucket lookup could put it into bucket 0).
    layout = check_layout([10, 10, 10, 10], [0, 1, 0, 1], 2, 1 << 12, {0: 4, 1: 2}, 128)
    assert layout.buckets == [Bucket(0, 0, 42), Bucket(1, 0, 74)]
    assert [(f.param, f.bucket, f.bucket_start) for f in layout.fragments] == [
        (0, 0, 0), (1, 1, 0), (2, 0, 32), (3, 1, 64)]


def test_zero_size_params_and_tiny_capacity():
    layout = check_layout([0, 0, 5, 0], [3, 3, 3, 3], 8, 1, {3: 4}, 128)
    assert layout.shard_size(3) == 32  # one aligned unit per rank, never an empty shard
    assert layout.fragments == [Fragment(2, 0, 5, 0, 0)]
    assert layout.shard_fragments(1) == []
    empty = BucketLayout([], [], 3, 1.0, {})
    assert empty.buckets == [] and empty.fragments == [] and empty.shard_fragments(2) == []


def test_elem_sizes_as_sequence_and_offsets_past_2_32():
    n = 3 * (1 << 31) + 5
    layout = BucketLayout([n, 1], [1, 1], 8, 2048.0, [4, 2])  # key 1 -> 2 bytes
    size = layout.bucket_size(1)
    assert size == (1 << 30) and layout.total_numel == n + 1
    assert [tuple(f) for f in layout.fragments] == [
        (0, k * size, min(n, (k + 1) * size), k, 0) for k in range(7)] + [(1, 0, 1, 6, 64)]
    # Rank 7 owns nothing of the 5 + 1 elements in bucket 6: its last piece is in bucket 5.
    assert layout.shard_fragments(7)[-1] == ShardFragment(0, 5 * size + 7 * (1 << 27), 6 * size, 5, 0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=0), r"world_size must be at least 1, got 0"),
    (dict(bucket_cap_bytes=0), r"bucket_cap_bytes must be positive, got 0"),
    (dict(alignment=96), r"alignment must be a power of two \(bytes\), got 96"),
    (dict(alignment=0), r"alignment must be a power of two"),
    (dict(alignment=2), r"alignment \(2 bytes\) must be a multiple of elem_sizes\[0\] = 4"),
    (dict(elem_sizes={0: 0}), r"elem_sizes\[0\] must be positive, got 0"),
    (dict(numels=[4, -1]), r"numels\[1\] is negative \(-1\)"),
    (dict(keys=[0, 9]), r"keys\[1\] = 9 has no entry in elem_sizes"),
    (dict(keys=[0]), r"keys has 1 entries but numels has 2"),
    (dict(numels=[(1 << 63) - 1], keys=[0], bucket_cap_bytes=(1 << 63) - 1, world_size=3, elem_sizes={0: 1}),
     r"bucket_cap_bytes is too large"),
])
def test_validation_errors(kwargs, match):
    args = dict(numels=[4, 5], keys=[0, 0], world_size=2, bucket_cap_bytes=1024, elem_sizes={0: 4},
                alignment=128)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        _core.BucketLayout(**args)


def test_wrapper_validation_errors():
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be positive and finite, got 0"):
        BucketLayout([1], [0], 1, 0, {0: 4})
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be positive and finite, got nan"):
        BucketLayout([1], [0], 1, math.nan, {0: 4})
    with pytest.raises(ValueError, match=r"world_size must be at least 1"):
        BucketLayout([1], [0], 0, 1.0, {0: 4})
    layout = BucketLayout([1], [0], 4, 1.0, {0: 4})
    with pytest.raises(ValueError, match=r"rank 4 is outside \[0, world_size=4\)"):
        layout.shard_fragments(4)
    with pytest.raises(ValueError, match=r"rank -1 is outside"):
        layout.shard_fragments(-1)
    with pytest.raises(ValueError, match=r"key 5 has no entry in elem_sizes"):
        layout.shard_size(5)
