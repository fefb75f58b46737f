"""The engine's layout: the parameters checked and broadcast at construction,
then, for a parameter order, the buckets, shards, buffers, stored state, the
rule's plan and the sync objects; rebuilt (state carried along) when the
first backward shows its order or the sync classes change.
ShardedOptimizer (optimizer.py) inherits these methods; the end of every
build is its named point _track_layout() (hooks and guards)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .. import _storage, kernels
from .._dtensor import refuse_sharded_params
from .._pinned import pin
from .._torch import check_tensor
from . import _host_shards
from ._agreement import check_same_setup
from ._nccl_ub import RegisteredPool, check_nccl_ub
from ._options import PARAM_DTYPES, resolve_store_params, storage_spec, sync_class
from ._peer_gather import PeerParamGather
from ._peer_reduce import PeerGradReduce
from ._rows import BucketRows
from ._sync import GradSync, ParamSync
from .layout import BucketLayout

__all__ = ["LayoutBuild"]


class LayoutBuild:
    """Mixed into ShardedOptimizer: its options and parameters are theirs."""

    def _build(self, grad_sync_dtype, param_sync_dtype, device) -> None:
        refuse_sharded_params(type(self).__name__, self.param_groups)  # FSDP2's DTensors: use FusedAdam
        check_same_setup(self, grad_sync_dtype, param_sync_dtype, device)  # every rank alike, before any broadcast
        params, groups = [], []
        for gi, g in enumerate(self.param_groups):
            for i, p in enumerate(g["params"]):
                check_tensor(f"param_groups[{gi}]['params'][{i}]", p, p.device, PARAM_DTYPES)
                if p.requires_grad:
                    params.append(p)
                    groups.append(gi)
        if not params:
            raise ValueError(f"{type(self).__name__} needs at least one parameter with requires_grad=True")
        self.device = torch.device(device) if device is not None else params[0].device
        if self.capturable and self.device.type != "cuda":
            raise ValueError(f"capturable=True needs CUDA parameters and an NCCL process group (parameters on "
                             f"{self.device}): a CPU step cannot be captured in a CUDA graph")
        if self.nccl_ub:
            check_nccl_ub(self.dist_group, self.device)
        if any(p.device != self.device for p in params):
            raise ValueError(f"every parameter must be on {self.device}")
        # [Note: host shards] (_host_shards.py): on a CPU device the state is in host memory anyway.
        self._host_pipeline = self.state_device == "cpu" and _host_shards.runs_pipeline(self.device)
        self.params = params
        # Each parameter's (grad_sync_dtype, param_sync_dtype): [Note: sync classes] (_rows.py).
        self._sync_class = {id(p): sync_class(p.dtype, grad_sync_dtype, param_sync_dtype) for p in params}
        self._check_sync_classes(self._sync_class)
        # The constructor's sync dtypes, as apex keeps them: None where the parameters' own dtypes differ.
        classes = set(self._sync_class.values())
        only = next(iter(classes)) if len(classes) == 1 else (None, None)
        self.grad_sync_dtype, self.param_sync_dtype = grad_sync_dtype or only[0], param_sync_dtype or only[1]
        self._check_copy_engine()
        # With capturable=True the count stays on the device (no host sync), as the step counters do.
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=self.device) if self.capturable else 0
        self._src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        for g in self.param_groups:
            if self.capturable:  # read by the kernels on the device: graphs replay with the current values
                g["lr"] = torch.as_tensor(g["lr"], dtype=torch.float32, device=self.device).clone().reshape(())
                g["step"] = torch.as_tensor(g.get("step", 0), dtype=torch.int64, device=self.device).clone().reshape(())
            else:
                g.setdefault("step", 0)
        for g in self.param_groups:  # every rank starts from rank 0's values, frozen ones included
            for p in g["params"]:
                dist.broadcast(p.data, src=self._src, group=self.group)
        return params, groups

    def _check_sync_classes(self, classes: dict) -> None:
        """What the storage options ask of the parameters' sync classes
        (classes: id(parameter) -> (grad_sync_dtype, param_sync_dtype))."""
        if self.store_param_remainders:
            wrong = sorted({f"{p.dtype} parameters synchronised in {classes[id(p)][1]}" for p in self.params
                            if (p.dtype, classes[id(p)][1]) != (torch.bfloat16, torch.bfloat16)})
            if wrong:
                raise ValueError(f"store_param_remainders=True needs bf16 parameters synchronised in bf16 (found "
                                 f"{', '.join(wrong)}): the bf16 parameter is the high half of the fp32 master")
        for option, side in (("contiguous_param_buffer", 1), ("contiguous_grad_buffer", 0)):
            if getattr(self, option):
                self._check_buffer_dtypes(option, classes, side)

    def _check_buffer_dtypes(self, option: str, classes: dict, side: int) -> None:
        """Parameters (side 1) or gradients (side 0) become views of a buffer
        in their sync dtype: it must be the parameter's own."""
        names = ("grad_sync_dtype", "param_sync_dtype")
        wrong = sorted({f"{p.dtype} with {names[side]}={classes[id(p)][side]}" for p in self.params
                        if p.dtype != classes[id(p)][side]})
        if wrong:
            raise ValueError(f"{option}=True needs every trainable parameter in its {names[side]} (the buffer "
                             f"holds it in that dtype), found {', '.join(wrong)}: convert the model or set the sync "
                             f"dtype to the parameters' dtype")

    def _copy_engine_missing(self, option: str, classes: dict | None = None) -> list[str]:
        """What the options lack for the copy engines in one direction
        (grad_sync_copy_engine or param_sync_copy_engine; empty: nothing),
        with these sync classes (default: the parameters')."""
        return [why for why, bad in (
            ("one grad_sync_dtype and one param_sync_dtype for every parameter (a single bucket key)",
             len(set((classes or self._sync_class).values())) > 1),
            ("CUDA parameters", self.device.type != "cuda"),
            ("an NCCL distributed_process_group", "nccl" not in str(dist.get_backend(self.dist_group))),
            ("contiguous_param_buffer=True (peers write into that buffer)",
             option == "param_sync_copy_engine" and not self.contiguous_param_buffer),
            ("capturable=False (captured collectives stay on NCCL)", self.capturable)) if bad]

    def _check_copy_engine(self, classes: dict | None = None) -> None:
        """grad_sync_copy_engine / param_sync_copy_engine=True ask for what
        only some setups allow: say which part is missing."""
        for option in ("grad_sync_copy_engine", "param_sync_copy_engine"):
            value = getattr(self, option)
            if value not in (None, True, False):
                raise ValueError(f"{option} must be None (where possible), True (required) or False (NCCL), "
                                 f"got {value!r}")
            missing = self._copy_engine_missing(option, classes) if value else []
            if missing:
                raise ValueError(f"{option}=True needs " + ", ".join(missing) +
                                 "; leave it None to use the copy engines only where they apply")

    def _copy_engine_connect(self, option: str, connect):
        """connect() (a collective over the distributed group) where the
        option and setup allow the copy engines, else None (NCCL)."""
        if getattr(self, option) is False or self._copy_engine_missing(option):
            return None
        peer = connect()
        if peer is None and getattr(self, option) and self.dist_size > 1:
            raise RuntimeError(f"{option}=True, but the ranks of distributed_process_group cannot map each "
                               "other's memory (ranks on several hosts, GPUs without peer access, a driver "
                               "without stream memory operations, or PYTORCH_CUDA_ALLOC_CONF with "
                               "expandable_segments): leave it None to fall back to NCCL")
        return peer

    def _close_syncs(self) -> None:
        """Land the collectives in flight and let go of the sync objects. A
        method of its own so that no local variable of _build_layout keeps an
        old sync, and through it the old parameter buffer, alive while the new
        buffers are allocated (it did: 4 bytes per parameter more at the
        rebuild of the first step)."""
        for name in ("_grad_sync", "_param_sync"):
            sync = getattr(self, name, None)
            if sync is not None:
                sync.close()
            setattr(self, name, None)

    def _grads_to_host(self) -> dict:
        """[Note: gradients through host memory at a rebuild] The first step
        rebuilds a contiguous gradient buffer in backward's order, and the
        gradients the first backward left in the old buffer must reach the new
        one. Kept on the device, the old buffer lived until the new one was
        filled: with the parameter buffer's own move, one whole buffer of
        transient at the first step (2.64 GiB for GPT-1.4B with 8-bit states,
        benchmarks/RESULTS.md, "Memory per phase"). On a GPU they wait in host
        memory instead (one copy down and up, once), so the old buffer is gone
        before any new one is allocated. Returns id(param) -> host gradient;
        the parameters' .grad are then None until the new buffer is attached."""
        if getattr(self, "grad_buffer", None) is None or self.device.type != "cuda":  # none yet at construction
            return {}
        staged = {}
        for p in self.params:
            if p.grad is not None:
                staged[id(p)] = p.grad.detach().to("cpu")
                p.grad = None
        return staged

    def _build_layout(self, params: list, groups_of: list) -> None:
        """Buckets, shards, buffers, the fused plan, the sync objects and hooks
        for the parameters in this order: bucket 0 takes params[0], and the
        order buckets start in is the order gradients should arrive in."""
        # A rebuild lets go of the old layout's buffers first: the new ones are
        # as large, and both at once would raise peak memory by the whole state.
        self._close_syncs()
        staged_grads = self._grads_to_host()  # [Note: gradients through host memory at a rebuild]
        self.plan = self._host = None
        self.grad_shards = self.master = self.remainders = self.states = self.state_blocks = None
        self.param_shards = self.param_buffer = self.grad_buffer = None
        self._grad_views, self._norm_plan, self._subset_norm_plans = None, None, {}
        self.params = params
        self.param_groups_of = groups_of
        # One bucket key per sync class, all of one bucket size ([Note: sync classes] in _rows.py).
        classes = [self._sync_class[id(p)] for p in params]
        key_of = {c: key for key, c in enumerate(dict.fromkeys(classes))}
        grad_dtypes = {key: c[0] for c, key in key_of.items()}
        param_dtypes = {key: c[1] for c, key in key_of.items()}
        elem = max(torch.empty((), dtype=d).element_size() for d in grad_dtypes.values())
        self.layout = BucketLayout([p.numel() for p in self.params], [key_of[c] for c in classes],
                                   self.dist_size, self.bucket_cap_mb, dict.fromkeys(grad_dtypes, elem))
        self.shard_size, self.bucket_size = self.layout.shard_size(0), self.layout.bucket_size(0)
        n_buckets = len(self.layout.buckets)
        dev = self.device
        if self._nccl_pool is not None:
            self._nccl_pool.close()
        self._nccl_pool = RegisteredPool(self.dist_group, dev) if self.nccl_ub else None
        own = slice(self.rank * self.shard_size, (self.rank + 1) * self.shard_size)
        # The peers map this rank's memory before the parameters move in: a refusal leaves them as they were.
        reduce = self._copy_engine_connect("grad_sync_copy_engine", lambda: PeerGradReduce.connect(
            self.shard_size, grad_dtypes[0], dev, self.dist_group, timeout=self.copy_engine_timeout))
        gather = None
        if self.contiguous_param_buffer:
            self.param_buffer, views = self._bucket_views(param_dtypes)
            gather = self._copy_engine_connect(  # one sync class: the buffer is one tensor
                "param_sync_copy_engine", lambda: PeerParamGather.connect(self.param_buffer.single, self.dist_group,
                                                                     timeout=self.copy_engine_timeout))
            with torch.no_grad():
                for p, view in zip(self.params, views):
                    view.copy_(p.data)
                    p.data = view
        if self.contiguous_grad_buffer:
            with self._nccl_pool.allocate() if self.nccl_ub else contextlib.nullcontext():
                self.grad_buffer, self._grad_views = self._bucket_views(grad_dtypes)
            if self.nccl_ub:
                self._nccl_pool.register()
            for p, view in zip(self.params, self._grad_views):  # gradients so far move along
                grad = staged_grads.get(id(p), p.grad)
                if grad is not None:
                    view.copy_(grad)
            self._attach_grad_views()
        # Persistent: this rank's shards only. Full-size bucket buffers exist
        # only while their collective runs (at most pipeline_size at a time).
        # [Note: reduced shards in the gradient buffer]: with a contiguous
        # gradient buffer reduced by a collective, each bucket is
        # reduce-scattered in place (NCCL and gloo take an output that is the
        # input's own piece), so the reduced shard is this rank's part of the
        # buffer and costs no memory of its own; the buffer then holds it
        # until zero_grad() (Grads.CONSUMED in _iteration.py). The copy
        # engines sum into shards of their own.
        self.grads_in_buffer = self.grad_buffer is not None and reduce is None
        if self.grads_in_buffer:
            self.grad_shards = self.grad_buffer.columns(own)
        else:
            with self._nccl_pool.allocate() if self.nccl_ub else contextlib.nullcontext():
                self.grad_shards = BucketRows.allocate(self.layout.buckets, self.shard_size, grad_dtypes, dev)
        # This rank's pieces, ordered by group so that one launch covers them
        # all; with host state by bucket first, a plan per bucket ([Note: host shards]).
        host = self._host_pipeline
        state_dev = torch.device("cpu") if host else dev
        shard = sorted(self.layout.shard_fragments(self.rank),
                       key=lambda f: (f.bucket if host else 0, self.param_groups_of[f.param]))
        # The master and the rule's states in dtype; with_scaled_states and
        # fp16: each fragment with its own power-of-two scale, rescaled
        # inside the kernel (_options.py). With remainders the
        # fp32 master is the bf16 parameter shard (its high half) plus int16
        # low halves: 2 bytes per parameter instead of 4.
        self.store_params = resolve_store_params(self._store_params_option, self.dtype, self.store_param_remainders,
                                                 self.with_scaled_states, param_dtypes.values(),
                                                 self.rounding_seed is not None)
        spec = storage_spec(self.rule, self.dtype, self.store_params, self.store_param_remainders,
                            self.with_scaled_states, self.state_dtypes)
        fragment_sizes = [f.shard_end - f.shard_start for f in shard]
        stored = spec.allocate(self.rule, (n_buckets, self.shard_size), len(shard), state_dev,
                               sum(map(_storage.blocks_of, fragment_sizes)))
        self.shard_state_device = state_dev  # where this rank's shard of the state lives
        self.states, self.master, self.remainders = stored.states, stored.master, stored.remainders
        self.state_scales = stored.scales
        # Blockwise states: each fragment's block maxima, a slice of one flat buffer per state.
        self.state_blocks = {name: _storage.block_views(flat, fragment_sizes) for name, flat in stored.blocks.items()}
        # What the all-gather sends: a slice of the contiguous parameter buffer,
        # the master itself when every bucket's param_sync_dtype is the
        # master's (fp32 model: no separate copy), or shards the kernel writes
        # (params_out) besides the master.
        # With host state, these are the host rows the step writes, and the
        # all-gather sends device rows of their own (sent_shards).
        if self.param_buffer is not None and not host:
            self.param_shards = self.param_buffer.columns(own)
        elif (self.master is not None and set(param_dtypes.values()) == {self.master.dtype}
              and "master" not in self.state_scales):
            self.param_shards = BucketRows.of(self.master)
        else:
            self.param_shards = BucketRows.allocate(self.layout.buckets, self.shard_size, param_dtypes, state_dev)
        sent_shards = self.param_shards
        if host:
            for t in self.param_shards.tensors:  # what goes up to the GPU
                pin(t, dev)
            sent_shards = (self.param_buffer.columns(own) if self.param_buffer is not None
                           else BucketRows.allocate(self.layout.buckets, self.shard_size, param_dtypes, dev))
        self.separate_param_shards = self.master is not None and self.param_shards.single is not self.master
        self._state_names = ("master",) + self.rule.states
        self._shard_fragments = shard
        self._shard_fragments_by_bucket = [[] for _ in self.layout.buckets]
        for f in shard:
            self._shard_fragments_by_bucket[f.bucket].append(f)
        # Masters are taken from the parameters at the first step (or
        # init_params()), so model weights loaded after construction count.
        self._initialized = [False] * len(self.params)
        self._fragment_index = {(f.bucket, f.shard_start): j for j, f in enumerate(shard)}
        if host:
            host_grads = _host_shards.host_rows(self.layout.buckets, self.shard_size, grad_dtypes, dev)
            self._host = _host_shards.HostShards(dev, self.grad_shards, host_grads, self.param_shards, sent_shards,
                                                 self._host_threads)
            self.plan = [self._plan_over(frags, host_grads, state_dev) if frags else None
                         for frags in self._shard_fragments_by_bucket]
        else:
            self.plan = self._plan_over(shard, self.grad_shards, dev)
        self._grad_sync = GradSync(self.params, self.layout, self.grad_shards, self.dist_group, self.pipeline_size,
                                   self.redundant_group, self.grad_buffer, self._grad_views, reduce,
                                   on_reduced=self._host.grads_reduced if host else None)
        self._param_sync = ParamSync(self.params, self.layout, sent_shards, self.param_buffer, self.dist_group,
                                     gather)
        self._track_layout()

    def _plan_over(self, frags: list, grads: BucketRows, device: torch.device) -> kernels.TensorPlan:
        """The rule's plan over consecutive fragments of this rank's shard
        (in shard order), reading the gradients from `grads`. Views of this
        optimizer's own buffers, which never move: the plan does not re-check
        their addresses."""
        first = self._fragment_index[(frags[0].bucket, frags[0].shard_start)] if frags else 0
        chosen = slice(first, first + len(frags))
        sizes = [0] * len(self.param_groups)
        for f in frags:
            sizes[self.param_groups_of[f.param]] += 1
        pieces = [(f.bucket, f.shard_start, f.shard_end) for f in frags]
        updated = self.master if self.master is not None else self.param_shards
        return self.rule.plan(
            [updated[b, s:e] for b, s, e in pieces], [grads[b, s:e] for b, s, e in pieces],
            {name: [t[b, s:e] for b, s, e in pieces] for name, t in self.states.items()},
            params_out=[self.param_shards[b, s:e] for b, s, e in pieces] if self.separate_param_shards else None,
            param_remainders=[self.remainders[b, s:e] for b, s, e in pieces] if self.store_param_remainders else None,
            scales={name: t[chosen] for name, t in self.state_scales.items()},
            absmax={name: views[chosen] for name, views in self.state_blocks.items()}, group_sizes=sizes,
            device=device)

    def _adopt_backward_order(self) -> None:
        """Rebuild the layout in the order the first backward produced gradients
        (rank 0's, so that every rank has the same layout): buckets then
        complete, and start, while backward goes on. Runs at the first step,
        before state exists (or carrying it through a portable state dict)."""
        order = self._probe.take(len(self.params))
        agreed = torch.tensor(order, dtype=torch.int64, device=self.device)
        dist.broadcast(agreed, src=self._src, group=self.group)
        order = agreed.tolist()
        if order == list(range(len(self.params))):
            return
        self._rebuild_layout([self.params[k] for k in order], [self.param_groups_of[k] for k in order])

    def _rebuild_layout(self, params: list, groups_of: list) -> None:
        """_build_layout anew, carrying the state of the parameters already
        started through a portable state dict (the pieces move); the others
        still start from their values at their first step."""
        started = {id(p) for p, done in zip(self.params, self._initialized) if done}
        saved = self._portable_state_dict(gather_on_root=False) if started else None  # no user hooks
        self._build_layout(params, groups_of)
        if saved is None:
            return
        order = [id(p) for g in self.param_groups for p in g["params"]]  # the state dict's keys
        saved["state"] = {k: entry for k, entry in saved["state"].items() if order[k] in started}
        self._load(lambda: saved)

    def _bucket_views(self, dtype_of_key: dict) -> tuple[BucketRows, list]:
        """A zeroed buffer laid out like the buckets (each in its key's dtype),
        and a view of it shaped (and strided: channels_last kept) like each
        parameter: a parameter's fragments follow each other in its key's
        tensor ([Note: sync classes] in _rows.py)."""
        buffer = BucketRows.allocate(self.layout.buckets, self.bucket_size, dtype_of_key, self.device)
        first = {}
        for f in self.layout.fragments:
            first.setdefault(f.param, f)
        views = []
        for k, p in enumerate(self.params):
            f = first.get(k)
            if f is None:  # no elements, so no bucket: a view of nothing
                views.append(torch.empty(p.shape, dtype=p.dtype, device=self.device))
                continue
            row = buffer[f.bucket]
            views.append(row.as_strided(p.shape, p.stride(), row.storage_offset() + f.bucket_start))
        return buffer, views

    def _attach_grad_views(self) -> None:
        for p, view in zip(self.params, self._grad_views):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view

    def grad_buffer_view(self, param: torch.Tensor) -> torch.Tensor:
        """param's gradient inside the contiguous gradient buffer (a view
        shaped like param; what autograd accumulates into)."""
        if not self.contiguous_grad_buffer:
            raise RuntimeError(f"grad_buffer_view needs {type(self).__name__}(contiguous_grad_buffer=True); "
                               "without it gradients live in temporary buckets")
        for p, view in zip(self.params, self._grad_views):
            if p is param:
                return view
        raise ValueError("grad_buffer_view: not a trainable parameter of this optimizer")
