"""A launch plan: tensor lists validated once, tabled by the core, and (for
CUDA) copied to the device once, so every later call is one launch whose host
cost does not depend on the number of tensors."""
from __future__ import annotations

import torch

from . import _core
from ._torch import device_index, first_device, spec, stream_of

# Elements per chunk: one CUDA block (or one CPU work item) handles a chunk.
CHUNK_SIZE = 65536


class TensorPlan:
    """Lists of equally sized tensors for one kernel family.

    ``lists`` maps each list name to (tensors or None, written, allowed dtypes),
    in the order the core expects. The plan keeps the tensors alive; it reads
    their addresses now, so tensors must not be reallocated (``.data = ...``,
    ``set_()``) while the plan is used.
    """

    def __init__(self, kind: str, lists: dict, *, groups: list[int] | None = None, num_groups: int = 1,
                 alias_list: int = -1, device: torch.device | None = None):
        names = list(lists)
        tensor_lists = [lists[n][0] for n in names]
        self.kind = kind
        # `device` matters for a plan of no tensors (it launches nothing, but its
        # scalars are checked against it); otherwise the tensors decide.
        self.device = first_device(tensor_lists) if any(tensor_lists) or device is None else torch.device(device)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"build the {kind} plan before CUDA graph capture starts, then launch it inside")
        ref_name = names[0]
        ref = tensor_lists[0]
        if ref is None:
            raise ValueError(f"{kind}: {ref_name} must be given")
        specs = [spec(n, lists[n][0], lists[n][1], ref, ref_name, self.device, lists[n][2]) for n in names]
        self.table = _core.TensorTable(specs, groups or [], num_groups, CHUNK_SIZE, alias_list)
        self.lists = dict(zip(names, tensor_lists))
        self.num_tensors = len(ref)
        self._device_index = device_index(self.device)
        self._blob = None
        if self.device.type == "cuda":
            # A synchronous copy: the table is on the device before any launch,
            # whatever stream that launch uses.
            raw = torch.frombuffer(bytearray(self.table.blob()), dtype=torch.uint8)
            self._blob = raw.to(self.device)
        self._blob_ptr = self._blob.data_ptr() if self._blob is not None else 0

    def refresh_read_list(self, index: int, tensors: list[torch.Tensor]) -> None:
        """Point a read-only list (gradients) at new tensors of the validated
        sizes and dtypes: O(n), patching only that column of the device table."""
        ptrs = [t.data_ptr() for t in tensors]
        if self.table.refresh_read_list(index, ptrs) or self._blob is None:
            if self._blob is not None:  # an alignment flag changed too: copy the whole table
                raw = torch.frombuffer(bytearray(self.table.blob()), dtype=torch.uint8)
                self._blob.copy_(raw)
            return
        offset = self.table.ptrs_offset(index)
        column = torch.tensor(ptrs, dtype=torch.int64).view(torch.uint8)
        # Pageable source: the copy is staged before this returns, in stream
        # order after earlier launches that read the old column.
        self._blob[offset:offset + column.numel()].copy_(column, non_blocking=True)

    def target(self) -> tuple[int, int, int, int]:
        """(device, stream, blob, threads) for a core call, on the current stream."""
        return (self._device_index, stream_of(self.device), self._blob_ptr, torch.get_num_threads())

    def __repr__(self) -> str:
        present = [n for n, t in self.lists.items() if t is not None]
        return (f"TensorPlan({self.kind}, tensors={self.num_tensors}, elements={self.table.total_numel}, "
                f"chunks={self.table.num_chunks}, groups={self.table.num_groups}, lists={present}, "
                f"device={self.device})")
