"""A launch plan: tensor lists validated once, tabled by the core, and (for
CUDA) copied to the device once, so every later call is one launch whose host
cost does not depend on the number of tensors, bar two O(n) C-level parts:
the optional address check and the version-counter bump (see TensorPlan)."""
from __future__ import annotations

import contextlib
import contextvars
import operator

import torch

from . import _addresses, _core
from ._torch import device_index, first_device, spec, stream_of, version_roots

layout_of = operator.attrgetter("layout")
numel_of = torch.Tensor.numel
dtype_of = operator.attrgetter("dtype")
device_index_of = torch.Tensor.get_device  # -1 on the CPU, like device_index()
is_contiguous = torch.Tensor.is_contiguous

# Elements per chunk: one CUDA block (or one CPU work item) handles a chunk.
CHUNK_SIZE = 65536

# CPU threads for the launches made inside cpu_threads(); torch's own count elsewhere.
_CPU_THREADS: contextvars.ContextVar[int | None] = contextvars.ContextVar("shardadam_cpu_threads", default=None)


@contextlib.contextmanager
def cpu_threads(count: int):
    """CPU launches in this context (this thread) run on `count` threads
    instead of torch.get_num_threads() (the host step of host state:
    [Note: host step threads] in _host_state.py)."""
    token = _CPU_THREADS.set(count)
    try:
        yield
    finally:
        _CPU_THREADS.reset(token)


# [Note: borrowed read lists] An optimizer's plan reads the gradients, which
# torch frees at zero_grad(set_to_none=True): a plan that kept them between
# steps kept one gradient per parameter alive into the next backward (+4
# bytes per fp32 parameter at the peak). So the optimizers borrow the
# gradient list for one launch: refresh_read_list hands the step's gradients
# (patching the table only where an address changed), release_read_list lets
# go of them after the launch, and a plan with a released list refuses to
# launch until it is handed the list again. The table keeps the addresses;
# whoever hands the list again checks that the tensors at those addresses
# are what the table says (sizes in bytes and dtypes: Bucket._current_grads),
# since a released gradient's memory may hold another tensor by then.


