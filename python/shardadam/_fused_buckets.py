"""Flat optimizer state for the fused single-process optimizers (FusedAdam, FusedLion).

Parameters are split by device and by where their master lives ([Note:
storage codecs] in _storage.py):

- ``param``: the parameter is its own master (fp32 params, or 16-bit params
  without master weights);
- ``separate``: a master copy (``master_weight_dtype``) is updated and the
  16-bit parameter is written as the master rounded to nearest;
- ``remainder``: bf16 parameter + int16 remainder form an exact fp32 master.

Each (device, kind) is one bucket: flat state buffers (the update rule's
states, e.g. exp_avg and exp_avg_sq, master or remainders, per-tensor scales),
per-parameter views into them (what ``optimizer.state[p]`` holds), and one plan
of the rule's kernel over all its parameters in group order, so a step is one
launch per bucket whatever the number of parameters ([Note: update rules] in
_rules.py).
"""
from __future__ import annotations

import operator

import torch

from . import _addresses, kernels
from ._dtensor import PLAIN
from ._storage import PARAM, REMAINDER, SEPARATE, StorageSpec, block_views, blocks_of
from ._torch import check_tensor

# Offsets of every parameter's state are multiples of this many elements, so
# each view starts 64-byte aligned and the kernels can use vector access.
ALIGN_ELEMS = 32

GRAD_LIST = 1  # index of grads in an update rule's table


def storage_kind(p: torch.Tensor, master_weights: bool, store_param_remainders: bool) -> str:
    """Where p's master lives ([Note: storage codecs] in _storage.py)."""
    if store_param_remainders and p.dtype == torch.bfloat16:
        return REMAINDER
    if master_weights and p.dtype in (torch.float16, torch.bfloat16):
        return SEPARATE
    return PARAM


