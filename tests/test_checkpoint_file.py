"""shardadam.checkpoint: atomic saves, and loads that refuse damaged files."""
from __future__ import annotations

import os

import pytest
import torch

from shardadam import checkpoint


def _state():
    g = torch.Generator().manual_seed(0)
    return {"state": {0: {"exp_avg": torch.randn(1000, generator=g)}}, "param_groups": [{"lr": 1e-3, "params": [0]}]}


def test_round_trip(tmp_path):
    path = tmp_path / "opt.pt"
    checkpoint.save(_state(), path)
    loaded = checkpoint.load(path)
    assert torch.equal(loaded["state"][0]["exp_avg"], _state()["state"][0]["exp_avg"])
    assert loaded["param_groups"] == _state()["param_groups"]
    assert os.listdir(tmp_path) == ["opt.pt"], "no temporary file left behind"


@pytest.mark.parametrize("damage, match", [
    (lambda b: b[:-100], "truncated"),
    (lambda b: b + b"x", "trailing bytes"),
    (lambda b: b[:-50] + bytes([b[-50] ^ 1]) + b[-49:], "SHA-256"),
    (lambda b: b[:20], "truncated inside the header"),
    (lambda b: b"PK" + b[2:], "not a shardadam checkpoint"),
])
def test_damaged_files_raise(tmp_path, damage, match):
    path = tmp_path / "opt.pt"
    checkpoint.save(_state(), path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(checkpoint.CheckpointError, match=match):
        checkpoint.load(path)


def test_failed_save_keeps_the_previous_file(tmp_path):
    path = tmp_path / "opt.pt"
    checkpoint.save(_state(), path)
    before = path.read_bytes()

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        checkpoint.save({"bad": Unpicklable()}, path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["opt.pt"]


def test_crash_before_the_rename_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "opt.pt"
    checkpoint.save(_state(), path)
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(checkpoint.os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        checkpoint.save({"other": torch.zeros(3)}, path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["opt.pt"], "the temporary file is removed"
