"""The fast checkpoint paths give the same results as the straightforward ones.

- state_dict(gather_on_root=True) gathers to rank 0 alone (also with
  redundant replicas: only the distributed group holding rank 0 gathers) and
  builds the same dict as state_dict() on every rank; the tensors are laid out
  like their parameters (channels_last kept) and every element is written.
- The sharded format is one DTensor per state over the flat index space
  of the trainable parameters (no collective to build): its pieces
  are exactly the portable state at their offsets, and a structure of another
  model is refused before anything is written.
- checkpoint.save/load with many chunks: hashing beside the writes and reads,
  background syncs (one each time the length passes a multiple of
  _SYNC_EVERY, however slow the disk: a sync still running is waited for),
  damage in the middle of a large payload still detected; the window over the
  file that torch.load reads through.
"""
from __future__ import annotations

import hashlib
import io
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardadam
from conftest import assert_bits_equal
from shardadam import checkpoint
from shardadam.distributed import sharded_checkpoint
from test_distributed import _exit, _frozen, _groups, _model, _rank_group, _spawn, _train, _two_by_two

# DCP takes the DTensor pieces without the deprecation warnings of ShardedTensor.
pytestmark = [pytest.mark.filterwarnings("error::FutureWarning"), pytest.mark.filterwarnings("error::DeprecationWarning")]


def _flat_np(t: torch.Tensor) -> np.ndarray:
    """t's values in memory order (channels_last included), as numpy."""
    return t.detach().as_strided((t.numel(),), (1,), t.storage_offset()).cpu().numpy().copy()


def _gather_worker(rank: int, world: int, port: int, redundant: bool, out) -> None:
    with _rank_group(rank, world, port, out):
        model = _model()
        frozen = _frozen(model)
        frozen.requires_grad_(False)
        groups = _two_by_two(rank) if redundant else {}
        opt = shardadam.DistributedFusedAdam(_groups(model, frozen), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-4,
                                             **groups)
        _train(model, opt, rank, world, range(3))
        everyone = opt.state_dict()
        on_root = opt.state_dict(gather_on_root=True)
        params = [p for g in opt.param_groups for p in g["params"]]
        layout_kept = all(everyone["state"][i][name].stride() == params[i].stride()
                          for i in everyone["state"] for name in everyone["state"][i])
        # This rank's sharded pieces, at their offsets in the flat space, equal the portable state.
        pieces_match = True
        if not redundant:
            sharded = opt.sharded_state_dict()
            table = json.loads(sharded["params"])
            offsets, total = {}, 0
            for index, numel in table:
                offsets[index] = (total, numel)
                total += numel
            for name, tensor in sharded["state"].items():
                for start, piece in sharded_checkpoint.local_pieces(tensor):
                    size = piece.numel()
                    index = next(i for i, (o, n) in offsets.items() if o <= start < o + n)
                    o, _ = offsets[index]
                    whole = _flat_np(everyone["state"][index][name])
                    pieces_match &= bool(np.array_equal(whole[start - o:start - o + size],
                                                        piece.cpu().numpy()))
        result = dict(root_is_none=on_root is None, layout_kept=layout_kept, pieces_match=pieces_match,
                      everyone={i: {k: _flat_np(v) for k, v in e.items()} for i, e in everyone["state"].items()},
                      on_root=None if on_root is None else
                      {i: {k: _flat_np(v) for k, v in e.items()} for i, e in on_root["state"].items()},
                      groups=everyone["param_groups"],
                      root_groups=None if on_root is None else on_root["param_groups"])
        results = [None] * world
        dist.all_gather_object(results, {k: result[k] for k in ("root_is_none", "layout_kept", "pieces_match")})
        if rank == 0:
            out.put(dict(result, ranks=results))
    _exit()


@pytest.mark.parametrize("world,redundant", [(3, False), (4, True)], ids=["3-ranks", "redundant-2x2"])
def test_gather_on_root_equals_the_every_rank_dict(world, redundant):
    result = _spawn(_gather_worker, world, redundant)
    assert [r["root_is_none"] for r in result["ranks"]] == [False] + [True] * (world - 1)
    assert all(r["layout_kept"] for r in result["ranks"]), "state tensors are laid out like their parameters"
    assert all(r["pieces_match"] for r in result["ranks"]), "sharded pieces differ from the portable state"
    assert result["root_groups"] == result["groups"]
    assert result["on_root"].keys() == result["everyone"].keys()
    for i, entry in result["everyone"].items():
        for name, value in entry.items():
            assert np.array_equal(result["on_root"][i][name].view(np.int32), value.view(np.int32)), f"{i} {name}"


# ---------------------------------------------------------------- one rank in this process



