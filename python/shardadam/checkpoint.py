"""Checkpoint files that cannot be half-written or silently corrupt.

save(obj, path): serialises with torch.save into memory, writes a header with
the payload's length and SHA-256 and then the payload to a temporary file in
the same directory, flushes it to disk and renames it over `path`. A crash at
any point leaves either the previous file or the new one, never a mix.

load(path): reads the header, checks length and digest, and only then hands
the payload to torch.load; a truncated, padded or altered file raises
CheckpointError naming what is wrong.
"""
from __future__ import annotations

import hashlib
import io
import os
import struct
import tempfile

import torch

__all__ = ["CheckpointError", "load", "save"]

_MAGIC = b"SHARDADAM-CKPT-1\n"
_HEADER = struct.Struct("<Q32s")  # payload length, SHA-256 of the payload


class CheckpointError(RuntimeError):
    """The file is not a complete shardadam checkpoint."""


def save(obj, path: str | os.PathLike) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    payload = buffer.getvalue()
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC)
            f.write(_HEADER.pack(len(payload), hashlib.sha256(payload).digest()))
            f.write(payload)
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
        data = f.read()
    if not data.startswith(_MAGIC):
        raise CheckpointError(f"{path}: not a shardadam checkpoint (no header); "
                              "write it with shardadam.checkpoint.save")
    header_end = len(_MAGIC) + _HEADER.size
    if len(data) < header_end:
        raise CheckpointError(f"{path}: truncated inside the header")
    length, digest = _HEADER.unpack(data[len(_MAGIC):header_end])
    payload = data[header_end:]
    if len(payload) != length:
        raise CheckpointError(f"{path}: payload is {len(payload)} bytes, the header says {length} "
                              f"({'truncated' if len(payload) < length else 'trailing bytes'})")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"{path}: payload does not match its SHA-256: the file is corrupted")
    return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=weights_only)
