"""shardadam.checkpoint: atomic saves, and loads that refuse damaged files."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import shardadam
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


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_saved_file_mode_follows_the_umask(tmp_path, umask, mode):
    path = tmp_path / "opt.pt"
    previous = os.umask(umask)
    try:
        checkpoint.save(_state(), path)
    finally:
        os.umask(previous)
    assert oct(path.stat().st_mode & 0o777) == oct(mode), "the mode a plain open() would give"
    assert torch.equal(checkpoint.load(path)["state"][0]["exp_avg"], _state()["state"][0]["exp_avg"])


# Peak host memory of one save or load of a 200 MiB state, measured in a fresh
# process: how far its resident set rose above where it stood before the call.
_PAYLOAD = 200 * 2**20
_MEASURE = r"""
import json, sys, torch
from shardadam import checkpoint

def rss(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

def state():
    g = torch.Generator().manual_seed(0)
    return {"state": {i: {"exp_avg": torch.randn(PAYLOAD // 16, generator=g)} for i in range(4)}}

PAYLOAD, what, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if what == "save":
    obj = state()
    before = rss("VmRSS")
    checkpoint.save(obj, path)
    peak = rss("VmHWM") - before
else:
    before = rss("VmRSS")
    obj = checkpoint.load(path)
    peak = rss("VmHWM") - before
    want = state()
    assert all(torch.equal(obj["state"][i]["exp_avg"], want["state"][i]["exp_avg"]) for i in range(4))
print(json.dumps({"peak": peak}))
"""


def _peak_rise(what: str, path) -> float:
    """The rise of peak resident memory during checkpoint.<what>, in payloads."""
    package_root = os.path.dirname(os.path.dirname(shardadam.__file__))  # this shardadam, also in the child
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(_PAYLOAD), what, str(path)], env=env,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])["peak"] / _PAYLOAD


_LINUX_ONLY = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads peak memory from /proc")


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """A 200 MiB checkpoint, and how far its save raised peak memory."""
    path = tmp_path_factory.mktemp("big") / "big.pt"
    return path, _peak_rise("save", path)


@_LINUX_ONLY
def test_save_holds_no_copy_of_the_payload(big_checkpoint):
    """torch.save's output streams into the file, hashed on the way."""
    path, rise = big_checkpoint
    assert path.stat().st_size > _PAYLOAD
    assert rise < 0.25, f"save raised peak memory by {rise:.2f} payloads"


@_LINUX_ONLY
def test_load_holds_only_the_loaded_tensors(big_checkpoint):
    """The hash is checked in a streaming pass and torch.load reads the file
    into the tensors: about 1 payload at the peak (2 with the payload held)."""
    rise = _peak_rise("load", big_checkpoint[0])
    assert rise < 1.3, f"load raised peak memory by {rise:.2f} payloads"
