"""The ZeRO-2 engine over torch.distributed, for any update rule.

DistributedFusedAdam (adam.py) and DistributedFusedLion (lion.py) are this
engine with their rule ([Note: update rules] in _rules.py) and constructors.
Optimizer state and reduced gradients are sharded across the ranks of the
(distributed) process group; parameters stay replicated. An iteration:

1. during backward, each parameter's gradient is copied into flat buckets (the
   bucket layout comes from the core, in grad_sync_dtype; or autograd
   accumulates straight into them with contiguous_grad_buffer) and each
   complete bucket is reduce-scattered while backward goes on
   (overlap_grad_sync; otherwise all of it happens in step()): each rank
   receives the sum of its shard of every bucket (distributed/_sync.py; on
   the copy engines between GPUs of one host, grad_sync_copy_engine,
   _peer_reduce.py);
2. step(): one fused launch of the rule's kernel updates the rank's shard of
   every bucket (fp32 master and the rule's states, e.g. Adam's exp_avg and
   exp_avg_sq; per-fragment group hyperparameters;
   averaging, loss-scale and clipping folded into its gradient scale) and
   writes the new parameter values, in param_sync_dtype, into the rank's
   parameter shards;
3. the parameter shards are all-gathered bucket by bucket into the parameters
   (in place with contiguous_param_buffer), during the next forward with
   overlap_param_sync; between GPUs of one host a contiguous buffer is
   all-gathered on the copy engines (param_sync_copy_engine, _peer_gather.py).

With average_grad_sync=True the result equals DDP + the rule's torch
optimizer (torch.optim.AdamW for Adam) on the same global batch. capturable=True keeps lr and
step in device tensors and decides skipped steps on the device, so a whole
iteration can be captured in a CUDA graph. The state is stored in `dtype`
(fp32, fp16 or bf16) as distributed/_options.py says.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import operator
import weakref
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from .. import kernels
from .._groups import check_step_groups, pack_groups, param_names, plain_value, run_closure, set_group_values
from .._rounding import refuse_masters, rounding_seed
from .._rules import UpdateRule
from .. import _storage
from .._dtensor import refuse_sharded_params
from .._host_state import host_state_wanted, host_step_threads
from .._optimizer_copies import refuse_copy
from .._state_dict_hooks import run_load_post_hooks, state_dict_through_hooks, through_load_pre_hooks
from .._pinned import pin
from .._torch import check_tensor
from .._tracked import DATA_PTR, GRAD, REQUIRES_GRAD, VERSION, ReplacedParams, moved_indices
from .._state_dict_check import check_state_dict
from . import _amp, _apex_format, _host_shards, _watchdog, sharded_checkpoint
from ._apex_methods import ApexMethods
from ._agreement import check_same_setup, validate_then_agree
from ._first_use import FirstUseGuard
from ._nccl_ub import RegisteredPool, check_nccl_ub
from ._options import (PARAM_DTYPES, check_storage_options, check_sync_dtypes, resolve_store_params, state_dtypes,
                       storage_spec, sync_class)
from ._iteration import BackwardOrderProbe, Grads, Iteration, Params
from ._peer_gather import PeerParamGather
from ._peer_reduce import PeerGradReduce
from ._flat import flat_like, memory_flat
from ._rows import BucketRows
from ._sync import GradSync, ParamSync
from .layout import BucketLayout

__all__ = ["ShardedOptimizer"]

_log = logging.getLogger("shardadam")

# torch 2.13 renamed the flat-tensor collectives; older releases have only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# What the refusals of a change after backward's hand-over say ([Note: gradients set after the hand-over]).
_CHANGE_BEFORE_HAND_OVER = ("change gradients before the hand-over, with a tensor hook (p.register_hook), or build "
                            "the optimizer with overlap_grad_sync=False")
_BUFFER_WRITTEN = ("the contiguous gradient buffer was written in place after backward handed the gradients over "
                   "(torch.nn.utils.clip_grad_norm_, zero_grad(set_to_none=False) or another in-place change of a "
                   "p.grad)")


# [Note: the newest optimizer takes the gradients] An optimizer built over
# parameters that an older DistributedFusedAdam still alive holds (an LR
# scheduler or a trainer may keep the old one after the user built a new
# one) takes their gradient hand-over: the old one's hooks would otherwise
# take each gradient first and leave the new one None (an AttributeError
# deep in its step, or zeros). Each parameter maps to the newest optimizer
# built over it (looked up once, when a layout is built); an older one that
# held any of them is marked: its hooks hand nothing over from then on, and
# its step() refuses to run, naming a parameter.
_HANDED_TO = WeakIdKeyDictionary()  # parameter -> weakref.ref(optimizer): keyed by identity (tensors compare by value)


def _grad_ready(optimizer: weakref.ref, k: int, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of parameter k: hand the gradient over."""
    opt = optimizer()
    if opt is None or opt._taken_by_newer:  # [Note: the newest optimizer takes the gradients]
        return
    if opt._probe.active:
        # the first iteration synchronises in step(), in the order learnt here
        opt._probe.record(k, synchronised=not opt.iteration.no_sync)
    elif not opt.iteration.no_sync:
        opt._leave_consumed([k])
        opt.iteration.move_grads(Grads.REDUCING)
        if opt.iteration.host_step is None and opt.host_step_in_backward:
            opt._arm_host_step()
        opt._grad_sync.pack(k, param.grad)
        if opt.contiguous_grad_buffer:
            param.grad = opt._grad_views[k]
            opt._buffer_version = opt._grad_buffer_version()  # [Note: gradients set after the hand-over]
        else:
            param.grad = None


# Modules whose forward reads a child's parameters without calling the child
# (MultiheadAttention uses out_proj.weight directly): they wait for their
# children's parameters too.
_READS_CHILD_PARAMS = (torch.nn.MultiheadAttention,)


# [Note: hooks outside compiled graphs] The forward-pre hook waits on
# collectives and swaps the first-use guard's classes: host work that must run
# at every call, not once when dynamo traces the module. Traced, inductor
# failed inside it (InternalTorchDynamoError: KeyError in the guard's
# bookkeeping) and aot_eager broke the graph wherever it met untraceable code.
# Disabled for the compiler, it runs eagerly before each module's compiled
# piece: a compiled model trains as the eager one, with a graph break per
# module whose forward runs the hook (tests/test_compile.py).
@torch.compiler.disable
def _wait_for_own_params(optimizer: weakref.ref, module: torch.nn.Module, args) -> None:
    """Module forward-pre hook: wait for the all-gathers of this module's parameters."""
    opt = optimizer()
    if opt is not None and opt.iteration.params is not Params.CURRENT:
        opt._make_current(list(module.parameters(recurse=isinstance(module, _READS_CHILD_PARAMS))))


class _Hooks:
    """The optimizer's hook handles: on the parameters (post-accumulate-grad)
    and on every module's forward; and its first-use guard, whose armed
    parameters get their classes back when the optimizer goes.

    [Note: hooks die with their optimizer] They are removed by a
    weakref.finalize of the optimizer, not by a __del__: a __del__ also runs
    for objects that share the optimizer's __dict__ (Lightning's
    LightningOptimizer subclasses the optimizer's class and copies its
    __dict__), and such a wrapper, when freed, would remove the hooks of the
    optimizer still training: backward would stop handing gradients over and
    forward would stop waiting for the all-gathers."""

    def __init__(self):
        self.grad: list = []
        self.forward = None
        self.first_use = None

    def remove_grad(self) -> None:
        for handle in self.grad:
            handle.remove()
        self.grad = []

    def remove(self) -> None:
        self.remove_grad()
        if self.forward is not None:
            self.forward.remove()
            self.forward = None
        if self.first_use is not None:
            self.first_use.disarm_all()


