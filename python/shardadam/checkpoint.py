"""Checkpoint files that cannot be half-written or silently corrupt.

save(obj, path): torch.save streams the payload into a temporary file in the
same directory, after a header with the payload's length and SHA-256 (hashed
on the way, filled in at the end); the file is flushed to disk and renamed
over `path`. A crash at any point leaves either the previous file or the new
one, never a mix.
- A failed write (a full disk, ENOSPC, or any other OSError) raises an
  OSError with the same errno that names `path` and the cause, not the
  RuntimeError torch.save makes of it; the temporary file is removed and the
  previous file kept.
- A save that is killed (SIGKILL, power loss) leaves its temporary file
  behind. Temporary files are named `.<name>.shardadam-tmp-<host>-<pid>-<random>`,
  so the next save to the same path finds those of its target and removes the
  ones whose writer process is gone; a writer on another host (a shared file
  system), or still running, keeps its file (as does a dead writer whose pid
  another process has taken since, until that one ends too).
- Over an existing file, the new file gets that file's permission bits; a new
  file gets 0666 less the umask, as open() would give.
- A symlink is followed: its target (also a dangling link's) gets the new
  content, and the temporary file goes in the target's directory so the
  rename stays atomic there; the link stays as it is.

load(path): reads the header, checks the length, hashes the payload in a
first streaming pass and only then hands it to torch.load, which reads it a
second time from the same open file (from the page cache, usually) straight
into the tensors' storages; a truncated, padded or altered file raises
CheckpointError naming what is wrong. Only the loaded tensors and two read
buffers are in memory. (A writer changing the file in place between the two
passes would go unnoticed; save() never does: it writes a new file and
renames it.)

Speed: hashing (SHA-256, one core) runs in a second thread, side by side with
the file writes of a save and the file reads of a load, and a save starts
the disk writes as it goes (a background fdatasync each time another
_SYNC_EVERY bytes are written, one at a time) rather than leaving them all
to the final fsync.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import re
import secrets
import socket
import stat
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["CheckpointError", "load", "save"]

_MAGIC = b"SHARDADAM-CKPT-1\n"
_HEADER = struct.Struct("<Q32s")  # payload length, SHA-256 of the payload


class CheckpointError(RuntimeError):
    """The file is not a complete shardadam checkpoint."""


# Chunks smaller than this are hashed inline: a hand-over to the hashing
# thread costs more than hashing them.
_PARALLEL_MIN = 1 << 20
# A save asks the kernel to write what it has so far to disk every this many
# bytes (in the background), so that the final fsync has little left to wait for.
_SYNC_EVERY = 256 << 20
# A load hashes the payload in pieces of this size, one read while the other is hashed.
_READ_CHUNK = 16 << 20


class _HashingWriter:
    """What torch.save writes to: each chunk goes on to the file and into the
    digest, so the serialised payload is never held in memory whole. Large
    chunks are hashed in another thread while this one writes them (both
    release the GIL); each time the length passes a multiple of _SYNC_EVERY a
    background fdatasync starts writing the file's dirty pages to disk.

    torch.save turns an exception raised here into a RuntimeError of its own
    ("inline_container ... unexpected pos"), so the first OSError is kept in
    `error` for save() to report."""

    def __init__(self, f, pool: ThreadPoolExecutor) -> None:
        self._f = f
        self._pool = pool
        self.sha256 = hashlib.sha256()
        self.length = 0
        self.error: OSError | None = None
        self._next_sync = _SYNC_EVERY
        self._sync: threading.Thread | None = None

    def write(self, chunk) -> int:
        try:
            return self._write(chunk)
        except OSError as e:
            if self.error is None:
                self.error = e
            raise

    def _write(self, chunk) -> int:
        n = memoryview(chunk).nbytes
        if n < _PARALLEL_MIN:
            self.sha256.update(chunk)
            written = self._f.write(chunk)
        else:
            hashed = self._pool.submit(self.sha256.update, chunk)
            try:
                written = self._f.write(chunk)
            finally:
                hashed.result()  # chunk is only valid during this call
        self.length += n
        if self.length >= self._next_sync:
            # The syncs depend on the bytes written alone, never on how fast
            # the disk is. If the previous one still runs, the disk is more
            # than _SYNC_EVERY behind: waiting for it holds the writes to the
            # disk's pace, which the final fsync would wait for anyway (same
            # save times measured, 6 GiB on an H200 host's disk).
            self._next_sync = (self.length // _SYNC_EVERY + 1) * _SYNC_EVERY
            self._f.flush()
            self.finish()
            self._sync = threading.Thread(target=_datasync, args=(self._f.fileno(),), daemon=True)
            self._sync.start()
        return written

    def flush(self) -> None:
        self._f.flush()

    def finish(self) -> None:
        """Wait for the background sync (before the next one, and before the
        final fsync and close)."""
        if self._sync is not None:
            self._sync.join()
            self._sync = None


def _datasync(fd: int) -> None:
    try:
        getattr(os, "fdatasync", os.fsync)(fd)  # macOS has no fdatasync
    except OSError:  # the final fsync reports any failure; this one only starts the writes early
        pass


def save(obj, path: str | os.PathLike) -> None:
    target = os.path.realpath(path)  # through a symlink: the link stays, its target is replaced
    directory, name = os.path.split(target)
    prefix = _temp_prefix(name)
    _remove_leftovers(directory, prefix)  # first: on a full disk they may be what takes the room
    tmp = os.path.join(directory, f"{prefix}{os.getpid()}-{secrets.token_hex(8)}")
    try:
        mode = _existing_mode(target)
        # O_EXCL: never write through someone else's file or link. A new file
        # gets 0666 less the umask, as a plain open() would give (mkstemp's is
        # always 0600); a replaced file's mode is asked for here already, so
        # that the temporary file is never readable by more than the old one.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
    except OSError as e:
        raise _save_failed(path, target, e) from e
    payload = None
    try:
        with os.fdopen(fd, "wb") as f, ThreadPoolExecutor(1, thread_name_prefix="checkpoint-sha256") as pool:
            if mode is not None:
                os.fchmod(f.fileno(), mode)  # the umask may have taken bits off
            f.write(_MAGIC)
            f.write(bytes(_HEADER.size))  # length and digest are known only at the end
            payload = _HashingWriter(f, pool)
            try:
                torch.save(obj, payload)
            finally:
                payload.finish()
            if payload.error is not None:  # should torch.save ever swallow a failed write
                raise payload.error
            f.seek(len(_MAGIC))
            f.write(_HEADER.pack(payload.length, payload.sha256.digest()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        # The cleanup must not hide why the save failed; a temporary file it
        # could not remove goes at the next save, once this process is gone.
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        cause = payload.error if payload is not None and payload.error is not None else e
        if isinstance(cause, OSError):
            raise _save_failed(path, target, cause) from cause
        raise
    # The rename itself is durable once the directory entry is on disk.
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _save_failed(path, target: str, error: OSError) -> OSError:
    """The OSError save() raises when it could not write or rename its
    temporary file: same errno (so same subclass), naming the path and the cause."""
    where = os.fspath(path) if os.path.abspath(path) == target else f"{os.fspath(path)} (-> {target})"
    reason = error.strerror or str(error)
    if error.errno == errno.ENOSPC:
        reason = f"the disk is full ({reason})"
    message = f"writing checkpoint {where} failed: {reason}; {os.fspath(path)} is unchanged"
    return OSError(message) if error.errno is None else OSError(error.errno, message)


def _existing_mode(target: str) -> int | None:
    try:
        return stat.S_IMODE(os.stat(target).st_mode) & 0o777
    except FileNotFoundError:
        return None


def _temp_prefix(name: str) -> str:
    """`.<name>.shardadam-tmp-<host>-`: the temporary files of saves to
    `name`, followed by the writer's pid and a random part."""
    # A file name is at most 255 bytes and this adds up to ~110 more: a long
    # name is shortened here (always the same way, so leftovers are found).
    while len(os.fsencode(name)) > 128:
        name = name[:-1]
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())
    return f".{name}.shardadam-tmp-{host}-"


