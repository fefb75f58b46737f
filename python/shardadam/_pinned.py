"""Page-locked host buffers of an exact size.

``torch.empty(..., pin_memory=True)`` goes through torch's caching host
allocator, which rounds every block up to a power of two: a 40 GiB state
would take 64 GiB. The optimizers' host buffers are few, large and live as
long as the optimizer, so they are ordinary host tensors registered with the
CUDA driver (cudaHostRegister) instead: the GPU copies to and from them
asynchronously, and no byte is added.
"""
from __future__ import annotations

import weakref

import torch


def pinned_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised 1-D host tensor that `device` (a CUDA device) copies
    to and from asynchronously; a plain host tensor for a CPU device (there
    is nothing to copy)."""
    return pin(torch.empty(numel, dtype=dtype), device)


def pin(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Page-lock the whole storage of host tensor `t` (a tensor that owns
    it) for `device`'s copies; nothing for a CPU device. Returns t."""
    if device.type != "cuda" or t.numel() == 0:
        return t
    cudart = torch.cuda.cudart()
    ptr, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    status = int(cudart.cudaHostRegister(ptr, nbytes, 0))
    if status != 0:  # cudaSuccess
        raise RuntimeError(f"state_device='cpu': page-locking {nbytes / 2 ** 30:.2f} GiB of host memory failed "
                           f"(cudaHostRegister returned CUDA error {status}); the host may be short of memory, or "
                           "the locked-memory limit (ulimit -l) too low for the optimizer's host buffers")
    # Unregistered when the tensor goes: views of it keep the memory alive, and
    # a copy from memory no longer registered is merely synchronous.
    weakref.finalize(t, cudart.cudaHostUnregister, ptr)
    return t
