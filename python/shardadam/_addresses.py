"""What every step reads from every tensor it tracks (the gradients, data
pointers, the gradients' sizes and dtypes), and the version-counter bumps
after a launch: one pass per list, in C where the build has the tensor scan.

[Note: the tensor scan] Each step proves that the launch tables still point
at the tensors' memory ([Note: tracked storage] in _tracked.py) and bumps the
version counter of every tensor it wrote, as torch's in-place ops do. Through
torch's Python API that is one call per tensor per field, about 100 ns each
on the hosts measured: a plan of 20,000 parameters with two states and
gradients spent over 15 ms per step on it, ten times its kernel. The compiled
helper ``_tensor_scan`` reads the same fields from the tensors' C++ objects in
one pass per list (no call, no reference count, no Python int per tensor;
``.grad`` without the per-tensor ``__torch_function__`` lookup)
and packs them into bytes that compare with one memcmp. It includes torch's
headers, so it is used only under the torch version it was built against;
otherwise (a build without torch, or another torch installed since) these
functions make the same passes through torch's Python API, slower, with the
same results.

A record is opaque: compare records of the same function with ``==``, and
read data pointers back with ``pointers``.
"""
from __future__ import annotations

import operator

import torch
from torch.autograd.graph import increment_version

try:
    from . import _tensor_scan
except ImportError:  # built without torch at build time (or its libraries no longer load)
    _tensor_scan = None

if _tensor_scan is not None and _tensor_scan.TORCH_VERSION != torch.__version__:
    _tensor_scan = None  # built against another torch, whose tensor objects may be laid out differently

SCAN_IN_C = _tensor_scan is not None

_DATA_PTR = torch.Tensor.data_ptr
_NBYTES = torch.Tensor.nbytes.__get__
_DTYPE = operator.attrgetter("dtype")
_GRAD = operator.attrgetter("grad")


def _as_list(tensors) -> list:
    return tensors if type(tensors) is list else list(tensors)


if SCAN_IN_C:
    def addresses(tensors) -> bytes:
        """The tensors' data pointers, as a record. TypeError for an item that
        is not a tensor (None), RuntimeError for one without storage (sparse)."""
        return _tensor_scan.records(_as_list(tensors), False)

    def memory_records(tensors) -> bytes:
        """Data pointers, sizes in bytes and dtypes, as one record (errors as
        ``addresses``)."""
        return _tensor_scan.records(_as_list(tensors), True)

    def grads(tensors) -> list:
        """Each tensor's ``.grad`` (None where it has none), for plain tensors
        and Parameters (a subclass's ``__torch_function__`` is not consulted)."""
        return _tensor_scan.grads(_as_list(tensors))

    def grads_and_records(tensors) -> tuple[list, bytes | None]:
        """``grads(tensors)`` and the ``memory_records`` of that list, in one
        pass; None for the records when a gradient is missing or has no
        storage (sparse)."""
        return _tensor_scan.grads_and_records(_as_list(tensors))

    def pointers(record: bytes) -> list[int]:
        """The data pointers of an ``addresses`` record."""
        return memoryview(record).cast("q").tolist()

    def pointer_record(record: bytes) -> bytes:
        """The ``addresses`` record of the tensors of a ``memory_records`` one."""
        return memoryview(record).cast("q")[::3].tobytes()

    def splice(record: bytes, start: int, end: int, part: bytes) -> bytes:
        """An ``addresses`` record with tensors start to end replaced by ``part``'s."""
        return record[:start * 8] + part + record[end * 8:]

    def bump_versions(tensors) -> None:
        """Tell autograd that a kernel changed these tensors in place, as torch's
        own in-place ops do: backward through a graph that saved one of them
        then raises "modified by an inplace operation"."""
        _tensor_scan.bump(_as_list(tensors))
else:
    def addresses(tensors) -> list[int]:
        return list(map(_DATA_PTR, tensors))

    def memory_records(tensors) -> tuple:
        tensors = _as_list(tensors)
        return list(map(_DATA_PTR, tensors)), list(map(_NBYTES, tensors)), list(map(_DTYPE, tensors))

    def grads(tensors) -> list:
        return list(map(_GRAD, tensors))

    def grads_and_records(tensors) -> tuple[list, tuple | None]:
        found = grads(tensors)
        try:
            return found, memory_records(found)
        except (TypeError, RuntimeError):  # a missing gradient (None), or one without storage (sparse)
            return found, None

    def pointers(record: list[int]) -> list[int]:
        return list(record)

    def pointer_record(record: tuple) -> list[int]:
        return record[0]

    def splice(record: list[int], start: int, end: int, part: list[int]) -> list[int]:
        return record[:start] + part + record[end:]

    def _list_bumps_supported() -> bool:
        # torch >= 2.5 takes a list in one call; torch 2.4 takes one tensor.
        try:
            increment_version([torch.empty(0)])
        except (TypeError, RuntimeError):
            return False
        return True

    if _list_bumps_supported():
        def bump_versions(tensors) -> None:
            if tensors:
                increment_version(_as_list(tensors))
    else:  # pragma: no cover - torch 2.4
        def bump_versions(tensors) -> None:
            for t in tensors:
                increment_version(t)