def _dense_view(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A view of flat[offset:] with like's shape and strides (channels_last included)."""
    return torch.as_strided(flat, like.shape, like.stride(), offset)


class GradFit:
    """What a gradient must match of its parameter, and the check."""

    def __init__(self, params: list, names: list[str]):
        self.params = params
        self.names = names
        self.device = params[0].device
        self._strides = [p.stride() for p in params]
        self._numels = [p.numel() for p in params]
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        self._all_contiguous = all(p.is_contiguous() for p in params)

    def check(self, grads: list, idx: list[int] | None = None) -> list:
        """Every gradient fits its parameter (parameter idx[k] for grads[k];
        all parameters in order when idx is None): strided, on the
        parameters' device, a float dtype, as many elements, the same element
        order. torch's ``p.grad = t`` checks some of this, ``p.grad.data = t``
        none of it. C-level passes for the common case; the checked path names
        the first offender. Returns the gradients' dtypes."""
        numels = self._numels if idx is None else [self._numels[i] for i in idx]
        idx = range(len(self.params)) if idx is None else idx
        dtypes = [g.dtype for g in grads]
        try:
            fast_ok = (list(map(torch.Tensor.numel, grads)) == numels
                       and list(map(torch.Tensor.get_device, grads)) == [self._device_index] * len(grads)
                       and all(d in kernels.FLOATS for d in set(dtypes))
                       and self._all_contiguous and all(map(torch.Tensor.is_contiguous, grads)))
        except RuntimeError:  # sparse gradients have no is_contiguous: the checks below say so
            fast_ok = False
        if not fast_ok:
            for i, g in zip(idx, grads):
                p = self.params[i]
                where = f"the gradient of {self.names[i]}"
                check_tensor(where, g, self.device, kernels.FLOATS)
                if g.numel() != p.numel():
                    raise ValueError(f"{where} has {g.numel()} elements (shape {tuple(g.shape)}), the parameter "
                                     f"{p.numel()} (shape {tuple(p.shape)}): was it set with p.grad.data = ...?")
                if g.stride() != self._strides[i] and not (g.is_contiguous() and p.is_contiguous()):
                    raise ValueError(f"{where} has strides {g.stride()} but the parameter {p.stride()}: "
                                     "element orders differ; assign a gradient laid out like its parameter "
                                     "(torch.empty_like(p).copy_(g))")
        return dtypes


class Bucket:
    """The parameters of one device and one storage kind, with their flat state."""

    def __init__(self, kind: str, params: list, group_of: list[int], num_groups: int, opts: dict, names: list[str],
                 shards=PLAIN):
        """opts: the optimizer's options (``rule``, ``state_dtypes`` by state
        name, ``master_weight_dtype``, ``grad_of``: reads a parameter's
        gradient, ``p.grad`` or TE's ``p.decoupled_grad``). names: how errors
        call each parameter (``param_groups[g]['params'][i]``). shards: how the
        parameters reach the tensors the kernels step (_dtensor.py: PLAIN, or
        LocalShards for DTensor parameters)."""
        self.kind = kind
        self.rule = opts["rule"]
        self.grad_of = opts["grad_of"]
        self.owners = params  # the optimizer's parameters
        self.shards = shards
        self.params = shards.tensors(params)  # what the kernels step: the local tensors of DTensors
        params = self.params
        self.names = names
        self.device = params[0].device
        self.group_sizes = [0] * num_groups
        for g in group_of:
            self.group_sizes[g] += 1
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += -(-p.numel() // ALIGN_ELEMS) * ALIGN_ELEMS
        self.total = total
        n = len(params)
        # The rule's states, flat; fp16 ones keep per-tensor power-of-two
        # scales (stored = true * scale), keyed like the states ("master" too).
        spec = StorageSpec(kind, opts["master_weight_dtype"], tuple(opts["state_dtypes"].items()))
        stored = spec.allocate(self.rule, total, n, self.device, sum(blocks_of(p.numel()) for p in params))
        self.states, self.scales, self.master, self.remainders = (stored.states, stored.scales, stored.master,
                                                                  stored.remainders)
        # Blockwise states: each parameter's block maxima, a slice of one flat buffer per state.
        self.blocks = {name: block_views(flat, [p.numel() for p in params]) for name, flat in stored.blocks.items()}
        self.views = [self._views_of(i) for i in range(n)]
        # Views of this rank's piece alone, handed out plain (exposed_state).
        self.per_piece = frozenset([f"{name}_scale" for name in self.scales]
                                   + [f"{name}_absmax" for name in self.blocks])
        for i, p in enumerate(params):
            if self.master is not None:
                self.views[i]["master_param"].copy_(p.detach())
        # [Note: tracked storage] What the plan's table holds of the
        # parameters, checked every step (moved_params).
        self.param_ptrs = _addresses.addresses(params)
        self.param_shapes = [p.shape for p in params]
        self.grad_fit = GradFit(params, names)
        self.flat_grads = None
        self._flat_views: list | None = None  # set by use_flat_grads
        self._plan = None
        # What the plan's gradient column holds: addresses (and the memory
        # records of the gradients it last read) and dtypes.
        self._grad_ptrs = None
        self._grad_records = None
        self._grad_dtypes: list | None = None

    def _views_of(self, i: int) -> dict:
        """state[p] for parameter i: views into the flat buffers, scales as 0-d views."""
        p, off = self.params[i], self.offsets[i]
        views = {name: _dense_view(flat, off, p) for name, flat in self.states.items()}
        if self.master is not None:
            views["master_param"] = _dense_view(self.master, off, p)
        if self.remainders is not None:
            views["param_remainder"] = _dense_view(self.remainders, off, p)
        for name, scales in self.scales.items():
            views[f"{name}_scale"] = scales[i]
        for name, blocks in self.blocks.items():
            views[f"{name}_absmax"] = blocks[i]
        return views

    def exposed_state(self, i: int) -> dict:
        """``optimizer.state[p]`` of parameter i: its views, as DTensors of the
        parameter's placements for a DTensor parameter (per_piece: the
        per-tensor scales and block maxima stay plain, each belongs to this
        rank's piece). A host-state bucket hands out its views alike."""
        owner = self.owners[i]
        return {name: view if name in self.per_piece else self.shards.wrap(view, owner)
                for name, view in self.views[i].items()}

    def after_load(self) -> None:
        """A checkpoint was loaded into the views: nothing to follow up, the
        views are the state (a host-state bucket copies its parameters up)."""

    def local_grads(self) -> list:
        """The gradients the kernels read (local tensors of DTensor gradients);
        None where a parameter has none."""
        return self.shards.grads(self.owners, self.grad_of)

    # ------------------------------------------------------------ gradients

    def use_flat_grads(self) -> None:
        """Make every p.grad a view into one flat buffer owned by the bucket."""
        total = self.total
        self.flat_grads = torch.zeros(total, dtype=self.params[0].dtype, device=self.device) \
            if all(p.dtype == self.params[0].dtype for p in self.params) else None
        grads = self.local_grads()
        self._flat_views = []
        for i, p in enumerate(self.params):
            if self.flat_grads is not None:
                view = _dense_view(self.flat_grads, self.offsets[i], p)
            else:  # mixed param dtypes in one bucket: one buffer per parameter
                view = torch.zeros_like(p)
            if grads[i] is not None:
                view.copy_(grads[i])
            self.owners[i].grad = self.shards.wrap(view, self.owners[i])
            self._flat_views.append(view)
        self._flat_ptrs = _addresses.addresses(self._flat_views)

    def zero_flat_grads(self) -> None:
        if self.flat_grads is not None:
            self.flat_grads.zero_()
        else:
            torch._foreach_zero_(self._flat_views)

    def check_flat_grads(self) -> None:
        """Every parameter's gradient still lies in the bucket's memory:
        model.zero_grad(), ``p.grad = t`` or ``p.grad.data = t`` would leave
        backward writing where the step does not read. Two C-level passes over
        the parameters (README, "Guarantees"): the gradients' addresses, which
        tell all three apart from a gradient that still is (a view of) the
        bucket's own."""
        grads = self.local_grads()
        try:
            if _addresses.addresses(grads) == self._flat_ptrs:
                return
        except TypeError:  # a gradient set to None: named below
            pass
        flat_ptrs = _addresses.pointers(self._flat_ptrs)
        for i, (p, g) in enumerate(zip(self.owners, grads)):
            if g is None or g.data_ptr() != flat_ptrs[i]:
                what = "set to None" if g is None else "replaced"
                raise RuntimeError(
                    f"FusedAdam(flat_grads=True): the gradient of {self.names[i]} (shape {tuple(p.shape)}) was "
                    f"{what} since the last step (model.zero_grad(), p.grad = ..., p.grad.data = ...): backward no "
                    "longer writes into the optimizer's gradient buffer. With flat_grads, reset gradients with "
                    "optimizer.zero_grad() only")

    def forget_grad_addresses(self) -> None:
        """The gradients will be other tensors at the same addresses (a
        host-state staging slot seen in another dtype): check them afresh at
        the next prepare instead of trusting unchanged addresses."""
        self._grad_records = None

    def _current_grads(self) -> list | None:
        """The parameters' gradients, re-pointing the plan when they moved
        (new gradient tensors, or ``p.grad.data = t``); None when some
        parameter has no gradient this step."""
        # records: None for a missing or sparse gradient, told apart below.
        grads, records = self.shards.grads_and_records(self.owners, self.grad_of)
        # The plan holds no gradient between steps ([Note: borrowed read lists]
        # in _plan.py): tensors at the addresses the table holds may be new
        # ones, so their sizes in bytes and dtypes are compared too (equal
        # dtypes and bytes: equal element counts). Bytes alone would keep the
        # kernel inside the gradient's memory, but read a bf16 view of an
        # old fp32 gradient's memory (``p.grad.data = g.view(torch.bfloat16)``)
        # as fp32 values.
        if records is not None and records == self._grad_records:
            if self._plan is not None:
                self._plan.refresh_read_list(GRAD_LIST, grads, ptrs=self._grad_ptrs)
            return grads
        if any(map(operator.is_, grads, [None] * len(grads))):
            return None
        dtypes = self.grad_fit.check(grads)
        if records is None:
            records = _addresses.memory_records(grads)
        ptrs = _addresses.pointer_record(records)
        if self._plan is not None:
            if dtypes != self._grad_dtypes:  # the table's dtype codes are fixed: a new table
                self._plan = None
            else:
                self._plan.refresh_read_list(GRAD_LIST, grads, ptrs=ptrs)
        self._grad_ptrs, self._grad_records, self._grad_dtypes = ptrs, records, dtypes
        return grads

    # ------------------------------------------------------------ the step

    def _lists(self, idx: list[int], grads: list) -> dict:
        views = [self.views[i] for i in idx]
        params = [self.params[i] for i in idx]
        masters = [v["master_param"] for v in views] if self.master is not None else None
        full = len(idx) == len(self.params)
        return dict(
            params=masters if masters is not None else params,
            grads=[grads[i] for i in idx],
            states={name: [v[name] for v in views] for name in self.states},
            params_out=params if masters is not None else None,
            param_remainders=[v["param_remainder"] for v in views] if self.remainders is not None else None,
            scales={name: scales if full else scales[idx].clone() for name, scales in self.scales.items()},
            absmax={name: [v[f"{name}_absmax"] for v in views] for name in self.blocks},
        )

    def prepare(self) -> tuple | None:
        """Everything a step needs that can fail (gradient checks, plans), done
        before the optimizer changes anything: (plan, subset indices or None),
        or None when no parameter of the bucket has a gradient."""
        grads = self._flat_views if self._flat_views is not None else self._current_grads()
        if grads is not None:
            if self._plan is None:
                self._plan = self._rule_plan(self._lists(list(range(len(self.params))), grads), self.group_sizes)
            return self._plan, None
        # Some parameters have no gradient this step: update the others only
        # (like torch.optim), through a one-off plan.
        grads = self.local_grads()
        idx = [i for i, g in enumerate(grads) if g is not None]
        if not idx:
            return None
        self.grad_fit.check([grads[i] for i in idx], idx)
        lists = self._lists(idx, grads)
        sizes = [0] * len(self.group_sizes)
        bounds = [sum(self.group_sizes[:g + 1]) for g in range(len(self.group_sizes))]
        for i in idx:
            sizes[next(g for g, b in enumerate(bounds) if i < b)] += 1
        plan = self._rule_plan(lists, sizes)
        plan.subset_scales = lists["scales"]
        return plan, idx

    @staticmethod
    def grads_read(prepared: tuple) -> list:
        """The gradients a prepared step reads."""
        return prepared[0].lists["grads"]

    def _rule_plan(self, lists: dict, group_sizes: list[int]):
        """The rule's plan. The bucket checks its parameters and gradients every
        step (Bucket.prepare, the optimizer's _params_moved) and owns the rest."""
        return self.rule.plan(lists["params"], lists["grads"], lists["states"], params_out=lists["params_out"],
                              param_remainders=lists["param_remainders"], scales=lists["scales"],
                              absmax=lists["absmax"], group_sizes=group_sizes)

    def launch(self, prepared: tuple, hyper: dict, grad_scale, found_inf, unscale_grads: bool = False,
               rounding_seed=None) -> None:
        plan, idx = prepared
        self.rule.launch(plan, hyper, grad_scale=grad_scale, found_inf=found_inf, unscale_grads=unscale_grads,
                         rounding_seed=rounding_seed)
        if idx is None and self._flat_views is None:
            plan.release_read_list(GRAD_LIST)  # [Note: borrowed read lists] in _plan.py
        if idx is not None:
            for name, scales in self.scales.items():  # the kernel chose new scales for the subset's copy
                scales[idx] = plan.subset_scales[name]
