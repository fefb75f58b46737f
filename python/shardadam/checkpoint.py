"""Checkpoint files that cannot be half-written or silently corrupt.

save(obj, path): torch.save streams the payload into a temporary file in the
same directory, after a header with the payload's length and SHA-256 (hashed
on the way, filled in at the end); the file is flushed to disk and renamed
over `path`. A crash at any point leaves either the previous file or the new
one, never a mix. The new file's mode follows the umask, as open() would.

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
the disk writes as it goes (a background fdatasync every few hundred MiB)
rather than leaving them all to the final fsync.
"""
from __future__ import annotations

import hashlib
import io
import os
import secrets
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
    release the GIL); every _SYNC_EVERY bytes a background fdatasync starts
    writing the file's dirty pages to disk."""

    def __init__(self, f, pool: ThreadPoolExecutor) -> None:
        self._f = f
        self._pool = pool
        self.sha256 = hashlib.sha256()
        self.length = 0
        self._unsynced = 0
        self._sync: threading.Thread | None = None

    def write(self, chunk) -> int:
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
        self._unsynced += n
        if self._unsynced >= _SYNC_EVERY and (self._sync is None or not self._sync.is_alive()):
            self._unsynced = 0
            self._f.flush()
            self._sync = threading.Thread(target=_datasync, args=(self._f.fileno(),), daemon=True)
            self._sync.start()
        return written

    def flush(self) -> None:
        self._f.flush()

    def finish(self) -> None:
        """Wait for the background sync (before the final fsync and close)."""
        if self._sync is not None:
            self._sync.join()


def _datasync(fd: int) -> None:
    try:
        getattr(os, "fdatasync", os.fsync)(fd)  # macOS has no fdatasync
    except OSError:  # the final fsync reports any failure; this one only starts the writes early
        pass


def save(obj, path: str | os.PathLike) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".tmp-{secrets.token_hex(8)}")
    # O_EXCL: never write through someone else's file or link. Mode 0666 less
    # the umask, as a plain open() would give (mkstemp's is always 0600).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f, ThreadPoolExecutor(1, thread_name_prefix="checkpoint-sha256") as pool:
            f.write(_MAGIC)
            f.write(bytes(_HEADER.size))  # length and digest are known only at the end
            payload = _HashingWriter(f, pool)
            try:
                torch.save(obj, payload)
            finally:
                payload.finish()
            f.seek(len(_MAGIC))
            f.write(_HEADER.pack(payload.length, payload.sha256.digest()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    # The rename itself is durable once the directory entry is on disk.
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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
