"""shardadam.checkpoint: atomic saves, and loads that refuse damaged files.

Saves under faults: a full disk (injected, and the kernel's own ENOSPC from
/dev/full) raises an OSError naming the path, keeps the previous file and
leaves no temporary file; the temporary file of a save killed by SIGKILL is
removed by the next save to that path, that of a save still running is not.
A re-saved file keeps its permission bits, and a symlink's target is written
(the link stays).
"""
from __future__ import annotations

import errno
import io
import json
import os
import signal
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


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _loads_as(path, state) -> bool:
    return _same(checkpoint.load(path), state)


def _child_env() -> dict:
    package_root = os.path.dirname(os.path.dirname(shardadam.__file__))  # this shardadam, also in the child
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))


def _temp_files(directory, name="opt.pt") -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(f".{name}.shardadam-tmp-"))


# ---------------------------------------------------------------- a full disk

def _disk_fills_after(limit: int):
    """An os.fdopen whose file object refuses, with ENOSPC, any write that
    would take it past `limit` bytes (the temporary file is the only file
    save() opens with os.fdopen)."""
    injected = []

    class FillsUp(io.BufferedWriter):
        written = 0

        def write(self, data):
            n = memoryview(data).nbytes
            if self.written + n > limit:
                injected.append(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
                raise injected[-1]
            self.written += n
            return super().write(data)

    def fdopen(fd, mode="r", *args, **kwargs):
        assert mode == "wb"
        return FillsUp(io.FileIO(fd, "w"))

    return fdopen, injected


@pytest.mark.parametrize("when", ["header", "payload", "final header"])
def test_disk_full_raises_an_oserror_and_keeps_the_previous_file(tmp_path, monkeypatch, when):
    """The disk fills up before, while and after torch.save writes: always an
    OSError with errno ENOSPC that says so and names the path (not torch's
    RuntimeError), the previous file untouched, no temporary file left."""
    path = tmp_path / "opt.pt"
    state = {"w": torch.arange(1 << 18, dtype=torch.float32)}  # 1 MiB
    checkpoint.save(state, path)
    size = path.stat().st_size
    # What save() writes: magic and empty header, the payload, then the header again.
    limit = {"header": 10, "payload": size // 2, "final header": size}[when]
    fdopen, injected = _disk_fills_after(limit)
    monkeypatch.setattr(os, "fdopen", fdopen)
    with pytest.raises(OSError) as raised:
        checkpoint.save({"w": torch.zeros(1 << 18)}, path)
    monkeypatch.undo()
    error = raised.value
    assert error.errno == errno.ENOSPC
    assert "the disk is full" in str(error) and f"writing checkpoint {path} failed" in str(error), str(error)
    assert error.__cause__ is injected[0], "chained to the OSError the write raised"
    assert os.listdir(tmp_path) == ["opt.pt"], "the temporary file is removed"
    assert _loads_as(path, state), "the previous file is intact"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_disk_full_from_the_kernel(tmp_path, monkeypatch):
    """The temporary file's descriptor is pointed at /dev/full, where every
    write(2) fails with ENOSPC: the error the kernel gives on a full disk,
    through the real buffered file and torch.save."""
    path = tmp_path / "opt.pt"
    real_fdopen = os.fdopen
    opened = []

    def onto_dev_full(fd, *args, **kwargs):
        full = os.open("/dev/full", os.O_WRONLY)
        try:
            os.dup2(full, fd)
        finally:
            os.close(full)
        opened.append(fd)
        return real_fdopen(fd, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", onto_dev_full)
    # No previous file here: its mode would be applied to the descriptor, which is /dev/full.
    with pytest.raises(OSError) as raised:
        checkpoint.save({"w": torch.zeros(1 << 20)}, path)
    monkeypatch.undo()
    assert len(opened) == 1
    assert raised.value.errno == errno.ENOSPC
    assert "the disk is full" in str(raised.value) and str(path) in str(raised.value), str(raised.value)
    assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == [], "no temporary file, and no file at the path"


# ---------------------------------------------------------------- a killed save

_KILLED_MID_SAVE = r"""
import os, signal, sys, torch
from shardadam import checkpoint

# The first background sync (after 1 MiB of the 16 MiB payload) kills the process.
checkpoint._SYNC_EVERY = 1 << 20
checkpoint._datasync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
checkpoint.save({"w": torch.ones(4 << 20)}, sys.argv[1])
"""


def test_next_save_removes_the_temporary_file_of_a_killed_save(tmp_path):
    path = tmp_path / "opt.pt"
    state = _state()
    checkpoint.save(state, path)
    child = subprocess.run([sys.executable, "-c", _KILLED_MID_SAVE, str(path)], env=_child_env(),
                           capture_output=True, text=True, check=False)
    assert child.returncode == -signal.SIGKILL, child.stderr
    left = _temp_files(tmp_path)
    assert len(left) == 1, os.listdir(tmp_path)
    assert os.path.getsize(tmp_path / left[0]) >= 1 << 20, "killed in the middle of writing"
    assert _loads_as(path, state), "the killed save left the previous file intact"

    checkpoint.save({"w": torch.arange(5.0)}, path)
    assert os.listdir(tmp_path) == ["opt.pt"], "the leftover is removed"
    assert _loads_as(path, {"w": torch.arange(5.0)})


_PAUSED_MID_SAVE = r"""
import os, sys, torch
from shardadam import checkpoint

# The first background sync (after 1 MiB) says so and waits for a line on stdin.
checkpoint._SYNC_EVERY = 1 << 20
sync = checkpoint._datasync
def pause(fd):
    print(os.getpid(), flush=True)
    sys.stdin.readline()
    sync(fd)
checkpoint._datasync = pause
checkpoint.save({"w": torch.full((4 << 20,), 2.0)}, sys.argv[1])
"""


def test_the_temporary_file_of_a_running_save_is_kept(tmp_path):
    """Two processes save to one path: the second leaves the first one's
    temporary file alone, and the last rename wins."""
    path = tmp_path / "opt.pt"
    child = subprocess.Popen([sys.executable, "-c", _PAUSED_MID_SAVE, str(path)], env=_child_env(),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid = child.stdout.readline().strip()  # the child is now inside its save
        assert pid == str(child.pid), "the child did not reach its save"
        left = _temp_files(tmp_path)
        assert len(left) == 1 and f"-{pid}-" in left[0], left
        checkpoint.save(_state(), path)
        assert _temp_files(tmp_path) == left, "the running save's temporary file is kept"
        assert _loads_as(path, _state())
    finally:
        child.stdin.close()  # lets it finish
        child.wait()
    assert child.returncode == 0
    assert os.listdir(tmp_path) == ["opt.pt"]
    assert _loads_as(path, {"w": torch.full((4 << 20,), 2.0)})


def test_only_leftovers_of_the_same_target_from_this_host_are_removed(tmp_path):
    gone = 1 << 22  # above any pid (Linux's pid_max is at most 2**22, macOS's under 10**5)
    mine = checkpoint._temp_prefix("opt.pt")
    names = {"leftover": f"{mine}{gone}-{'0' * 16}",
             "other target": f"{checkpoint._temp_prefix('other.pt')}{gone}-{'1' * 16}",
             "other host": f".opt.pt.shardadam-tmp-elsewhere.invalid-{gone}-{'2' * 16}",
             "live writer": f"{mine}{os.getpid()}-{'3' * 16}",
             "not a temporary file": f"{mine}{gone}-notrandom"}
    for name in names.values():
        (tmp_path / name).write_bytes(b"partial")
    checkpoint.save(_state(), tmp_path / "opt.pt")
    assert sorted(os.listdir(tmp_path)) == sorted(["opt.pt"] + [n for k, n in names.items() if k != "leftover"])


# ---------------------------------------------------------------- mode and symlinks

@pytest.mark.parametrize("umask, mode", [(0o022, 0o600), (0o022, 0o640), (0o077, 0o640), (0o022, 0o666),
                                         (0o002, 0o604)], ids=lambda m: f"{m:04o}")
def test_resaved_file_keeps_its_mode(tmp_path, monkeypatch, umask, mode):
    path = tmp_path / "opt.pt"
    checkpoint.save(_state(), path)
    os.chmod(path, mode)
    created = []
    real_open = os.open

    def recording_open(file, flags, *args, **kwargs):
        if "shardadam-tmp" in os.fspath(file):
            created.append(args[0] if args else kwargs["mode"])
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    previous = os.umask(umask)
    try:
        checkpoint.save({"w": torch.arange(3.0)}, path)
    finally:
        os.umask(previous)
    monkeypatch.undo()
    assert oct(path.stat().st_mode & 0o777) == oct(mode)
    assert len(created) == 1 and created[0] & ~mode == 0, \
        "the temporary file is never created with more permissions than the file it replaces"
    assert _loads_as(path, {"w": torch.arange(3.0)})


def test_saving_through_a_symlink_writes_its_target(tmp_path, monkeypatch):
    """The link stays a link; its target (in another directory) is replaced by
    a rename inside that directory, and keeps its mode."""
    (tmp_path / "real").mkdir()
    (tmp_path / "links").mkdir()
    target, link = tmp_path / "real" / "opt.pt", tmp_path / "links" / "opt.pt"
    link.symlink_to(os.path.join("..", "real", "opt.pt"))
    checkpoint.save(_state(), link)
    assert link.is_symlink() and _loads_as(target, _state())
    os.chmod(target, 0o600)

    renamed = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (renamed.append((src, dst)), real_replace(src, dst))[1])
    checkpoint.save({"w": torch.arange(4.0)}, link)
    monkeypatch.undo()
    real = os.path.realpath(target)
    assert [(os.path.dirname(src), dst) for src, dst in renamed] == [(os.path.dirname(real), real)]
    assert link.is_symlink() and os.readlink(link) == os.path.join("..", "real", "opt.pt")
    assert _loads_as(link, {"w": torch.arange(4.0)}) and _loads_as(target, {"w": torch.arange(4.0)})
    assert oct(target.stat().st_mode & 0o777) == oct(0o600)
    assert os.listdir(tmp_path / "real") == ["opt.pt"] and os.listdir(tmp_path / "links") == ["opt.pt"]


def test_saving_through_a_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "opt.pt"
    link.symlink_to("step-1000.pt")
    checkpoint.save(_state(), link)
    assert link.is_symlink() and os.readlink(link) == "step-1000.pt"
    assert sorted(os.listdir(tmp_path)) == ["opt.pt", "step-1000.pt"]
    assert _loads_as(tmp_path / "step-1000.pt", _state())


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
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(_PAYLOAD), what, str(path)], env=_child_env(),
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
