"""apex's DistributedFusedAdam methods around the ZeRO engine (ShardedOptimizer
in optimizer.py inherits them): starting parameters with their per-call sync
dtypes ([Note: sync classes] in _rows.py), the parameter lookups, and the late
switch to a contiguous parameter buffer."""
from __future__ import annotations

import torch

from ._agreement import check_same, validate_then_agree
from ._flat import memory_flat
from ._options import check_sync_dtypes

__all__ = ["ApexMethods"]


class ApexMethods:
    """Mixed into ShardedOptimizer: its params, layout and state are theirs."""

    @torch.no_grad()
    def init_params(self, params=None, dtype=None, grad_sync_dtype=None, param_sync_dtype=None) -> None:
        """Start the optimizer state of those of `params` (default: all) not
        started yet, from their current values (master = the parameter, the
        rule's states = 0); as apex, a parameter already started is left as
        it is. Runs by itself at the first step for parameters never
        started, so weights loaded into the model after the optimizer was
        built are used. Every rank must call it with the same parameters.
        grad_sync_dtype, param_sync_dtype: apex's per-call sync dtypes
        (None: as the parameter had them): the parameters not started yet
        move into buckets of that sync class ([Note: sync classes] in
        _rows.py; the layout is rebuilt, the started parameters' state
        carried along). dtype: the state's, which every parameter shares
        (None, or the optimizer's)."""
        self._refuse_mid_host_step("init_params()")
        if grad_sync_dtype is None and param_sync_dtype is None:
            self._check_state_dtype(dtype)
            chosen = self._not_started(params)
        else:
            chosen = self._change_sync_classes(params, dtype, grad_sync_dtype, param_sync_dtype)
        if not chosen:
            return
        self._finish_param_sync()  # the parameters' values are what the state starts from
        for f in self._shard_fragments:
            if f.param in chosen:
                flat = memory_flat(self.params[f.param].detach())
                self._write_state("master", f, flat[f.param_start:f.param_end].float())
                for state in self.states.values():
                    state[f.bucket, f.shard_start:f.shard_end].zero_()
        for k in chosen:
            self._initialized[k] = True

    def _not_started(self, params) -> set:
        """The indices of `params` (None: all) whose state has not started."""
        index = {id(p): k for k, p in enumerate(self.params)}
        if params is None:
            chosen = set(range(len(self.params)))
        else:
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            unknown = [i for i, p in enumerate(params) if id(p) not in index]
            if unknown:
                raise ValueError(f"init_params: params[{unknown[0]}] is not a trainable parameter of this optimizer")
            chosen = {index[id(p)] for p in params}
        return {k for k in chosen if not self._initialized[k]}

    def _check_state_dtype(self, dtype) -> None:
        if dtype is not None and dtype != self.dtype:
            raise NotImplementedError(
                f"init_params(dtype={dtype}): the optimizer state has one dtype for every parameter, "
                f"dtype={self.dtype}: build a second optimizer for the parameters that need another one")

    def _change_sync_classes(self, params, dtype, grad_sync_dtype, param_sync_dtype) -> set:
        """init_params with sync dtypes: give the parameters of `params` not
        started yet these sync dtypes, rebuilding the layout if any class
        changed, and return them. Every rank must ask the same: the checks
        run on every rank and the ranks agree on the verdicts and on the
        request before anything changes."""
        def check() -> tuple[set, dict]:
            self._check_state_dtype(dtype)
            check_sync_dtypes(grad_sync_dtype, param_sync_dtype)
            chosen = self._not_started(params)
            classes = dict(self._sync_class)
            for k in chosen:
                grad, param = classes[id(self.params[k])]
                classes[id(self.params[k])] = (grad_sync_dtype or grad, param_sync_dtype or param)
            if classes != self._sync_class:
                self._check_sync_classes(classes)
                self._check_copy_engine(classes)
            return chosen, classes

        name = f"{type(self).__name__}.init_params"
        chosen, classes = validate_then_agree(name, check, self.group, self.device, outcome="nothing changed")
        order = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        request = [("the parameters not started yet (param_groups order)",
                    tuple(sorted(order[id(self.params[k])] for k in chosen))),
                   ("grad_sync_dtype", repr(grad_sync_dtype)), ("param_sync_dtype", repr(param_sync_dtype))]
        check_same(f"{name}: the {{ranks}} ranks asked for different sync dtypes: {{difference}}. Every rank must "
                   "call it alike (nothing changed)", request, self.group, self.device)
        if classes != self._sync_class:
            self._land_param_sync()
            self._sync_class = classes
            self._rebuild_layout(self.params, self.param_groups_of)
        return chosen

    def init_params_bucket(self, params, dtype=None, grad_sync_dtype=None, param_sync_dtype=None) -> None:
        """apex's call for initialising a set of parameters into buckets of
        their own: here init_params(params) (the bucket layout follows the
        backward order, or the parameter order without overlap_grad_sync)."""
        self.init_params(params, dtype, grad_sync_dtype, param_sync_dtype)

    def parameters(self):
        """Every parameter of every group, in param_groups order (apex)."""
        for group in self.param_groups:
            yield from group["params"]

    def parameter(self, *where) -> torch.Tensor:
        """apex's lookup: parameter(group_id, param_id) is
        param_groups[group_id]["params"][param_id]; parameter(fragment) the
        parameter of a fragment (one with param_group_id / param_id, as
        apex's, or a layout fragment of this optimizer)."""
        if len(where) == 2:
            group_id, param_id = where
        elif len(where) == 1 and hasattr(where[0], "param_group_id"):
            group_id, param_id = where[0].param_group_id, where[0].param_id
        elif len(where) == 1 and isinstance(getattr(where[0], "param", None), int):
            return self.params[where[0].param]
        else:
            raise TypeError("parameter() takes (group_id, param_id) or one fragment")
        return self.param_groups[group_id]["params"][param_id]

    def init_param_buffer(self) -> None:
        """apex's late switch to contiguous_param_buffer=True: the parameters
        become views of one buffer laid out as the buckets, so the all-gather
        lands in them in place. The state so far is carried over. Every rank
        must call it; best before the first step (the switch gathers the
        state once)."""
        if self.contiguous_param_buffer:
            return
        self._check_buffer_dtypes("contiguous_param_buffer", self._sync_class, 1)
        self._land_param_sync()
        self.contiguous_param_buffer = True
        self._rebuild_layout(self.params, self.param_groups_of)