def _unflatten(param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of flat_like, allocated before it is filled: an uninitialised
    fp32 CPU tensor shaped (and laid out) like param, and its 1-D view in
    memory order, into which state_dict() copies each fragment once."""
    t = torch.empty_like(param, dtype=torch.float32, device="cpu")
    return t, memory_flat(t)


class ShardedOptimizer(ApexMethods, torch.optim.Optimizer):
    """ZeRO-2 with sharded state, on NCCL (GPU) or gloo (CPU), for the update
    rule its subclass (a constructor) passes; DistributedFusedAdam's
    docstring (adam.py) says what every rank passes and how gradients are
    handed over.
    """

    def __init__(self, params, defaults: dict, rule: UpdateRule, *, dtype=torch.float32, grad_sync_dtype=None,
                 param_sync_dtype=None, device=None, process_group=None, distributed_process_group=None,
                 redundant_process_group=None, average_grad_sync=True, overlap_grad_sync=True,
                 overlap_param_sync=False, bucket_cap_mb=100, pipeline_size=2, contiguous_param_buffer=False,
                 contiguous_grad_buffer=False, store_params=None, store_param_remainders=False,
                 with_scaled_states=False, nccl_ub=False, capturable=False, grad_sync_copy_engine=None,
                 param_sync_copy_engine=None, skip_nonfinite_grads=False,
                 copy_engine_timeout=_watchdog.DEFAULT_TIMEOUT_S, bf16_stochastic_round=False,
                 stochastic_round_seed=None, exp_avg_dtype=None, exp_avg_sq_dtype=None, state_device=None,
                 host_step_in_backward=False):
        name = type(self).__name__
        self.rule = rule

        def arguments() -> None:
            if not (isinstance(pipeline_size, int) and pipeline_size >= 1):
                raise ValueError(f"pipeline_size must be an int >= 1 (buckets in flight), got {pipeline_size!r}")
            check_storage_options(dtype, store_params, store_param_remainders, with_scaled_states)
            refuse_masters(bf16_stochastic_round, store_params=store_params is True,
                           store_param_remainders=store_param_remainders, with_scaled_states=with_scaled_states)
            self.rounding_seed = rounding_seed(bf16_stochastic_round, stochastic_round_seed)
            given = dict(exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype)
            self.state_dtypes = state_dtypes(rule, **given)  # each state's storage where not `dtype`
            check_sync_dtypes(grad_sync_dtype, param_sync_dtype)
            if nccl_ub and not contiguous_grad_buffer:
                raise ValueError("nccl_ub=True needs contiguous_grad_buffer=True (as apex): the NCCL-registered "
                                 "memory is the persistent gradient buffer")
            if nccl_ub and grad_sync_copy_engine:
                raise ValueError("nccl_ub=True registers the buffers for NCCL's reduce-scatter: leave "
                                 "grad_sync_copy_engine None (or False)")
            if not bucket_cap_mb > 0:
                raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
            rule.check_group(name, defaults)
            self.state_device = "cpu" if host_state_wanted(state_device, capturable=capturable) else None
            # [Note: host step threads] (read here: a bad SHARDADAM_HOST_THREADS refuses on every rank alike)
            self._host_threads = host_step_threads() if self.state_device else None
            _host_shards.check_host_step_in_backward(host_step_in_backward, state_device=self.state_device,
                                                     overlap_grad_sync=overlap_grad_sync,
                                                     skip_nonfinite_grads=skip_nonfinite_grads)
            torch.optim.Optimizer.__init__(self, params, defaults)
            _watchdog.validate_timeout(copy_engine_timeout)

        # The checks each rank makes alone come first, and their verdicts are
        # shared before any other collective: a rank that refuses its
        # arguments (or its parameters) never leaves its peers waiting in
        # the next one, and every rank raises the same message.
        if dist.is_initialized():
            validate_then_agree(f"{name}(...)", arguments, process_group, None,
                                outcome="no rank built the optimizer")
        else:
            arguments()  # no peers to tell (the missing process group is refused below)
        self.capturable = capturable
        # Opt-in (as Megatron's check_for_nan_in_grad, but skipping instead of
        # raising): a step whose reduced gradients hold inf/NaN on any rank is
        # skipped on every rank; skipped_steps counts them.
        self.skip_nonfinite_grads = bool(skip_nonfinite_grads)
        # [Note: host step in backward] (_host_shards.py), checked above.
        self.host_step_in_backward = bool(host_step_in_backward)
        # Seconds a copy-engine wait on a peer may last before every rank
        # still alive raises (distributed/_watchdog.py), as NCCL's timeout.
        self.copy_engine_timeout = _watchdog.validate_timeout(copy_engine_timeout)  # checked above
        self._replaced = ReplacedParams(type(self).__name__)
        # None stays None (the default group, looked up per call): holding the
        # WORLD object would keep it alive past destroy_process_group(), and
        # gloo can abort when it is torn down at interpreter exit.
        self.group = process_group
        self.world_size = dist.get_world_size(self.group)
        # Sharding: state is split over the distributed group and repeated
        # over the redundant group (apex's layout: world = distributed x redundant).
        self.dist_group = distributed_process_group if distributed_process_group is not None else process_group
        self.redundant_group = redundant_process_group
        self.dist_size = dist.get_world_size(self.dist_group)
        self.rank = dist.get_rank(self.dist_group)
        redundant_size = dist.get_world_size(redundant_process_group) if redundant_process_group is not None else 1
        if self.dist_size * redundant_size != self.world_size:
            raise ValueError(f"distributed_process_group ({self.dist_size} ranks) x redundant_process_group "
                             f"({redundant_size} ranks) must cover process_group ({self.world_size} ranks)")
        # Checked above (_options.py): the state's dtype and how the master is stored.
        self.dtype = dtype
        self.store_param_remainders = store_param_remainders
        self.with_scaled_states = with_scaled_states
        # store_params=False: no master of its own; the rule updates the
        # parameter shard in param_sync_dtype (lossy below fp32, unlike
        # remainders). None: resolved per layout (resolve_store_params).
        self._store_params_option = self.store_params = store_params
        self.nccl_ub = nccl_ub
        self._nccl_pool = None
        self.average_grad_sync = average_grad_sync
        self.overlap_grad_sync = overlap_grad_sync
        self.overlap_param_sync = overlap_param_sync
        self.contiguous_param_buffer = contiguous_param_buffer
        self.contiguous_grad_buffer = contiguous_grad_buffer
        # None: the reduce-scatter (all-gather) on the copy engines whenever
        # the ranks can (one host, shareable memory), else NCCL (always with nccl_ub).
        self.grad_sync_copy_engine = False if nccl_ub and grad_sync_copy_engine is None else grad_sync_copy_engine
        self.param_sync_copy_engine = param_sync_copy_engine
        self.pipeline_size = pipeline_size
        self.bucket_cap_mb = bucket_cap_mb
        # [Note: iteration phases] (_iteration.py): where this iteration is.
        self.iteration = Iteration()
        self._grad_scaler = None  # the GradScaler step() last received: grad_norm() unscales with it
        self._hooks = _Hooks()
        self._taken_by_newer = None  # [Note: the newest optimizer takes the gradients]: a parameter's name once set
        # [Note: gradients set after the hand-over]: the gradient buffer's version at the last hand-over.
        self._buffer_version = None
        # Reads of a parameter outside its module's forward wait on first use ([Note: first-use guard]).
        self._first_use = self._hooks.first_use = FirstUseGuard(self._make_current) if overlap_param_sync else None
        weakref.finalize(self, self._hooks.remove)  # [Note: hooks die with their optimizer]
        # The layout's first guess at backward order is the parameters
        # reversed; the first backward (with overlap) shows the real one, and
        # the first step rebuilds the layout in it (_adopt_backward_order).
        self._probe = BackwardOrderProbe(active=overlap_grad_sync)
        params, groups_of = self._build(grad_sync_dtype, param_sync_dtype, device)
        self._build_layout(params[::-1], groups_of[::-1])
        # On every module's forward (as apex): the optimizer is not given the
        # model, and each module waits only for the buckets of its own parameters.
        self._hooks.forward = torch.nn.modules.module.register_module_forward_pre_hook(
            functools.partial(_wait_for_own_params, weakref.ref(self))) if overlap_param_sync else None

    # ------------------------------------------------------------ layout

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
        # The hooks hold the optimizer weakly: no reference cycle through the
        # model's parameters, so an optimizer that goes out of scope is freed
        # at once, before the process group is destroyed (gloo can abort at
        # exit otherwise), and takes its hooks with it.
        self._hooks.remove_grad()
        this = weakref.ref(self)
        self._take_gradients(this)
        self._hooks.grad = [p.register_post_accumulate_grad_hook(functools.partial(_grad_ready, this, k))
                            for k, p in enumerate(self.params)] if self.overlap_grad_sync else []
        # [Note: tracked storage] (_tracked.py): what step() compares the parameters against.
        self._param_ptrs = list(map(DATA_PTR, self.params))
        self._param_shapes = [p.shape for p in self.params]
        self._grouped = [p for g in self.param_groups for p in g["params"]]
        self._replaced.track(self._grouped)
        # [Note: the trainable set]: what step() compares requires_grad against.
        self._trainable = list(map(REQUIRES_GRAD, self._grouped))

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

    def _state_row(self, name: str, b: int) -> torch.Tensor:
        """Bucket b of this rank's shard of a state, as true fp32 values (a new
        tensor: [Note: storage codecs] in _storage.py)."""
        if name == "master" and self.remainders is not None:
            return _storage.joined_master(self.param_shards[b], self.remainders[b])
        if name == "master" and self.master is None:  # store_params=False
            return _storage.true_values(self.param_shards[b])
        stored = self.state_buffer(name)[b]
        if name not in self.state_scales and name not in self.state_blocks:
            return _storage.true_values(stored)
        row = torch.zeros(stored.shape, dtype=torch.float32, device=stored.device)  # padding holds zeros
        for f in self._shard_fragments_by_bucket[b]:
            codec = self._fragment_codec(name, self._fragment_index[(b, f.shard_start)])
            row[f.shard_start:f.shard_end] = _storage.true_values(stored[f.shard_start:f.shard_end], **codec)
        return row

    def _fragment_codec(self, name: str, j: int) -> dict:
        """How fragment j of a state is stored: its scale or block maxima (_storage.codec)."""
        views = {}
        if name in self.state_scales:
            views[f"{name}_scale"] = self.state_scales[name][j:j + 1]
        if name in self.state_blocks:
            views[f"{name}_absmax"] = self.state_blocks[name][j]
        return _storage.codec(views, name)

    def _write_state(self, name: str, f, values: torch.Tensor) -> None:
        """Store fp32 values into shard fragment f of a state."""
        where = (f.bucket, slice(f.shard_start, f.shard_end))
        if name == "master" and self.remainders is not None:
            _storage.split_master(values, self.param_shards[where], self.remainders[where])
        elif name == "master" and self.master is None:  # store_params=False
            _storage.store(self.param_shards[where], values)
        elif name in self.state_scales or name in self.state_blocks:  # each fragment its own scale or maxima
            j = self._fragment_index[(f.bucket, f.shard_start)]
            _storage.store(self.state_buffer(name)[where], values, **self._fragment_codec(name, j))
        else:
            _storage.store(self.state_buffer(name)[where], values)
        if name == "master":
            self._master_written(f)

    def _master_written(self, f) -> None:
        """A master written outside a step (init_params, a checkpoint): the
        parameter shard follows it, so that the next all-gather sends it
        (with host state, once it is up: [Note: host shards])."""
        if self.separate_param_shards:
            where = (f.bucket, slice(f.shard_start, f.shard_end))
            j = self._fragment_index[(f.bucket, f.shard_start)]
            self.param_shards[where].copy_(_storage.true_values(self.master[where],
                                                                **self._fragment_codec("master", j)))
        if self._host is not None:
            self._host.stale = True

    def state_buffer(self, name: str) -> torch.Tensor | None:
        """This rank's [buckets, shard] buffer of a state ("master": the
        separate master, None without one), as stored."""
        return self.master if name == "master" else self.states[name]

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

    # ------------------------------------------------------------ step

    # torch.amp.GradScaler hands itself to step(grad_scaler=...): the
    # gradients live in this optimizer's shards, out of the scaler's reach.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """One step of the rule over this rank's shard, then the parameter all-gather.

        With a GradScaler (``scaler.step(opt)``, or apex's
        ``step(grad_scaler=scaler)``: [Note: GradScaler protocols] in
        _amp.py), the gradients are still scaled unless unscale_grads() ran:
        1/scale joins the kernel's gradient scale, and a
        non-finite gradient on any rank skips the step on every rank
        (parameters, states and step counters unchanged) and is reported to
        the scaler so that ``scaler.update()`` backs off. With capturable=True
        nothing is read back to the host: the skip is decided on the device
        (the kernel writes nothing, the step counters add 0), so the whole
        iteration can be captured in a CUDA graph.

        skip_nonfinite_grads=True: the same skip without a scaler, whenever
        the reduced gradients hold inf/NaN on some rank (counted in
        ``skipped_steps`` and logged to the "shardadam" logger)."""
        grad_scaler = _amp.stepping_scaler(self, kwargs)
        if grad_scaler is not None and not grad_scaler.is_enabled():
            grad_scaler = None
        loss = run_closure(closure)
        # [Note: validate, then mutate] (_validate.py): every refusal comes first.
        _watchdog.check()  # a copy-engine collective whose peer died: this iteration is invalid
        if grad_scaler is not None:
            self._refuse_with_host_step_in_backward("a GradScaler")
        if self._probe.active and self._probe.repeated and self.host_step_in_backward:
            raise RuntimeError(_host_shards.SECOND_REDUCTION)
        check_step_groups(self.param_groups, self.rule)
        if self._taken_by_newer:  # [Note: the newest optimizer takes the gradients]
            raise RuntimeError(
                f"{self._taken_by_newer} (and maybe more) belongs to a newer {type(self).__name__} built over it "
                "since, which now takes its gradients: step that one. This one is still alive (an LR scheduler or "
                "a trainer may hold it): let go of it, or build the new one over other parameters")
        self._check_params_in_place()
        inv_loss_scale = None
        if grad_scaler is not None:
            unscaled = _amp.stage(grad_scaler, self) == "UNSCALED"
            if unscaled and self.iteration.inv_scale is None:
                raise RuntimeError(f"scaler.unscale_(optimizer) cannot reach {type(self).__name__}'s gradients "
                                   "(they live in its buckets): call optimizer.unscale_grads(grad_scaler=scaler) "
                                   "instead, or nothing (clip_grad_norm() and step() unscale by themselves)")
            if not unscaled and self.iteration.inv_scale is not None:
                raise RuntimeError("the GradScaler steps gradients that unscale_grads(inv_scale=...) already "
                                   "unscaled: they would be unscaled twice; use "
                                   "unscale_grads(grad_scaler=scaler), or one of the two")
            if not unscaled:
                inv_loss_scale = _amp.inv_scale(grad_scaler, self.device)
        self._land_param_sync()  # the last all-gather reads the shards this step writes
        # Stepped during backward already: what changed after the hand-over is reported once the step is done.
        changed = self._host_step_changes() if self.iteration.host_step else ""
        if self.iteration.grads is not Grads.REDUCED:  # the first one rebuilds the layout: before any state exists
            self.grad_sync()
        else:  # synchronised earlier (grad_norm(), clip_grad_norm(), unscale_grads())
            self._refuse_changes_after_hand_over()
        if not all(self._initialized):
            self.init_params([p for p, done in zip(self.params, self._initialized) if not done])
        # Averaging, unscaling and clipping fold into the kernel's gradient
        # scale: the reduced gradients are never rescaled in memory.
        grad_scale = torch.full((), 1.0 / self.world_size if self.average_grad_sync else 1.0,
                                dtype=torch.float32, device=self.device)
        if self.iteration.inv_scale is not None:
            grad_scale *= self.iteration.inv_scale
        found_inf = None
        if grad_scaler is not None:
            if inv_loss_scale is not None:
                grad_scale *= inv_loss_scale
            self._grad_scaler = grad_scaler
            found_inf = self._nonfinite_on_any_rank()
            _amp.report(grad_scaler, self, found_inf, self.device)
        elif self.skip_nonfinite_grads:
            found_inf = self._nonfinite_on_any_rank()
        if self.skip_nonfinite_grads and self.capturable:
            self.skipped_steps += (found_inf != 0).to(torch.int64).reshape(())
        if found_inf is not None and not self.capturable and found_inf.item():  # the host's step counters must know
            if self.skip_nonfinite_grads:
                self.skipped_steps += 1
                _log.warning("%s: step skipped on every rank: the reduced gradients hold inf or NaN (%d steps "
                             "skipped so far)", type(self).__name__, self.skipped_steps)
            self._end_iteration(stepped=True)
            return loss
        if self.iteration.clip is not None:  # deferred: on the unscaled norm
            max_norm, scaled_norm = self.iteration.clip
            unscaled = scaled_norm * (grad_scale * (self.world_size if self.average_grad_sync else 1.0))
            grad_scale *= torch.clamp(max_norm / (unscaled + 1e-6), max=1.0)
        # Every rank, every group (empty ones too) advances; a capturable step
        # skipped for inf/NaN advances by 0, on the device.
        advance = 1 if found_inf is None or not self.capturable else (found_inf == 0).to(torch.int64).reshape(())
        for g in self.param_groups:
            g["step"] += advance
        hyper = self.rule.hyper(self.param_groups)
        moved = None
        if self.iteration.host_step:  # [Note: host step in backward]: stepped already
            self._host.finish_armed()
            moved = _host_shards.moved_hyperparameters(self.iteration.host_step, hyper)
        elif self._host is not None:  # [Note: host shards]: the gradient scale comes down as a number
            host_scale = grad_scale.cpu()
            self._host.step(self.plan, lambda plan: self.rule.launch(
                plan, hyper, grad_scale=host_scale, found_inf=None, rounding_seed=self.rounding_seed))
        else:
            self.rule.launch(self.plan, hyper, grad_scale=grad_scale, found_inf=found_inf if self.capturable else None,
                             rounding_seed=self.rounding_seed)
        # The all-gathers write the parameters behind autograd's back: tell
        # it, so a graph that saved a parameter before this step refuses to
        # run backward through the new values (as after torch.optim's step).
        torch.autograd.graph.increment_version(self.params)
        if self.overlap_param_sync and self.capturable:
            self.iteration.move_params(Params.DEFERRED)  # started by the next forward
        elif self.overlap_param_sync:
            self.iteration.move_params(Params.GATHERING)
            self._start_param_sync()  # each module's forward waits for its own buckets
        else:
            self.param_sync()
        if self.overlap_param_sync:  # any other read waits on first use
            self._first_use.arm(self.params)
        self._end_iteration(stepped=True)
        if changed:
            raise RuntimeError(changed)
        if moved:
            raise RuntimeError(
                f"{type(self).__name__}(host_step_in_backward=True) stepped this iteration with the "
                f"hyperparameters it read when backward began ({moved}): they changed after that, and take effect "
                "from the next iteration. Set them before backward (as LR schedulers stepped after "
                "optimizer.step() do), or build the optimizer with host_step_in_backward=False")
        return loss

    def _arm_host_step(self) -> None:
        """The iteration's first hand-over ([Note: host step in backward]):
        from now on each bucket is stepped on the host as soon as its
        gradients are down, with the hyperparameters and step count that
        step() would use. Not in an iteration whose masters are not all
        taken from the parameters yet (step() takes them first)."""
        if self._host is None or not all(self._initialized):
            self.iteration.host_step = False
            return
        check_step_groups(self.param_groups, self.rule)  # [Note: validate, then mutate]: before any bucket steps
        self._land_param_sync()  # the copies up overwrite the rows the last all-gathers send
        # Values, not the groups' objects: a tensor lr changed in place later is
        # neither half applied by the worker nor missed by step()'s comparison.
        # Read into host memory here, in this stream's order: the worker's
        # thread would read a GPU tensor on a stream of its own.
        read = [{k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                 for k, v in g.items() if k != "params"} for g in self.param_groups]
        hyper = self.rule.hyper([dict(g, step=g["step"] + 1) for g in read])
        grad_scale = torch.full((), 1.0 / self.world_size if self.average_grad_sync else 1.0, dtype=torch.float32)
        self._host.arm(self.plan, lambda plan: self.rule.launch(plan, hyper, grad_scale=grad_scale, found_inf=None,
                                                                rounding_seed=self.rounding_seed))
        self.iteration.host_step = hyper

    def _refuse_with_host_step_in_backward(self, what: str) -> None:
        if self.host_step_in_backward:
            raise RuntimeError(
                f"{type(self).__name__}(host_step_in_backward=True) steps each bucket during backward, before "
                f"{what} could know every gradient: build the optimizer with host_step_in_backward=False to use it")

    def _refuse_mid_host_step(self, what: str) -> None:
        """[Note: host step in backward]: between a backward that began
        stepping the host state and step(), the state is half stepped."""
        if self.iteration.host_step:
            raise RuntimeError(
                f"{type(self).__name__}.{what} between backward and step() with host_step_in_backward=True: the "
                "host is stepping this iteration's buckets as backward reduces them, so the state is part old, "
                "part new. Call step() first")

    # [Note: the trainable set] The layout shards the parameters that required
    # a gradient when it was built, and only those. A change of requires_grad
    # afterwards cannot be followed without a new layout: a parameter frozen
    # later would go on taking steps with zero gradients (momentum and weight
    # decay move it, where torch.optim leaves it alone), and one unfrozen
    # later has no shard, so its gradients would be ignored. step() refuses
    # both before anything is written: one C-level pass over the parameters.
    # A group added after construction (add_param_group) would have no shards
    # either, and a later step failed on its missing step counter:
    # add_param_group refuses it, adding nothing.
    def add_param_group(self, param_group: dict) -> None:
        """torch.optim's while the constructor gathers the groups; refused
        once the layout is built ([Note: the trainable set])."""
        if getattr(self, "_grouped", None) is not None:
            raise ValueError(f"{type(self).__name__}.add_param_group: the optimizer shards the parameters it was "
                             "built with, so a group added now would never be trained. Build a new "
                             f"{type(self).__name__} over every group (FusedAdam, which keeps whole tensors, "
                             "takes groups added later)")
        super().add_param_group(param_group)

    def _check_trainable_set(self) -> None:
        now = list(map(REQUIRES_GRAD, self._grouped))
        if now == self._trainable:
            return
        p = next(p for p, was, trainable in zip(self._grouped, self._trainable, now) if was != trainable)
        if p.requires_grad:
            what = ("was frozen (requires_grad=False) when the optimizer was built and requires a gradient now: it "
                    "has no shard, so its gradients would be ignored")
        else:
            what = ("was frozen (requires_grad=False) after the optimizer was built: its shard would go on taking "
                    "steps with zero gradients (momentum and weight decay would move it)")
        raise RuntimeError(f"{param_names(self.param_groups)[id(p)]} {what}. Set requires_grad before building "
                           f"{type(self).__name__}, or build a new one after changing it")

    def _take_gradients(self, this: weakref.ref) -> None:
        """[Note: the newest optimizer takes the gradients]: this optimizer's
        parameters hand their gradients to it; an older one alive that held
        some of them learns which (it refuses to go on)."""
        names = param_names(self.param_groups)
        for p in self.params:
            older = _HANDED_TO.get(p)
            owner = older() if older is not None and older is not this else None
            if owner is not None and not owner._taken_by_newer:
                owner._taken_by_newer = names[id(p)]
            _HANDED_TO[p] = this

    def _check_params_in_place(self) -> None:
        """[Note: tracked storage] (_tracked.py): a parameter that moved to
        other memory (model.to(...), p.data = ...) is followed where the
        all-gather copies into it, and refused where the optimizer's buffers
        are the parameter's memory (contiguous buffers) or its shape changed.
        One C-level pass over the parameters when nothing moved."""
        self._replaced.check()
        self._check_trainable_set()
        moved = moved_indices(self.params, self._param_ptrs)
        if not moved:
            return
        names = param_names(self.param_groups)
        order = {pid: i for i, pid in enumerate(names)}
        for k in sorted(moved, key=lambda k: order[id(self.params[k])]):  # the first in param_groups order is named
            p = self.params[k]
            where = f"{names[id(p)]} (shape {tuple(self._param_shapes[k])})"
            if p.shape != self._param_shapes[k]:
                raise ValueError(f"{where} changed shape to {tuple(p.shape)} since the optimizer was built "
                                 "(p.data = ... with another shape): the bucket layout and the optimizer state have "
                                 "the old one. Build a new optimizer")
            if self.contiguous_param_buffer or self.contiguous_grad_buffer:
                option = "contiguous_param_buffer" if self.contiguous_param_buffer else "contiguous_grad_buffer"
                made = "it a view of its parameter buffer" if self.contiguous_param_buffer \
                    else "its gradient a view of its gradient buffer"
                raise RuntimeError(
                    f"{where} no longer lives in the optimizer's memory: its storage was replaced (model.to(...), "
                    f"p.data = ..., a swap_tensors conversion) after {type(self).__name__}({option}=True) made {made}, "
                    "so the optimizer would no longer reach the model. Convert the model before building the optimizer")
        self._param_ptrs = list(map(DATA_PTR, self.params))

    def _nonfinite_on_any_rank(self) -> torch.Tensor:
        """1.0 on the device when the reduced gradient shard of any rank holds
        inf/NaN, else 0.0: one all-reduce, no host sync."""
        found = kernels.l2_norm(self._shard_norm_plan()).nonfinite
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.dist_group)
        return found

    def _end_iteration(self, stepped: bool = False) -> None:
        self._grad_sync.reset()
        if self._host is not None:
            self._host.settle()
        self.iteration.end(consumed=stepped and self.grads_in_buffer)

    # [Note: gradients set after the hand-over] With overlap_grad_sync,
    # backward hands each gradient to the buckets as it is produced (the hook
    # leaves p.grad None, or the parameter's view of the contiguous gradient
    # buffer), and the reduce-scatters read the buckets, not p.grad. A gradient
    # set after that (p.grad = t; model.zero_grad() with the contiguous
    # buffer) would be dropped silently: grad_sync() refuses it before anything
    # of the step is written, naming the parameter; a host step in backward,
    # done by then, reports it once step() has finished. So is an in-place
    # change of a view of the contiguous buffer after the hand-over
    # (torch.nn.utils.clip_grad_norm_, zero_grad(set_to_none=False)): the
    # views share the buffer's version counter, which every hand-over records
    # after its own writes (autograd's accumulation and the reduce-scatter's
    # launch bump it before that), and so does grad_sync() once it is done; a
    # counter moved since then is someone else's write. Both are refused by
    # grad_sync() or, when grad_norm(), clip_grad_norm() or unscale_grads()
    # synchronised earlier, by step(). Which parameter a write in place
    # touched the counter cannot tell.
    # A host step in backward copies the reduced shards down while the caller
    # goes on, so there a change in place races with those copies: step()
    # reports it after the fact, saying that part of it may have been used.
    # Not seen: set_to_none where p.grad is None already.
    def _gradients_set_after_hand_over(self) -> str:
        """The parameters whose .grad is no longer what the hand-over left,
        as "<first one's name> (and N more)", or "" ([Note: gradients set
        after the hand-over])."""
        if not self.overlap_grad_sync or self._probe.active:
            return ""
        left = self._grad_views if self.contiguous_grad_buffer else itertools.repeat(None)
        changed = itertools.compress(range(len(self.params)), map(operator.is_not, map(GRAD, self.params), left))
        late = [k for k in changed if self._grad_sync.arrived[k]]
        if not late:
            return ""
        first = param_names(self.param_groups)[id(self.params[late[0]])]
        return first + (f" (and {len(late) - 1} more)" if len(late) > 1 else "")

    def _grad_buffer_version(self) -> int:
        """The contiguous gradient buffer's version counters, summed (they only grow)."""
        return sum(map(VERSION, self.grad_buffer.tensors))

    def _buffer_written_after_hand_over(self) -> bool:
        """Whether the contiguous gradient buffer was written since this
        iteration's last hand-over or synchronisation ([Note: gradients set
        after the hand-over])."""
        return (self.contiguous_grad_buffer and self.overlap_grad_sync and not self._probe.active
                and any(self._grad_sync.arrived) and self._grad_buffer_version() != self._buffer_version)

    def _refuse_changes_after_hand_over(self) -> None:
        """grad_sync()'s and step()'s refusal of a gradient set, or of the
        buffer written, after the hand-over, before anything of the step is
        written; none with a host step in backward, done by then
        (_host_step_changes). [Note: gradients set after the hand-over]"""
        if self.iteration.host_step:
            return
        late = self._gradients_set_after_hand_over()
        if late:
            left = "optimizer.grad_buffer_view(p)" if self.contiguous_grad_buffer else "None"
            raise RuntimeError(
                f"{late}: its gradient was set after "
                f"backward handed it over ({type(self).__name__}(overlap_grad_sync=True) reduces each gradient as "
                f"backward produces it), so this step would not see it: {_CHANGE_BEFORE_HAND_OVER}; to "
                f"step with what backward produced, set p.grad back to {left}")
        if self._buffer_written_after_hand_over():
            raise RuntimeError(
                f"{type(self).__name__}: {_BUFFER_WRITTEN}, so this step would not see the change "
                "(overlap_grad_sync=True reduces each gradient as backward produces it). Clip with "
                f"optimizer.clip_grad_norm(); {_CHANGE_BEFORE_HAND_OVER}; then call optimizer.zero_grad() and run "
                "backward again")

    def _host_step_changes(self) -> str:
        """What changed after the hand-over of an iteration a host step in
        backward has stepped, as the message step() raises once it is done,
        or "" ([Note: gradients set after the hand-over])."""
        late = self._gradients_set_after_hand_over()
        if late:
            what = (f"with the gradients backward produced: the gradient of {late} was set after backward handed "
                    "it over, and was not used")
        elif self._buffer_written_after_hand_over():
            what = (f"during backward: {_BUFFER_WRITTEN} while the host step was copying them down, so part of the "
                    "change may have reached this step")
        else:
            return ""
        return (f"{type(self).__name__}(host_step_in_backward=True) stepped this iteration {what}: "
                f"{_CHANGE_BEFORE_HAND_OVER}")

    def _leave_consumed(self, params) -> None:
        """Before the first gradient of an iteration after a step that left
        its reduced shards in the gradient buffer (Grads.CONSUMED): refuse a
        gradient that autograd added into the buffer (params: indices whose
        .grad to look at), else clear this rank's shard of it, which the
        gradients that replaced their views do not all cover."""
        if self.iteration.grads is not Grads.CONSUMED:
            return
        names = param_names(self.param_groups)
        for k in params:
            grad = self.params[k].grad
            if grad is not None and grad.data_ptr() == self._grad_views[k].data_ptr():
                raise RuntimeError(
                    f"{names[id(self.params[k])]}: a gradient was added into the contiguous gradient buffer while "
                    f"it still holds the last step's reduced shard ({type(self).__name__}(contiguous_grad_buffer="
                    "True) reduces in place): call optimizer.zero_grad() between a step and the next backward "
                    "(model.zero_grad(set_to_none=False) zeroes the views too, but the optimizer cannot tell that "
                    "from gradients accumulated over the reduced shard)")
        self.grad_shards.zero_()
        self.iteration.move_grads(Grads.REDUCING)

    def unscale_grads(self, *args, inv_scale=None, grad_scaler=None) -> dict:
        """apex's deferred unscale: divide this iteration's gradients by the
        loss scale inside the next step (gradients are not rewritten):
        inv_scale (a number or a 0-d/1-element tensor; also the first
        positional argument, GradScaler._unscale_grads_'s order), or 1 /
        grad_scaler's current scale. Synchronises the gradients and returns
        {device: found_inf} (1.0 where any rank's reduced gradients hold
        inf/NaN); with grad_scaler, as scaler.unscale_(optimizer) would, the
        scaler records it and moves to its unscaled stage, so that
        clip_grad_norm() and then scaler.step(optimizer) / scaler.update() follow."""
        if args:
            if inv_scale is not None:
                raise TypeError("unscale_grads: inv_scale given both by position and by keyword")
            inv_scale = args[0]
        if (inv_scale is None) == (grad_scaler is None):
            raise ValueError("unscale_grads needs exactly one of inv_scale or grad_scaler")
        self._refuse_with_host_step_in_backward("unscale_grads()")
        if self.iteration.inv_scale is not None:
            raise RuntimeError("unscale_grads() was already called in this iteration (after the last step() or "
                               "zero_grad()): the gradients would be unscaled twice")
        if grad_scaler is not None:
            stage = _amp.stage(grad_scaler, self)
            if stage != "READY":
                raise RuntimeError(f"unscale_grads(grad_scaler=...): the scaler is {stage} for this optimizer "
                                   "(unscale_ or step already ran since the last update())")
            inv_scale = _amp.inv_scale(grad_scaler, self.device)
        inv_scale = torch.as_tensor(inv_scale, dtype=torch.float32, device=self.device).reshape(())
        if self.iteration.grads is not Grads.REDUCED:
            self.grad_sync()
        found_inf = self._nonfinite_on_any_rank()
        self.iteration.inv_scale = inv_scale
        if grad_scaler is not None:
            self._grad_scaler = grad_scaler
            _amp.report(grad_scaler, self, found_inf, self.device, unscaled=True)
        return {self.device: found_inf}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears gradients; with contiguous_grad_buffer the buffer is zeroed
        and parameters keep their views of it whatever set_to_none says."""
        _watchdog.check()
        self._refuse_mid_host_step("zero_grad()")
        self._grad_sync.reset()  # a reduce-scatter may still read the buffers
        with torch._C.DisableTorchFunctionSubclass():  # gradients only: armed parameters stay armed
            if self.contiguous_grad_buffer:
                self._check_params_in_place()  # the gradient views fit the parameters they were made for
                self.grad_buffer.zero_()
                self._attach_grad_views()
            else:
                super().zero_grad(set_to_none=set_to_none)
        self._end_iteration()

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside this context add into
        ``p.grad`` with no communication; the first backward outside it (or
        step()) synchronises the sum."""
        before, self.iteration.no_sync = self.iteration.no_sync, True
        try:
            yield
        finally:
            self.iteration.no_sync = before

    @torch.no_grad()
    def grad_norm(self, parameters=None, norm_type: float = 2.0, *, grad_scaler=None) -> torch.Tensor:
        """The L2 norm of the synchronised (averaged, if average_grad_sync)
        gradient of every parameter, or of `parameters`, as a 0-d tensor;
        synchronises the gradients now if step() has not yet. Under AMP the
        norm is unscaled by the GradScaler passed here or, before, to step():
        without grad_scaler, the first iteration's norm is still scaled (the
        optimizer has not met the scaler yet)."""
        self._meet_scaler(grad_scaler)
        return self._unscaled(self._scaled_grad_norm(parameters, norm_type))

    def _meet_scaler(self, grad_scaler) -> None:
        if grad_scaler is not None and grad_scaler.is_enabled():
            self._grad_scaler = grad_scaler

    def _unscaled(self, norm: torch.Tensor) -> torch.Tensor:
        if self.iteration.inv_scale is not None:  # unscale_grads() ran
            return norm * self.iteration.inv_scale
        # A scaler that has not scaled a loss yet has no scale: the gradients are not scaled.
        if self._grad_scaler is None or self._grad_scaler._scale is None:
            return norm
        return norm * self._grad_scaler._scale.to(self.device, torch.float32).reciprocal().reshape(())

    def _scaled_grad_norm(self, parameters, norm_type: float) -> torch.Tensor:
        """The norm of the gradients as they are (loss-scaled under AMP)."""
        if norm_type != 2.0:
            raise ValueError(f"norm_type must be 2.0 (the L2 norm), got {norm_type}")
        if self.iteration.grads is not Grads.REDUCED:
            self.grad_sync()
        local = kernels.l2_norm(self._norm_plan_for(parameters)).total
        sum_sq = local * local
        dist.all_reduce(sum_sq, group=self.dist_group)  # redundant replicas hold the same shards
        norm = sum_sq.sqrt()
        return norm / self.world_size if self.average_grad_sync else norm

    def _norm_plan_for(self, parameters) -> kernels.NormPlan:
        """The shard pieces whose norm is wanted; plans are built once per set."""
        if parameters is None:
            return self._shard_norm_plan()
        index = {id(p): k for k, p in enumerate(self.params)}
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        chosen = {index.get(id(p)) for p in params if p.requires_grad}
        if None in chosen:
            raise ValueError("grad_norm: `parameters` holds a tensor that is not a trainable parameter of this "
                             "optimizer")
        key = frozenset(chosen)
        if key not in self._subset_norm_plans:
            pieces = [self.grad_shards[f.bucket, f.shard_start:f.shard_end]
                      for f in self._shard_fragments if f.param in key]
            self._subset_norm_plans[key] = kernels.NormPlan(pieces, check_addresses=False)  # own buffers
        return self._subset_norm_plans[key]

    def _shard_norm_plan(self) -> kernels.NormPlan:
        """The whole reduced gradient shard: its padding holds zeros, so its
        norm and non-finite flag are the shard's."""
        if self._norm_plan is None:
            self._norm_plan = kernels.NormPlan([t.reshape(-1) for t in self.grad_shards.blocks],
                                               check_addresses=False)  # own buffers
        return self._norm_plan

    def clip_grad_norm(self, max_norm: float, parameters=None, norm_type: float = 2.0, *,
                       grad_scaler=None) -> torch.Tensor:
        """Scale the gradients so their global L2 norm is at most max_norm (as
        torch.nn.utils.clip_grad_norm_), inside the next step without rewriting
        gradients; under GradScaler the norm is compared unscaled, in step().
        Returns the norm before clipping, unscaled as grad_norm()'s (pass
        grad_scaler for an unscaled norm in the first iteration too)."""
        if parameters is not None:
            raise NotImplementedError("clip_grad_norm of a subset of the parameters is not supported: the step "
                                      "applies one gradient scale to every parameter; call it without "
                                      "`parameters` (grad_norm(parameters) gives a subset's norm)")
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        self._refuse_with_host_step_in_backward("clipping")
        self._meet_scaler(grad_scaler)
        scaled = self._scaled_grad_norm(None, norm_type)
        self.iteration.clip = (float(max_norm), scaled)  # unscaled in step()
        return self._unscaled(scaled)

    def grad_sync(self) -> None:
        """Finish this iteration's gradient synchronisation: reduce-scatter
        every bucket that backward has not started, and wait for all."""
        if self._probe.active:
            self._adopt_backward_order()
        self._refuse_changes_after_hand_over()
        self._leave_consumed(range(len(self.params)))
        self._grad_sync.finish()
        if self.contiguous_grad_buffer:
            self._buffer_version = self._grad_buffer_version()  # after the synchronisation's own writes
        else:
            for p in self.params:  # handed over: the reduced shards hold them now
                p.grad = None
        self.iteration.move_grads(Grads.REDUCED)

    def param_sync(self) -> None:
        """Bring every parameter up to date: finish the all-gathers that
        overlap_param_sync left running (call this before reading parameters
        outside a module's forward, e.g. to save the model), or run them now."""
        if self.iteration.params is Params.CURRENT:  # nothing owed: all-gather now
            if not all(self._initialized):
                return  # before the first step the parameters are the values; the shards hold none yet
            self.iteration.move_params(Params.DEFERRED)
        self._finish_param_sync()

    def _finish_param_sync(self) -> None:
        """Let every all-gather the last step owes land: those running, and
        those a capturable step left to the next forward (started now)."""
        if self.iteration.params is Params.DEFERRED:
            self.iteration.move_params(Params.GATHERING)
            self._start_param_sync(depth=self.pipeline_size)
        self._land_param_sync()

    def _start_param_sync(self, depth: int | None = None) -> None:
        if self._host is not None:  # [Note: host shards]: the all-gather sends the device rows
            self._host.refresh()
        self._param_sync.start(depth)

    def _land_param_sync(self) -> None:
        """Wait for the all-gathers in flight (none: nothing to do)."""
        with torch._C.DisableTorchFunctionSubclass():  # the copies out write armed parameters
            self._param_sync.finish()
        if self.iteration.params is Params.GATHERING:
            self.iteration.move_params(Params.CURRENT)
        if self._first_use is not None:
            self._first_use.disarm_all()

    def _make_current(self, params: list) -> None:
        """Wait for the all-gathers of these parameters (a module's forward,
        or their first use: [Note: first-use guard]); started here when a
        capturable step left them to the next forward."""
        if self.iteration.params is Params.DEFERRED:
            self.iteration.move_params(Params.GATHERING)
            self._start_param_sync()
        if self.iteration.params is Params.GATHERING:
            with torch._C.DisableTorchFunctionSubclass():
                self._param_sync.wait_for(params)
            if not self._param_sync.pending:
                self._land_param_sync()
        self._first_use.disarm(params)

    # ------------------------------------------------------------ checkpoints

    def sharded_state_dict(self) -> dict:
        """Only this rank's pieces, for torch.distributed.checkpoint: see
        distributed/sharded_checkpoint.py (a checkpoint of N ranks loads on M)."""
        self._refuse_mid_host_step("sharded_state_dict()")
        return sharded_checkpoint.sharded_state_dict(self)

    def load_sharded_state_dict(self, sharded: dict) -> None:
        """Take a sharded_state_dict() structure that dcp.load has filled."""
        self._refuse_mid_host_step("load_sharded_state_dict()")
        self._land_param_sync()
        sharded_checkpoint.load_sharded_state_dict(self, sharded)

    def state_dict(self, *, state_dict_format: int | None = None, gather_on_root: bool | None = None) -> dict | None:
        """Portable state: per parameter (index in param_groups order) the fp32
        ``param`` master and the rule's states (Adam: ``exp_avg`` and
        ``exp_avg_sq``) as full tensors, plus the
        groups' hyperparameters and steps. Independent of world size and bucket
        size: it loads on any number of ranks. The shards are gathered one
        bucket at a time (one bucket of extra device memory, one copy to the
        host per bucket and state, each fragment then copied once into its
        parameter's tensor); every rank gets the whole dict, or with
        gather_on_root=True only rank 0 of process_group receives the shards
        (a gather, not an all-gather) and builds it in host memory, and the
        others get None. Every rank must call it.

        state_dict_format=2: apex's format 2 (_apex_format.py: the same
        tensors, plus ``"format": 2`` and apex's ``state["step"]``), which
        apex's DistributedFusedAdam loads. Format 1 (apex's pickled buckets)
        is not written."""
        if state_dict_format not in (None, _apex_format.FORMAT):
            raise ValueError(f"state_dict_format must be None (shardadam's portable dict) or 2 (apex's format 2, "
                             f"the same tensors), got {state_dict_format!r}: apex's format 1 pickles its internal "
                             f"buckets and is not written")
        self._refuse_mid_host_step("state_dict()")

        def built():
            portable = self._portable_state_dict(bool(gather_on_root))
            return _apex_format.to_apex(portable) if portable is not None and state_dict_format else portable
        return state_dict_through_hooks(self, built)  # [Note: state-dict hooks] in .._state_dict_hooks

    def _portable_state_dict(self, gather_on_root: bool) -> dict | None:
        if not all(self._initialized):  # the state a first step would start from
            self.init_params([p for p, done in zip(self.params, self._initialized) if not done])
        root = self._src  # rank 0 of process_group, as a global rank
        keep = not gather_on_root or dist.get_rank() == root
        members = dist.get_process_group_ranks(self.dist_group if self.dist_group is not None else dist.group.WORLD)
        if gather_on_root and root not in members:
            return None  # redundant replicas: another distributed group holds rank 0, and gathers for it
        size = self.bucket_size
        # Only a rank that keeps the state receives it: a full bucket in device
        # memory for the collective and, on a GPU, a pinned host bucket that
        # one copy per bucket and state fills.
        gathered = torch.empty(size, dtype=torch.float32, device=self.device) if keep else None
        host = gathered
        if keep and self.device.type == "cuda":
            host = torch.empty(size, dtype=torch.float32, pin_memory=True)
        parts = list(gathered.view(self.dist_size, -1).unbind(0)) if keep and gather_on_root else None
        groups, index = pack_groups(self.param_groups, plain_value)
        full = {name: [_unflatten(p) for p in self.params] if keep else None for name in self._state_names}
        for b in range(len(self.layout.buckets)):
            for name in self._state_names:
                row = self._state_row(name, b).to(self.device).contiguous()  # host state: the collective's device
                if gather_on_root:
                    dist.gather(row, gather_list=parts, dst=root, group=self.dist_group)
                else:
                    _all_gather(gathered, row, group=self.dist_group)
                if not keep:
                    continue
                if host is not gathered:
                    host.copy_(gathered)  # one device-to-host copy of the whole bucket
                flats = full[name]
                for f in self.layout.fragments_by_bucket[b]:
                    flats[f.param][1][f.param_start:f.param_end].copy_(host[f.bucket_start:f.bucket_end])
        if not keep:
            return None
        state = {}
        for k, p in enumerate(self.params):
            state[index[id(p)]] = {("param" if name == "master" else name): full[name][k][0]
                                   for name in self._state_names}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state_dict() saved on any world size and bucket size (each
        rank takes its own pieces, no communication), apex's format 2, or a
        fused optimizer's or the rule's torch optimizer's state dict (fp32 master ``param`` /
        ``master_param`` optional: without it the master is the parameter's
        current value). Checks everything before writing; the caller's dict is
        not modified. Every rank checks the whole dict (structure, counts,
        shapes, tensor types, hyperparameters, steps: _state_dict_check.py),
        then the ranks agree (one small collective): if any rank refuses,
        every rank raises the same ValueError and nothing is written. Runs
        torch.optim's load hooks ([Note: state-dict hooks] in
        .._state_dict_hooks: the pre hooks inside the ranks' agreement)."""
        self._load(lambda: through_load_pre_hooks(self, state_dict))
        run_load_post_hooks(self)

    @torch.no_grad()
    def _load(self, read_state_dict: Callable[[], dict]) -> None:
        """load_state_dict() of the dict read_state_dict() returns, without the
        post hooks; read_state_dict runs inside the ranks' agreement."""
        self._refuse_mid_host_step("load_state_dict()")
        self._land_param_sync()
        checked = validate_then_agree(
            f"{type(self).__name__}.load_state_dict",
            lambda: check_state_dict(_apex_format.from_any(read_state_dict()), self.param_groups, self.rule),
            self.group, self.device)
        for values, group in zip(checked.group_values, self.param_groups):
            set_group_values(group, values)
        # without a master in the checkpoint, the master is the parameter's current value
        by_param = {id(p): dict(entry, master=entry["master"] if entry["master"] is not None else p.detach())
                    for p, entry in checked.entries}
        flat, flat_of = {}, None  # a parameter's loaded tensors, flattened once for its consecutive fragments
        for f in self.layout.shard_fragments(self.rank):
            entry = by_param.get(id(self.params[f.param]))
            if entry is None:
                continue
            if flat_of != f.param:
                flat, flat_of = {}, f.param
            for name in self._state_names:
                if name not in flat:  # a copy only where the saved layout differs from the parameter's
                    flat[name] = flat_like(entry[name].float(), self.params[f.param])
                self._write_state(name, f, flat[name][f.param_start:f.param_end])
        for k, p in enumerate(self.params):  # the model's values: the loaded masters, as the all-gather sends them
            entry = by_param.get(id(p))
            if entry is not None:
                p.copy_(entry["master"].to(self._sync_class[id(p)][1]))
                self._initialized[k] = True

    @property
    def transports(self) -> dict:
        """The transport of each direction, by name: {"grad_sync": ..., "param_sync": ...}
        (e.g. "nccl reduce-scatter", "copy-engine all-gather")."""
        return {"grad_sync": self._grad_sync.transport.name, "param_sync": self._param_sync.transport.name}

    def __reduce_ex__(self, protocol):
        refuse_copy(self)  # [Note: copies of an optimizer] in .._optimizer_copies

    def __repr__(self) -> str:
        def group_name(g, absent: str = "default") -> str:
            return absent if g is None else f"(size {dist.get_world_size(g)}, id {id(g)})"

        options = dict(self.rule.options(), dtype=self.dtype, state_dtypes=self.state_dtypes,
                       grad_sync_dtype=self.grad_sync_dtype, param_sync_dtype=self.param_sync_dtype,
                       device=self.device, average_grad_sync=self.average_grad_sync,
                       overlap_grad_sync=self.overlap_grad_sync, overlap_param_sync=self.overlap_param_sync,
                       bucket_cap_mb=self.bucket_cap_mb, pipeline_size=self.pipeline_size,
                       contiguous_param_buffer=self.contiguous_param_buffer,
                       contiguous_grad_buffer=self.contiguous_grad_buffer, store_params=self.store_params,
                       store_param_remainders=self.store_param_remainders,
                       with_scaled_states=self.with_scaled_states, nccl_ub=self.nccl_ub, capturable=self.capturable,
                       grad_sync_copy_engine=self.grad_sync_copy_engine,
                       param_sync_copy_engine=self.param_sync_copy_engine, state_device=self.state_device,
                       host_step_in_backward=self.host_step_in_backward)
        lines = [f"{type(self).__name__} (world_size={self.world_size}, shard_rank={self.rank}, "
                 f"process_group={group_name(self.group)}, "
                 f"distributed_process_group={group_name(self.dist_group)}, "
                 f"redundant_process_group={group_name(self.redundant_group, 'None')}, "
                 f"buckets={len(self.layout.buckets)}, shard_size={self.shard_size}, "
                 f"grad_sync={self._grad_sync.transport.name}, param_sync={self._param_sync.transport.name}"]
        for i, g in enumerate(self.param_groups):
            values = ", ".join(f"{k}={plain_value(g[k])}" for k in self.rule.group_keys + ("step",))
            lines.append(f"  group {i}: {len(g['params'])} params, {values}")
        lines.append("  options: " + ", ".join(f"{k}={str(v).replace('torch.', '')}" for k, v in options.items()))
        return "\n".join(lines + [")"])