class TensorPlan:
    """Lists of equally sized tensors for one kernel family.

    ``lists`` maps each list name to (tensors or None, written, allowed dtypes)
    or (..., options), options a dict of ``codes`` (dtype codes that replace
    the usual ones for this list) and ``blocks_of`` (the name of the list
    whose block maxima this one holds), in the order the core expects. The
    plan keeps the tensors alive and reads their addresses now.

    check_addresses (default True): every launch first verifies that every
    tensor of the plan still has the data pointer it had when the plan was
    built (or when ``refresh_read_list`` last pointed its list at new
    tensors), and raises RuntimeError naming the list and index, before
    anything is launched, if one was re-pointed (``t.data = ...``, ``set_()``,
    ``resize_()`` to a larger size, ``untyped_storage().resize_(0)``: each
    gives the tensor other memory, or none). The pointer is what makes a
    launch safe: a tensor whose pointer did not change still owns at least
    the bytes the table covers (``t.data = t.data[:k]`` or a dtype view keeps
    the storage), so one C-level pass over the tensors suffices ([Note: the
    tensor scan] in _addresses.py). Pass False when
    the caller guarantees that nothing is re-pointed (the optimizers check
    parameters and gradients themselves and own the rest of the memory): a
    re-pointed tensor then makes the kernel read or write freed memory.

    Whatever check_addresses, every launch bumps the autograd version counter
    of the written tensors (through their bases: one bump per distinct root,
    precomputed here), as torch's in-place ops do.
    """

    def __init__(self, kind: str, lists: dict, *, groups: list[int] | None = None, num_groups: int = 1,
                 alias_list: int = -1, device: torch.device | None = None, check_addresses: bool = True):
        if not isinstance(check_addresses, bool):
            raise TypeError(f"{kind}: check_addresses must be True or False, not {check_addresses!r}")
        names = list(lists)
        tensor_lists = [lists[n][0] for n in names]
        self.kind = kind
        # `device` matters for a plan of no tensors (it launches nothing, but its
        # scalars are checked against it); otherwise the tensors decide.
        self.device = first_device(tensor_lists) if any(tensor_lists) or device is None else _indexed(device)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"build the {kind} plan before CUDA graph capture starts, then launch it inside")
        ref_name = names[0]
        ref = tensor_lists[0]
        if ref is None:
            raise ValueError(f"{kind}: {ref_name} must be given")
        options = {n: lists[n][3] if len(lists[n]) > 3 else {} for n in names}
        specs = [spec(n, lists[n][0], lists[n][1], ref, ref_name, self.device, lists[n][2],
                      codes=options[n].get("codes"),
                      maxima_of=names.index(options[n]["blocks_of"]) if "blocks_of" in options[n] else -1)
                 for n in names]
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
        self._allowed = {n: lists[n][2] for n in names}
        self._written = {n: lists[n][1] for n in names}
        self._check_addresses = check_addresses
        # The watched tensors, flat: every list in order, then the extra
        # tensors a subclass adds (per-tensor scales). _spans: name -> (start,
        # end, index in the table or None for an extra whole tensor).
        self._watched: list[torch.Tensor] = []
        self._spans: dict[str, tuple[int, int, int | None]] = {}
        for i, (name, tensors) in enumerate(self.lists.items()):
            start = len(self._watched)
            self._watched.extend(tensors or ())
            self._spans[name] = (start, len(self._watched), i)
        self._ptrs = self._numels = self._dtypes = None
        if check_addresses:
            self._ptrs = _addresses.addresses(self._watched)
            self._numels = list(map(numel_of, self._watched))
            self._dtypes = list(map(dtype_of, self._watched))
        self._roots = version_roots([t for n, ts in self.lists.items() if ts is not None and self._written[n]
                                     for t in ts])
        # [Note: borrowed read lists] The addresses each read list's column of
        # the table holds, and the lists whose tensors were let go since.
        self._columns = {n: _addresses.addresses(ts) for n, ts in self.lists.items()
                         if ts is not None and not self._written[n]}
        self._released: set[str] = set()

    @property
    def check_addresses(self) -> bool:
        """Whether each launch verifies the tensors' addresses (fixed when built)."""
        return self._check_addresses

    def _watch(self, name: str, tensor: torch.Tensor | None, written: bool) -> None:
        """Also check (and, when written, bump) a whole tensor the kernel uses
        through its address: a subclass's per-tensor scales."""
        if tensor is None:
            return
        pos = len(self._watched)
        self._watched.append(tensor)
        self._spans[name] = (pos, pos + 1, None)
        if self._check_addresses:
            self._ptrs = _addresses.addresses(self._watched)
            self._numels.append(tensor.numel())
            self._dtypes.append(tensor.dtype)
        if written:
            seen = set(map(id, self._roots))
            self._roots.extend(r for r in version_roots([tensor]) if id(r) not in seen)

    def refresh_read_list(self, index: int, tensors: list[torch.Tensor], *, ptrs=None) -> None:
        """Point a read-only list (gradients) at new tensors of the validated
        sizes and dtypes: O(n), patching only that column of the device table,
        and only when an address changed. The plan keeps the new tensors alive
        (and, with check_addresses, checks them now and watches their addresses
        from now on). ptrs: their ``_addresses.addresses`` record, when the caller
        has it."""
        names = list(self.lists)
        if not isinstance(index, int) or not 0 <= index < len(names):
            raise ValueError(f"refresh_read_list: index {index!r} is not a list of this {self.kind} plan "
                             f"(0 to {len(names) - 1}: {names})")
        name = names[index]
        tensors = list(tensors)
        if self._check_addresses:
            self._check_refresh(name, tensors)
        if ptrs is None or self._check_addresses:
            ptrs = _addresses.addresses(tensors)
        if ptrs == self._columns[name]:  # the table already points there: nothing to copy
            self._hold(name, tensors)
            return
        column = _addresses.pointers(ptrs)
        if self.table.refresh_read_list(index, column) or self._blob is None:
            if self._blob is not None:  # an alignment flag changed too: copy the whole table
                raw = torch.frombuffer(bytearray(self.table.blob()), dtype=torch.uint8)
                self._blob.copy_(raw)
        else:
            offset = self.table.ptrs_offset(index)
            raw = torch.tensor(column, dtype=torch.int64).view(torch.uint8)
            # Pageable source: the copy is staged before this returns, in stream
            # order after earlier launches that read the old column.
            self._blob[offset:offset + raw.numel()].copy_(raw, non_blocking=True)
        self._columns[name] = ptrs
        self._hold(name, tensors)
        if self._check_addresses:
            start, end, _ = self._spans[name]
            self._ptrs = _addresses.splice(self._ptrs, start, end, ptrs)

    def _hold(self, name: str, tensors: list[torch.Tensor]) -> None:
        """The table points at these tensors: keep them alive, watch them."""
        start, end, _ = self._spans[name]
        self.lists[name] = tensors
        self._watched[start:end] = tensors
        self._released.discard(name)

    def release_read_list(self, index: int) -> None:
        """Let go of a read list's tensors (the gradients, once a step has
        been launched) so that the plan keeps none of them alive: [Note:
        borrowed read lists]. The table keeps their addresses, which no launch
        uses until ``refresh_read_list`` hands the list tensors again."""
        name = list(self.lists)[index]
        if self._written[name]:
            raise ValueError(f"release_read_list: {name} is written; the plan keeps it")
        start, end, _ = self._spans[name]
        self.lists[name] = []
        self._watched[start:end] = [None] * (end - start)
        self._released.add(name)

    def _check_refresh(self, name: str, tensors: list[torch.Tensor]) -> None:
        """The new tensors of a read list match the old ones: count, element
        counts, dtypes, device, density and memory order."""
        start, end, _ = self._spans[name]
        if self._written[name]:
            raise ValueError(f"refresh_read_list: {name} is written; its addresses are fixed when the plan "
                             "is built")
        if len(tensors) != end - start:
            raise ValueError(f"refresh_read_list: {name} has {end - start} tensors, got {len(tensors)}")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"refresh_read_list: {name}[{i}] is {type(t).__name__}; pass torch tensors")
        numels = list(map(numel_of, tensors))
        dtypes = list(map(dtype_of, tensors))
        if numels != self._numels[start:end] or dtypes != self._dtypes[start:end]:
            for i, (t, n, d) in enumerate(zip(tensors, self._numels[start:end], self._dtypes[start:end])):
                if t.numel() != n or t.dtype != d:
                    raise ValueError(f"refresh_read_list: {name}[{i}] has {t.numel()} elements of "
                                     f"{_dtype_name(t.dtype)}; the plan was built for {n} of {_dtype_name(d)}")
        # Device, layout, density and memory order, as when the plan was built:
        # all contiguous on the plan's device (the common case) in C-level
        # passes, the full per-tensor checks otherwise.
        ref_name = next(iter(self.lists))
        ref = self.lists[ref_name]
        if (set(map(layout_of, tensors)) <= {torch.strided} and set(map(device_index_of, tensors)) <= {
                self._device_index} and all(map(is_contiguous, tensors)) and all(map(is_contiguous, ref))):
            return
        spec(name, tensors, False, ref, ref_name, self.device, self._allowed[name])

    def _refuse_released(self) -> None:
        if self._released:
            raise RuntimeError(f"{type(self).__name__}: the tensors of {sorted(self._released)} were released "
                               "(release_read_list); hand them again with refresh_read_list before launching")

    def _check_launch(self) -> None:
        """Before a launch: every watched tensor still has the address the
        table holds (one C-level pass)."""
        self._refuse_released()
        if _addresses.addresses(self._watched) != self._ptrs:
            self._diagnose()

    def _diagnose(self) -> None:
        """The slow path of _check_launch: raise for the first tensor whose
        address is not the table's, saying what happened to it (zero-size
        tensors may move: no memory of theirs is touched)."""
        cls = type(self).__name__
        ptrs = _addresses.pointers(self._ptrs)
        for pos, t in enumerate(self._watched):
            ptr, numel, dtype = ptrs[pos], self._numels[pos], self._dtypes[pos]
            if t.data_ptr() == ptr:
                continue
            name, index, label = self._label(pos)
            if t.dtype != dtype:
                raise RuntimeError(f"{cls}: {label} is now {_dtype_name(t.dtype)} but the plan was built for "
                                   f"{_dtype_name(dtype)} (t.data = ... changed it); build a new plan")
            if t.numel() != numel:
                raise RuntimeError(f"{cls}: {label} now has {t.numel()} elements but the plan was built for "
                                   f"{numel} (resize_(), set_() or t.data = ... changed it); build a new plan")
            if numel == 0:  # nothing of a zero-size tensor is read or written
                continue
            storage = t.untyped_storage()
            if storage.nbytes() < (t.storage_offset() + t.numel()) * t.element_size():
                raise RuntimeError(f"{cls}: {label} lost its memory (its storage was freed or shrunk to "
                                   f"{storage.nbytes()} bytes, e.g. by untyped_storage().resize_(0)); "
                                   "build a new plan once it has memory again")
            since = "the plan was built"
            hint = "build a new plan"
            if index is not None and not self._written[name]:
                since += " or refresh_read_list last pointed the list at new tensors"
                hint += f", or point the list at the new tensors with refresh_read_list({index}, ...)"
            raise RuntimeError(f"{cls}: {label} was moved to other memory (its data pointer changed since "
                               f"{since}: t.data = ..., set_(), resize_()); {hint}")
        self._ptrs = _addresses.addresses(self._watched)  # only zero-size tensors moved: follow them

    def _label(self, pos: int) -> tuple[str, int | None, str]:
        """(list name, list index in the table or None, 'name[i]') of a watched position."""
        for name, (start, end, index) in self._spans.items():
            if start <= pos < end:
                return name, index, (name if index is None else f"{name}[{pos - start}]")
        raise AssertionError(pos)

    def _bump_versions(self) -> None:
        """After a launch: the written tensors changed in place."""
        _addresses.bump_versions(self._roots)

    def target(self) -> tuple[int, int, int, int]:
        """(device, stream, blob, threads) for a core call, on the current stream."""
        self._refuse_released()
        return (self._device_index, stream_of(self.device), self._blob_ptr,
                _CPU_THREADS.get() or torch.get_num_threads())

    def __repr__(self) -> str:
        present = [n for n, t in self.lists.items() if t is not None]
        return (f"TensorPlan({self.kind}, tensors={self.num_tensors}, elements={self.table.total_numel}, "
                f"chunks={self.table.num_chunks}, groups={self.table.num_groups}, lists={present}, "
                f"device={self.device}, check_addresses={self._check_addresses})")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _indexed(device) -> torch.device:
    """device with its index: "cuda" alone means the current CUDA device (the
    core is told an index, as tensors always carry one)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
