"""Checkpoint files that cannot be half-written or silently corrupt.

save(obj, path): torch.save streams the payload into a temporary file in the
same directory, after a header with the payload's length and SHA-256 (hashed
on the way, filled in at the end); the file is flushed to disk and renamed
over `path`. A crash at any point leaves either the previous file or the new
one, never a mix. The new file's mode follows the umask, as open() would.

load(path): reads the header, checks length and digest, and only then hands
the payload to torch.load; a truncated, padded or altered file raises
CheckpointError naming what is wrong. At most the payload and the tensors
built from it are in memory at once.
"""
from __future__ import annotations

import hashlib
import io
import os
import secrets
import struct

import torch

__all__ = ["CheckpointError", "load", "save"]

_MAGIC = b"SHARDADAM-CKPT-1\n"
_HEADER = struct.Struct("<Q32s")  # payload length, SHA-256 of the payload


class CheckpointError(RuntimeError):
    """The file is not a complete shardadam checkpoint."""


class _HashingWriter:
    """What torch.save writes to: each chunk goes on to the file and into the
    digest, so the serialised payload is never held in memory whole."""

    def __init__(self, f) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()
        self.length = 0

    def write(self, chunk) -> int:
        self.sha256.update(chunk)
        self.length += memoryview(chunk).nbytes
        return self._f.write(chunk)

    def flush(self) -> None:
        self._f.flush()


def save(obj, path: str | os.PathLike) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".tmp-{secrets.token_hex(8)}")
    # O_EXCL: never write through someone else's file or link. Mode 0666 less
    # the umask, as a plain open() would give (mkstemp's is always 0600).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC)
            f.write(bytes(_HEADER.size))  # length and digest are known only at the end
            payload = _HashingWriter(f)
            torch.save(obj, payload)
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
    with open(path, "rb") as f:
        payload = _read_payload(f, path)
    # BytesIO shares the bytes object rather than copying it.
    return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=weights_only)


def _read_payload(f, path) -> bytes:
    """The verified payload, read into one bytes object (no other copy)."""
    if f.read(len(_MAGIC)) != _MAGIC:
        raise CheckpointError(f"{path}: not a shardadam checkpoint (no header); "
                              "write it with shardadam.checkpoint.save")
    header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise CheckpointError(f"{path}: truncated inside the header")
    length, digest = _HEADER.unpack(header)
    # Sized before reading: a wrong length is reported without allocating it.
    size = os.fstat(f.fileno()).st_size - len(_MAGIC) - _HEADER.size
    if size != length:
        raise CheckpointError(f"{path}: payload is {size} bytes, the header says {length} "
                              f"({'truncated' if size < length else 'trailing bytes'})")
    payload = f.read(length)
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"{path}: payload does not match its SHA-256: the file is corrupted")
    return payload
