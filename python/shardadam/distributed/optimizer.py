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
import weakref

import torch
import torch.distributed as dist

from .._groups import check_step_groups, param_names, run_closure
from .._host_state import host_state_wanted, host_step_threads
from .._optimizer_copies import refuse_copy
from .._rounding import refuse_masters, rounding_seed
from .._rules import UpdateRule
from .._tracked import ReplacedParams
from . import _amp, _host_shards, _watchdog
from ._agreement import validate_then_agree
from ._apex_methods import ApexMethods
from ._describe import describe
from ._first_use import FirstUseGuard
from ._grad_scaling import GradScaling
from ._guard_hand_over import HandOverGuard
from ._guard_storage import StorageGuard
from ._guard_superseded import SupersededGuard
from ._guard_trainable import TrainableSetGuard
from ._hooks import Hooks, grad_ready, register_forward_waits
from ._host_step import HostStep
from ._iteration import BackwardOrderProbe, Grads, Iteration, Params
from ._layout_build import LayoutBuild
from ._options import check_storage_options, check_sync_dtypes, state_dtypes
from ._peer_timeout import naming_phase
from ._shard_groups import shard_groups
from ._state_io import StateIO

__all__ = ["ShardedOptimizer"]


class ShardedOptimizer(LayoutBuild, StateIO, GradScaling, HostStep, ApexMethods, torch.optim.Optimizer):
    """ZeRO-2 with sharded state, on NCCL (GPU) or gloo (CPU), for the update
    rule its subclass (a constructor) passes; DistributedFusedAdam's
    docstring (adam.py) says what every rank passes and how gradients are
    handed over.

    This class says what happens when in an iteration; the pieces it calls
    at named points each have a module (and tests) of their own:
    - the layout, buffers and plan (_layout_build.py), ending in _track_layout();
    - the guards asked before anything is written (_check_params_in_place()
      and step()): a newer optimizer over the parameters
      (_guard_superseded.py), replaced parameter objects (../_tracked.py),
      the trainable set (_guard_trainable.py), moved storage
      (_guard_storage.py), and gradients changed after backward's hand-over
      (_guard_hand_over.py, at grad_sync() and step());
    - the gradient scale: averaging, AMP and clipping (_grad_scaling.py);
    - the host-step path (_host_step.py);
    - state and checkpoint I/O (_state_io.py);
    - the hooks on the model (_hooks.py) and apex's methods (_apex_methods.py).
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
        # Before torch.optim gathers the groups: add_param_group asks it ([Note: the trainable set]).
        self._trainable_guard = TrainableSetGuard(name)

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
        # The guards step() asks before anything is written (_check_params_in_place).
        self._replaced = ReplacedParams(name)
        self._superseded = SupersededGuard(name)  # [Note: the newest optimizer takes the gradients]
        self._storage_guard = StorageGuard(name)  # [Note: tracked storage]
        self._hand_over_guard = HandOverGuard()  # [Note: gradients set after the hand-over]
        # None stays None (the default group, looked up per call): holding the
        # WORLD object would keep it alive past destroy_process_group(), and
        # gloo can abort when it is torn down at interpreter exit.
        self.group = process_group
        self.world_size = dist.get_world_size(self.group)
        # Sharding: [Note: redundant replicas] in _shard_groups.py.
        groups = shard_groups(process_group, distributed_process_group, redundant_process_group)
        self.dist_group, self.redundant_group = groups.shard, groups.redundant
        self.dist_size, self.rank = groups.shard_size, groups.shard_rank
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
        self._hooks = Hooks()
        # Reads of a parameter outside its module's forward wait on first use ([Note: first-use guard]).
        self._first_use = self._hooks.first_use = FirstUseGuard(self._make_current) if overlap_param_sync else None
        weakref.finalize(self, self._hooks.remove)  # [Note: hooks die with their optimizer]
        # The layout's first guess at backward order is the parameters
        # reversed; the first backward (with overlap) shows the real one, and
        # the first step rebuilds the layout in it (_adopt_backward_order).
        self._probe = BackwardOrderProbe(active=overlap_grad_sync)
        params, groups_of = self._build(grad_sync_dtype, param_sync_dtype, device)
        self._build_layout(params[::-1], groups_of[::-1])
        # On the forward of the modules that own the parameters ([Note: hooks on
        # the modules that own the parameters] in _hooks.py): each module waits
        # only for the buckets of its own parameters.
        self._hooks.forward = register_forward_waits(weakref.ref(self), self.params) if overlap_param_sync else None

    # ------------------------------------------------------------ guards

    def _track_layout(self) -> None:
        """The end of every layout build: the hooks hand the new layout's
        gradients over (holding the optimizer weakly: _hooks.py), and the
        guards take what step() compares against."""
        self._hooks.remove_grad()
        this = weakref.ref(self)
        self._superseded.take(self.params, param_names(self.param_groups))
        self._hooks.grad = [p.register_post_accumulate_grad_hook(functools.partial(grad_ready, this, k))
                            for k, p in enumerate(self.params)] if self.overlap_grad_sync else []
        self._storage_guard.track(self.params)
        self._trainable_guard.track(self.param_groups)
        self._replaced.track(self._trainable_guard.grouped)

    def _check_params_in_place(self) -> None:
        """The guards on the parameters, in this order, before anything is
        written: an object replaced in its module, a changed trainable set
        ([Note: the trainable set]), storage that moved ([Note: tracked
        storage]: followed where the all-gather copies into the parameter,
        refused where the optimizer's buffers are its memory). One C-level
        pass over the parameters each when nothing changed."""
        self._replaced.check()
        self._trainable_guard.check(self.param_groups)
        self._storage_guard.check(self.params, self.param_groups, contiguous_param_buffer=self.contiguous_param_buffer,
                                  contiguous_grad_buffer=self.contiguous_grad_buffer)

    def add_param_group(self, param_group: dict) -> None:
        """torch.optim's while the constructor gathers the groups; refused
        once the layout is built ([Note: the trainable set])."""
        self._trainable_guard.refuse_new_group()
        super().add_param_group(param_group)

    # ------------------------------------------------------------ step

    @torch.no_grad()
    @naming_phase("step()")  # [Note: a peer that never comes] in _peer_timeout.py, as on the calls below
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
        self._check_host_step(grad_scaler)
        check_step_groups(self.param_groups, self.rule)
        self._superseded.check()  # [Note: the newest optimizer takes the gradients]
        self._check_params_in_place()
        inv_loss_scale = self._scaler_inv_scale(grad_scaler)
        self._land_param_sync()  # the last all-gather reads the shards this step writes
        # Stepped during backward already: what changed after the hand-over is reported once the step is done.
        changed = self._hand_over_guard.host_step_report(self) if self.iteration.host_step else ""
        if self.iteration.grads is not Grads.REDUCED:  # the first one rebuilds the layout: before any state exists
            self.grad_sync()
        else:  # synchronised earlier (grad_norm(), clip_grad_norm(), unscale_grads())
            self._hand_over_guard.refuse(self)
        if not all(self._initialized):
            self.init_params([p for p, done in zip(self.params, self._initialized) if not done])
        # Averaging, unscaling and clipping fold into the kernel's gradient
        # scale: the reduced gradients are never rescaled in memory (_grad_scaling.py).
        grad_scale, found_inf = self._gradient_scale(grad_scaler, inv_loss_scale)
        if self._skips(found_inf):
            self._end_iteration(stepped=True)
            return loss
        self._clip_into(grad_scale)
        # Every rank, every group (empty ones too) advances; a capturable step
        # skipped for inf/NaN advances by 0, on the device.
        advance = 1 if found_inf is None or not self.capturable else (found_inf == 0).to(torch.int64).reshape(())
        for g in self.param_groups:
            g["step"] += advance
        hyper = self.rule.hyper(self.param_groups)
        moved = self._step_on_host(hyper, grad_scale)  # None: the state is on the device
        if moved is None:
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
        self._refuse_moved_hyperparameters(moved)
        return loss

    @naming_phase("backward() (overlap_grad_sync reduces the gradients as they come)")
    def _hand_over(self, k: int, param: torch.Tensor) -> None:
        """Backward handed parameter k's gradient over (grad_ready in
        _hooks.py, outside no_sync() once the backward order is known): into
        its bucket, whose reduce-scatter starts once the bucket is complete."""
        self._leave_consumed([k])
        self.iteration.move_grads(Grads.REDUCING)
        if self.iteration.host_step is None and self.host_step_in_backward:
            self._arm_host_step()
        self._grad_sync.pack(k, param.grad)
        if self.contiguous_grad_buffer:
            param.grad = self._grad_views[k]
            self._hand_over_guard.record(self)  # [Note: gradients set after the hand-over]
        else:
            param.grad = None

    def _leave_consumed(self, params) -> None:
        """Before the first gradient of an iteration after a step that left
        its reduced shards in the gradient buffer (Grads.CONSUMED): refuse a
        gradient that autograd added into the buffer (params: indices whose
        .grad to look at: _guard_hand_over.py), else clear this rank's shard
        of it, which the gradients that replaced their views do not all cover."""
        if self.iteration.grads is not Grads.CONSUMED:
            return
        HandOverGuard.refuse_added_into_consumed(self, params)
        self.grad_shards.zero_()
        self.iteration.move_grads(Grads.REDUCING)

    def _end_iteration(self, stepped: bool = False) -> None:
        self._grad_sync.reset()
        if self._host is not None:
            self._host.settle()
        self.iteration.end(consumed=stepped and self.grads_in_buffer)

    @naming_phase("zero_grad()")
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears gradients; with contiguous_grad_buffer the buffer is zeroed
        and parameters keep their views of it whatever set_to_none says."""
        _watchdog.check()
        self._refuse_mid_host_step("zero_grad()")
        self._grad_sync.reset()  # a reduce-scatter may still read the buffers
        self._probe.held.clear()
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

    @naming_phase("param_sync()")
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

    @property
    def params_owed(self) -> bool:
        """Whether the last step's all-gathers are still owed to the parameters (the forward hooks ask)."""
        return self.iteration.params is not Params.CURRENT

    @naming_phase("forward (overlap_param_sync waits for the parameters a module or a first use needs)")
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

    @naming_phase("grad_sync()")
    def grad_sync(self) -> None:
        """Finish this iteration's gradient synchronisation: reduce-scatter
        every bucket that backward has not started, and wait for all."""
        if self._probe.active:
            self._adopt_backward_order()
        self._hand_over_guard.refuse(self)
        self._leave_consumed(range(len(self.params)))
        for k, grad in self._probe.held_in_order(self.params):  # [Note: the first backward's gradients in host memory]
            self._grad_sync.pack(k, grad.to(self.device))
        self._grad_sync.finish(release_grads=not self.contiguous_grad_buffer)
        if self.contiguous_grad_buffer:
            self._hand_over_guard.record(self)  # after the synchronisation's own writes
        else:
            for p in self.params:  # handed over: the reduced shards hold them now
                p.grad = None
        self.iteration.move_grads(Grads.REDUCED)

    @property
    def transports(self) -> dict:
        """The transport of each direction, by name: {"grad_sync": ..., "param_sync": ...}
        (e.g. "nccl reduce-scatter", "copy-engine all-gather")."""
        return {"grad_sync": self._grad_sync.transport.name, "param_sync": self._param_sync.transport.name}

    def __reduce_ex__(self, protocol):
        refuse_copy(self)  # [Note: copies of an optimizer] in .._optimizer_copies

    def __repr__(self) -> str:
        return describe(self)