def _optimizer(bucket_cap_mb: float = 1e-4, width: int = 8, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, width), nn.Tanh(), nn.Linear(width, 3))
    opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=bucket_cap_mb,
                                         overlap_grad_sync=False, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(model(torch.randn(8, 12, generator=g)), torch.randn(8, 3, generator=g)).backward()
        opt.step()
    return model, opt


def test_one_dtensor_per_state(one_rank):
    """One 1-D DTensor per state (Shard(0) over the optimizer's group), not
    per parameter and state, covering every trainable element once."""
    from torch.distributed.tensor import DTensor, Shard
    _, opt = _optimizer(amsgrad=True)
    sharded = opt.sharded_state_dict()
    total = sum(p.numel() for p in opt.params)
    assert sorted(sharded["state"]) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "param"]
    for tensor in sharded["state"].values():
        assert isinstance(tensor, DTensor) and tensor.placements == (Shard(0),) and tensor.shape == (total,)
        ranges = [(start, piece.numel()) for start, piece in sharded_checkpoint.local_pieces(tensor)]
        assert len(ranges) > 1, "buckets of 1e-4 MB: several pieces on one rank"
        covered = 0
        for start, size in ranges:  # one rank: the pieces tile the space
            assert start == covered
            covered += size
        assert covered == total
    in_groups = [q for g in opt.param_groups for q in g["params"]]
    assert json.loads(sharded["params"]) == [[i, p.numel()] for i, p in enumerate(in_groups)]


def test_sharded_state_of_another_model_is_refused_before_writing(one_rank, tmp_path):
    _, small = _optimizer(width=8)
    import torch.distributed.checkpoint as dcp
    dcp.save({"optim": small.sharded_state_dict()}, checkpoint_id=str(tmp_path))
    _, wide = _optimizer(width=16)
    template = {"optim": wide.sharded_state_dict()}
    before = {n: t.clone() for n, t in _held(wide).items()}
    steps = [g["step"] for g in wide.param_groups]
    # DCP refuses the other total size while planning, before it reads anything.
    from torch.distributed.checkpoint.api import CheckpointException
    with pytest.raises(CheckpointException, match="Size mismatch"):
        dcp.load(template, checkpoint_id=str(tmp_path))
    # A structure of another model handed over directly: refused by the parameter table.
    other = small.sharded_state_dict()
    with pytest.raises(ValueError, match="trainable parameters"):
        wide.load_sharded_state_dict(other)
    assert [g["step"] for g in wide.param_groups] == steps
    for name, value in _held(wide).items():
        assert_bits_equal(value, before[name], name)


def _held(opt) -> dict:
    """The tensors that hold a DistributedFusedAdam's state (the parameter
    shards hold the fp32 master by default)."""
    held = {"param_shards": opt.param_shards.single, "exp_avg": opt.states["exp_avg"],
            "exp_avg_sq": opt.states["exp_avg_sq"]}
    return held if opt.master is None else dict(held, master=opt.master)


def test_store_params_false_pieces_are_copies(one_rank):
    """store_params=False with fp32 parameters: the master is the parameter
    shard itself, and its pieces are copies of it (whole rows, one per
    bucket), so dcp.load filling them changes nothing until
    load_sharded_state_dict checks and writes them."""
    _, opt = _optimizer(store_params=False)
    before = opt.param_shards.single.clone()
    sharded = opt.sharded_state_dict()
    for _, piece in sharded_checkpoint.local_pieces(sharded["state"]["param"]):
        piece.fill_(123.0)
    assert_bits_equal(opt.param_shards.single, before, "param_shards")


# ---------------------------------------------------------------- checkpoint files

