"""The torch-aware glue: torch tensors in, addresses and dtype codes out.

Everything here runs when a plan is built (once), never per element. The
compiled core never sees a torch object.
"""
from __future__ import annotations

import numbers
from typing import Sequence

import torch
from torch.autograd.graph import increment_version

from . import _core

DTYPE_CODES = {
    torch.float32: _core.DType.float32,
    torch.float16: _core.DType.float16,
    torch.bfloat16: _core.DType.bfloat16,
    torch.int16: _core.DType.int16,
    torch.float8_e4m3fn: _core.DType.float8_e4m3fn,
}
# Elements per block of blockwise 8-bit states ([Note: blockwise 8-bit states] in cpp/dtype.h).
QUANT_BLOCK = _core.q8_block()


def blocks_of(numel: int) -> int:
    """How many block maxima a tensor of numel elements has."""
    return -(-numel // QUANT_BLOCK)

SCALAR_CODES = {
    torch.float32: _core.DType.float32,
    torch.float64: _core.DType.float64,
    torch.int32: _core.DType.int32,
    torch.int64: _core.DType.int64,
}


def as_list(name: str, value) -> list[torch.Tensor] | None:
    """A tensor, a sequence of tensors, or None (absent list)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        for i, t in enumerate(value):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{i}] is {type(t).__name__}; pass torch tensors")
        return list(value)
    raise TypeError(f"{name} must be a tensor or a list of tensors, not {type(value).__name__}")


def is_dense(t: torch.Tensor) -> bool:
    """True when t's elements fill one gap-free block of memory in some order
    (contiguous, channels_last, any permutation)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def memory_order(p: torch.Tensor) -> tuple:
    """The dims from outermost to innermost in memory (size-1 dims left out):
    (0, 1, 2, 3) contiguous, (0, 2, 3, 1) channels_last."""
    dims = [d for d in range(p.dim()) if p.shape[d] != 1]
    return tuple(sorted(dims, key=lambda d: -p.stride(d)))


def _same_element_order(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Element k in memory is the same logical element in both tensors."""
    if a.is_contiguous() and b.is_contiguous():
        return True  # any shapes: row-major order on both sides (flat state is fine)
    if a.shape != b.shape:
        return False
    return all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n != 1)


def check_tensor(name: str, t: torch.Tensor, device: torch.device, allowed) -> None:
    if t.layout != torch.strided:
        raise ValueError(f"{name} is a {t.layout} tensor; pass dense (strided) tensors "
                         "(sparse gradients are not supported)")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the first tensor is on {device}: "
                         "put all tensors of one call on the same device")
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise ValueError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; supported: {names}")
    if t.numel() and not is_dense(t):
        raise ValueError(f"{name} is not dense (a strided view with gaps); pass a contiguous "
                         "tensor, e.g. t.contiguous(), and copy results back yourself")


def spec(name: str, tensors: list[torch.Tensor] | None, written: bool, reference: list[torch.Tensor] | None,
         ref_name: str, device: torch.device, allowed, codes: dict | None = None, maxima_of: int = -1):
    """One list as the core's TensorTable wants it. codes: dtype codes that
    replace DTYPE_CODES' for this list (uint8 states are blockwise 8-bit
    codes). maxima_of >= 0: the list holds the block maxima of that list
    (one float32 per QUANT_BLOCK elements of the reference tensor)."""
    if tensors is None:
        return (name, [], [], [], written, maxima_of)
    for i, t in enumerate(tensors):
        check_tensor(f"{name}[{i}]", t, device, allowed)
    if maxima_of >= 0:
        if reference is not None and len(tensors) == len(reference):
            for i, (t, r) in enumerate(zip(tensors, reference)):
                blocks = blocks_of(r.numel())
                if t.numel() != blocks:
                    raise ValueError(f"{name}[{i}] has {t.numel()} elements; it holds one float32 maximum per "
                                     f"{QUANT_BLOCK} elements of {ref_name}[{i}] ({r.numel()}): {blocks}")
        return (name, [t.data_ptr() for t in tensors], [t.numel() for t in tensors],
                [DTYPE_CODES[t.dtype].value for t in tensors], written, maxima_of)
    if reference is not None and reference is not tensors and len(tensors) == len(reference):
        for i, (t, r) in enumerate(zip(tensors, reference)):
            if t.numel() == r.numel() and t.numel() and not _same_element_order(t, r):
                raise ValueError(
                    f"{name}[{i}] (shape {tuple(t.shape)}, strides {t.stride()}) orders its elements "
                    f"differently from {ref_name}[{i}] (shape {tuple(r.shape)}, strides {r.stride()}): "
                    "give corresponding tensors the same shape and memory format")
    codes = {**DTYPE_CODES, **(codes or {})}
    return (name, [t.data_ptr() for t in tensors], [t.numel() for t in tensors],
            [codes[t.dtype].value for t in tensors], written, -1)


def scalar(name: str, value, device: torch.device) -> _core.Scalar:
    """A Python number, or a one-element tensor the kernel reads itself. A
    tensor on another device than the step's is read here: a host value for
    a GPU step costs nothing; a GPU value for a host step (state in host
    memory) waits for the current stream, as that step's inputs do anyway."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got {value.numel()} elements")
        if (value.device.type == "cpu") != (device.type == "cpu"):
            return _core.Scalar(float(value.item()))
        if value.device != device:
            raise ValueError(f"{name} is on {value.device}; put it on {device} (or pass a number)")
        if value.dtype not in SCALAR_CODES:
            raise ValueError(f"{name} has dtype {value.dtype}; use float32, float64, int32 or int64")
        return _core.Scalar(0.0, value.data_ptr(), SCALAR_CODES[value.dtype].value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number or a one-element tensor, not {type(value).__name__}")
    return _core.Scalar(float(value))


def flag_ptr(name: str, flag: torch.Tensor | None, device: torch.device) -> int:
    """Address of a float32 one-element flag tensor (found_inf style), or 0."""
    if flag is None:
        return 0
    if not isinstance(flag, torch.Tensor) or flag.numel() != 1 or flag.dtype != torch.float32:
        raise ValueError(f"{name} must be a one-element float32 tensor (like GradScaler's found_inf)")
    if flag.device != device:
        raise ValueError(f"{name} is on {flag.device}; put it on {device}")
    return flag.data_ptr()


def per_tensor_ptr(name: str, t: torch.Tensor | None, n: int, device: torch.device) -> int:
    """Address of a float32 [n] tensor with one value per table tensor, or 0."""
    if t is None:
        return 0
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != n or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous float32 tensor with one value per tensor ({n})")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; put it on {device}")
    return t.data_ptr()


def stream_of(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.current_stream(device).cuda_stream


def device_index(device: torch.device) -> int:
    return -1 if device.type == "cpu" else device.index


def first_device(lists: Sequence[list[torch.Tensor] | None]) -> torch.device:
    for tensors in lists:
        if tensors:
            return tensors[0].device
    return torch.device("cpu")


# ---------------------------------------------------------------- version counters

def version_roots(tensors) -> list[torch.Tensor]:
    """The tensors whose version counters stand for those of `tensors`: a view
    shares its counter with its base (``_base`` is always the root of a chain
    of views), so the base is bumped instead, once (deduplicated by identity).
    Inference tensors have no counter and are left out."""
    seen, roots = set(), []
    for t in tensors:
        base = t._base
        root = t if base is None else base
        if id(root) not in seen and not root.is_inference():
            seen.add(id(root))
            roots.append(root)
    return roots


def bump_flag(flag: torch.Tensor | None) -> None:
    """Bump a found_inf style flag that a kernel writes (given by the caller)."""
    if flag is not None and not flag.is_inference():
        increment_version(flag)