def _remove_leftovers(directory: str, prefix: str) -> None:
    """Removes temporary files of earlier saves to the same target, written on
    this host by processes that no longer run (killed during the save)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return  # creating the temporary file will report it
    pattern = re.compile(re.escape(prefix) + r"([1-9][0-9]*)-[0-9a-f]{16}")
    for name in names:
        found = pattern.fullmatch(name)
        if found is not None and not _running(int(found.group(1))):
            with contextlib.suppress(OSError):  # another save may have removed it first
                os.unlink(os.path.join(directory, name))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def load(path: str | os.PathLike, map_location=None, weights_only: bool = True):
    with open(path, "rb", buffering=0) as f:
        start, length = _verify(f, path)
        # torch.load reads each record with readinto, straight into its storage.
        return torch.load(_FileWindow(f, start, length, path), map_location=map_location, weights_only=weights_only)


def _verify(f, path) -> tuple[int, int]:
    """Checks header, length and SHA-256 of the payload; returns where the
    payload starts in the file and its length."""
    if f.read(len(_MAGIC)) != _MAGIC:
        raise CheckpointError(f"{path}: not a shardadam checkpoint (no header); "
                              "write it with shardadam.checkpoint.save")
    header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise CheckpointError(f"{path}: truncated inside the header")
    length, digest = _HEADER.unpack(header)
    start = len(_MAGIC) + _HEADER.size
    size = os.fstat(f.fileno()).st_size - start
    if size != length:
        raise CheckpointError(f"{path}: payload is {size} bytes, the header says {length} "
                              f"({'truncated' if size < length else 'trailing bytes'})")
    if _hash_stream(f, length, path) != digest:
        raise CheckpointError(f"{path}: payload does not match its SHA-256: the file is corrupted")
    return start, length


def _hash_stream(f, length: int, path) -> bytes:
    """SHA-256 of the next `length` bytes of f, hashed in a second thread while
    the next piece is read into the other of two buffers."""
    sha256 = hashlib.sha256()
    buffers = [bytearray(min(length, _READ_CHUNK)) for _ in range(2 if length > _READ_CHUNK else 1)]
    hashed = None
    with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-sha256") as pool:
        for i, begin in enumerate(range(0, length, _READ_CHUNK)):
            piece = memoryview(buffers[i % len(buffers)])[:min(_READ_CHUNK, length - begin)]
            _read_exactly(f, piece, path)  # into the buffer whose hash was waited for last time
            if hashed is not None:
                hashed.result()  # the other buffer is free again
            hashed = pool.submit(sha256.update, piece)
        if hashed is not None:
            hashed.result()
    return sha256.digest()


def _read_exactly(f, out: memoryview, path) -> None:
    done = 0
    while done < len(out):
        n = f.readinto(out[done:])
        if not n:  # the file shrank after it was sized
            raise CheckpointError(f"{path}: truncated while reading")
        done += n


class _FileWindow(io.RawIOBase):
    """A read-only, seekable file over bytes [start, start + length) of an open
    file; readinto reads straight into the caller's buffer."""

    def __init__(self, f, start: int, length: int, path) -> None:
        super().__init__()
        self._f = f
        self._path = path
        self._start = start
        self._length = length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), self._length - self._pos))
        if n:
            self._f.seek(self._start + self._pos)
            _read_exactly(self._f, out[:n], self._path)
        self._pos += n
        return n