def _payload_state(n_tensors: int = 24, numel: int = 75_000):
    g = torch.Generator().manual_seed(0)
    return {"state": {i: {"exp_avg": torch.randn(numel, generator=g)} for i in range(n_tensors)}}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 256 KiB: a 7 MB payload (written in chunks of 300 KB at most)
    then takes many reads, hashes and background syncs."""
    monkeypatch.setattr(checkpoint, "_PARALLEL_MIN", 1 << 12)
    monkeypatch.setattr(checkpoint, "_SYNC_EVERY", 1 << 20)
    monkeypatch.setattr(checkpoint, "_READ_CHUNK", 1 << 18)
    syncs = []
    sync = checkpoint._datasync
    monkeypatch.setattr(checkpoint, "_datasync", lambda fd: (syncs.append(fd), sync(fd)))
    return syncs


def test_many_chunks_round_trip(tmp_path, small_chunks):
    path = tmp_path / "big.pt"
    checkpoint.save(_payload_state(), path)
    payload = path.stat().st_size - len(checkpoint._MAGIC) - checkpoint._HEADER.size
    # No write is as long as _SYNC_EVERY, so each multiple passed is passed by a write of its own.
    assert len(small_chunks) == payload // checkpoint._SYNC_EVERY == 6, "one background sync per MiB written"
    loaded = checkpoint.load(path)
    for i, entry in _payload_state()["state"].items():
        assert torch.equal(loaded["state"][i]["exp_avg"], entry["exp_avg"])


@pytest.mark.parametrize("where", [0.1, 0.5, 0.97])
def test_damage_inside_a_large_payload_is_found(tmp_path, small_chunks, where):
    path = tmp_path / "big.pt"
    checkpoint.save(_payload_state(), path)
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="SHA-256"):
        checkpoint.load(path)


class _WatchedFile(io.BytesIO):
    """A file for _HashingWriter that another thread can wait on: `changed`
    is notified after each write."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = threading.Condition()
        self.written = 0

    def write(self, data) -> int:
        with self.changed:
            n = super().write(data)
            self.written += n
            self.changed.notify_all()
        return n

    def fileno(self) -> int:
        return -1  # _datasync is replaced in these tests


@pytest.fixture
def syncs_every_mib(monkeypatch):
    monkeypatch.setattr(checkpoint, "_SYNC_EVERY", 1 << 20)
    return lambda datasync: monkeypatch.setattr(checkpoint, "_datasync", datasync)


def test_syncs_follow_the_bytes_written(syncs_every_mib):
    """A sync each time the length passes a multiple of _SYNC_EVERY, one for
    several multiples passed by one write."""
    synced = []
    syncs_every_mib(synced.append)
    data = bytes(range(256)) * (21 << 10)  # 5.25 MiB
    f, after_each = _WatchedFile(), []
    with ThreadPoolExecutor(1) as pool:
        writer = checkpoint._HashingWriter(f, pool)
        begin = 0
        for mib in [0.5, 0.5, 3.5, 0.25, 0.25, 0.25]:  # lengths 0.5, 1, 4.5, 4.75, 5, 5.25 MiB
            end = begin + int(mib * 2**20)
            assert writer.write(data[begin:end]) == end - begin
            begin = end
            writer.finish()  # any sync this write started has run
            after_each.append(len(synced))
    assert after_each == [0, 1, 2, 2, 3, 3]
    assert f.getvalue() == data and writer.length == len(data)
    assert writer.sha256.digest() == hashlib.sha256(data).digest()


def test_a_sync_still_running_is_waited_for(syncs_every_mib):
    """On a busy machine the previous background sync may still run when the
    next multiple of _SYNC_EVERY is passed. Here the first sync returns only
    once the writer has passed the second multiple: the writer then waits for
    it and starts the second one, so the number of syncs does not depend on
    how fast they are, and they never overlap."""
    f, events = _WatchedFile(), []

    def slow_first_sync(fd):
        events.append("start")
        if len(events) == 1:
            with f.changed:
                # The timeout only turns a hang into a failure: the writer passes 2 MiB without waiting.
                passed = f.changed.wait_for(lambda: f.written >= 2 << 20, timeout=600)
            events.append("second multiple passed" if passed else "the writer stopped")
        events.append("end")

    syncs_every_mib(slow_first_sync)
    with ThreadPoolExecutor(1) as pool:
        writer = checkpoint._HashingWriter(f, pool)
        for _ in range(10):
            writer.write(bytes(256 << 10))  # 2.5 MiB in all: multiples passed at the 4th and 8th write
        writer.finish()
    assert events == ["start", "second multiple passed", "end", "start", "end"]


def test_file_window_reads_like_bytesio(tmp_path):
    """torch.load reads the payload through a window over the checkpoint file
    (past its header): it must behave as a file holding the payload alone."""
    data = bytes(range(256)) * 40
    path = tmp_path / "window.bin"
    path.write_bytes(b"header--" + data + b"trailer")
    with open(path, "rb", buffering=0) as f:
        ours, ref = checkpoint._FileWindow(f, 8, len(data), path), io.BytesIO(data)
        for op in [("seek", 100), ("read", 17), ("tell",), ("seek", -5, io.SEEK_END), ("read", 100), ("tell",),
                   ("seek", 10, io.SEEK_SET), ("seek", 7, io.SEEK_CUR), ("read", 3), ("read", -1), ("read", 5)]:
            assert getattr(ours, op[0])(*op[1:]) == getattr(ref, op[0])(*op[1:]), op
        buf = bytearray(64)
        ours.seek(1000), ref.seek(1000)
        assert ours.readinto(buf) == 64 and bytes(buf) == ref.read(64)
        ours.close()
