"""nccl_ub=True: the gradient buffer and the reduced shards in NCCL-registered
memory (apex's NCCL user buffers: the reduce-scatter reads and writes them
without staging copies), through torch's NCCL memory pool: a
torch.cuda.MemPool over ProcessGroupNCCL's allocator, registered with the
process group once the buffers are in it."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def check_nccl_ub(group, device: torch.device) -> None:
    """What nccl_ub=True needs and this setup lacks: ValueError naming it."""
    missing = [why for why, bad in (
        ("CUDA parameters", device.type != "cuda"),
        ("an NCCL distributed_process_group", "nccl" not in str(dist.get_backend(group))),
        ("torch.cuda.MemPool (torch >= 2.8)", not hasattr(torch.cuda, "MemPool"))) if bad]
    if not missing:
        backend = _backend(group, device)
        if not (hasattr(backend, "mem_allocator") and hasattr(backend, "register_mem_pool")):
            missing.append("a ProcessGroupNCCL with a memory allocator (torch built with NCCL >= 2.19)")
    if missing:
        raise ValueError(f"nccl_ub=True registers the gradient buffers with NCCL and needs {', '.join(missing)} "
                         f"(parameters on {device}); leave nccl_ub=False")


def _backend(group, device: torch.device):
    return (group if group is not None else dist.group.WORLD)._get_backend(device)


class RegisteredPool:
    """Allocations made inside allocate() come from one NCCL-registered pool."""

    def __init__(self, group, device: torch.device):
        self._backend = _backend(group, device)
        self.pool = torch.cuda.MemPool(self._backend.mem_allocator)
        self._device = device
        self._registered = False

    @contextlib.contextmanager
    def allocate(self):
        with torch.cuda.use_mem_pool(self.pool, self._device):
            yield

    def register(self) -> None:
        """After the buffers are allocated: NCCL registers the pool's segments."""
        self._backend.register_mem_pool(self.pool)
        self._registered = True

    def close(self) -> None:
        if self._registered:
            self._backend.deregister_mem_pool(self.pool)
            self._registered = False
