"""The fused single-process optimizer, for any update rule.

FusedAdam and FusedLion are this class with their rule ([Note: update rules]
in _rules.py) and their constructors. State lives in flat buffers (see
_fused_buckets.py); a step is one kernel launch per (device, storage kind)
whatever the number of parameters.
"""
from __future__ import annotations

import logging
from collections import defaultdict

import torch

from . import kernels
from ._dtensor import agree_on_flag, check_param, is_dtensor, shards_for
from ._fused_buckets import Bucket, storage_kind
from ._host_state import HostStateBucket, host_state_wanted, host_step_threads
from ._groups import check_step_groups, plain_value, run_closure
from ._optimizer_copies import construction, reduced
from ._rounding import refuse_masters, rounding_seed
from ._rules import UpdateRule
from ._state_dict import load_buckets_state, pack_state
from ._state_dict_hooks import run_load_post_hooks, state_dict_through_hooks, through_load_pre_hooks
from ._storage import BLOCKWISE8, state_storage
from ._tracked import GRAD, ReplacedParams, moved_indices

_log = logging.getLogger("shardadam")

STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, BLOCKWISE8)


class FusedOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer that steps with one fused launch per storage
    kind. Subclasses are constructors: they pick the rule and its defaults.

    Storage options (every rule): master_weights / master_weight_dtype (fp32,
    or fp16 with a per-tensor scale), store_param_remainders (bf16 params +
    int16 remainders), state_dtypes (per state: fp32, bf16, fp16 or FP8 with
    per-tensor scales, or BLOCKWISE8, where the rule allows), bf16_stochastic_round /
    stochastic_round_seed (_rounding.py), capturable, flat_grads,
    skip_nonfinite_grads, state_device: see FusedAdam's docstring. grad_of: how a
    parameter's gradient is read (``p.grad``; FusedAdam's use_decoupled_grad
    reads ``p.decoupled_grad``).
    """

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        self._construction = construction(args, kwargs)  # [Note: copies of an optimizer]
        return self

    def __reduce_ex__(self, protocol):
        return reduced(self)  # [Note: copies of an optimizer] in _optimizer_copies.py

    def __init__(self, params, defaults: dict, rule: UpdateRule, *, capturable=False, master_weights=False,
                 master_weight_dtype=torch.float32, state_dtypes: dict | None = None, store_param_remainders=False,
                 flat_grads=False, skip_nonfinite_grads=False, grad_of=GRAD, bf16_stochastic_round=False,
                 stochastic_round_seed=None, state_device=None):
        host_state = host_state_wanted(state_device, capturable=capturable, flat_grads=flat_grads)
        refuse_masters(bf16_stochastic_round, master_weights=master_weights,
                       store_param_remainders=store_param_remainders)
        self.rounding_seed = rounding_seed(bf16_stochastic_round, stochastic_round_seed)
        state_dtypes = dict(state_dtypes or {})
        for name, dtype, allowed in [("master_weight_dtype", master_weight_dtype, (torch.float32, torch.float16))] + [
                (f"{state}_dtype", dtype, STATE_DTYPES + (torch.uint8,)) for state, dtype in state_dtypes.items()]:
            if dtype not in allowed:
                raise ValueError(f"{name} must be one of {[str(a) for a in allowed]}, got {dtype}")
        state_dtypes = {state: state_storage(state, dtype) for state, dtype in state_dtypes.items()}
        if store_param_remainders and master_weight_dtype != torch.float32:
            raise ValueError("store_param_remainders makes bf16 params exact fp32 masters: it needs "
                             "master_weight_dtype=torch.float32")
        self.rule = rule
        self._opts = dict(rule=rule, capturable=capturable, master_weights=master_weights,
                          master_weight_dtype=master_weight_dtype, state_dtypes=state_dtypes,
                          store_param_remainders=store_param_remainders, flat_grads=flat_grads, grad_of=grad_of,
                          host_state=host_state,
                          host_threads=host_step_threads() if host_state else None)  # [Note: host step threads]
        self._buckets: list[Bucket] | None = None
        self._structure = None
        self._frozen: list = []
        self._replaced = ReplacedParams(type(self).__name__)
        rule.check_group(type(self).__name__, defaults)
        super().__init__(params, defaults)
        # GradScaler hands its scale and found-inf to the step (no host sync)
        # when the step counters live on the device.
        self._step_supports_amp_scaling = capturable
        # Opt-in: a step whose gradients hold inf/NaN is skipped (params,
        # states and step counters unchanged) and counted here; a device
        # tensor with capturable=True (created at the first step).
        self.skip_nonfinite_grads = bool(skip_nonfinite_grads)
        self.skipped_steps = 0

    # ------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        try:
            self._check_new_group(self.param_groups[-1])
        except (ValueError, TypeError):
            self.param_groups.pop()  # a rejected group leaves the optimizer as it was
            raise
        self._structure = None  # the layout is rebuilt at the next step

    def _check_new_group(self, group: dict) -> None:
        self.rule.check_group(f"param_groups[{len(self.param_groups) - 1}]", group)
        seen = {id(p) for g in self.param_groups[:-1] for p in g["params"]}
        devices = set()
        for i, p in enumerate(group["params"]):
            if id(p) in seen:
                raise ValueError("a parameter appears twice (in two parameter groups, or twice in one); "
                                 "give each parameter to one group once")
            seen.add(id(p))
            check_param(f"param_groups[{len(self.param_groups) - 1}]['params'][{i}]", p)
            devices.add(p.device)
        if len(devices) > 1:
            raise ValueError(f"parameters of one group are on several devices ({sorted(map(str, devices))}): "
                             "make one group per device")
        if self._opts["capturable"]:
            if any(d.type != "cuda" for d in devices):
                raise ValueError("capturable=True needs CUDA parameters (a CPU step cannot be captured)")
            device = next(iter(devices)) if devices else self._default_device()
            group["lr"] = _as_device_scalar(group["lr"], device)
            group.setdefault("step", torch.zeros((), dtype=torch.float32, device=device))
        else:
            group.setdefault("step", 0)

    def _default_device(self) -> torch.device:
        for g in self.param_groups:
            if g["params"]:
                return g["params"][0].device
        return torch.device("cuda", torch.cuda.current_device())

    def _structure_key(self) -> tuple:
        """Changes whenever groups or their parameter lists change: O(groups)."""
        return (id(self.param_groups), len(self.param_groups),
                tuple((id(g["params"]), len(g["params"])) for g in self.param_groups))

    def _layout(self) -> list[Bucket]:
        """The buckets, rebuilt when the groups changed (detected by
        _structure_key) or a parameter's storage moved (see [Note: tracked
        storage] in _tracked.py); state of parameters that were already there
        is carried over, converted to the new storage's dtype and device."""
        key = self._structure_key()
        if self._buckets is not None and key == self._structure and not self._params_moved():
            return self._buckets
        old = {id(p): views for b in (self._buckets or []) for p, views in zip(b.owners, b.views)}
        o = self._opts
        members = defaultdict(lambda: ([], [], []))
        # Frozen: requires_grad=False and no gradient; never touched, and given no
        # state, until they get one (a gradient set by hand counts, as in torch.optim).
        self._frozen = []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if not p.requires_grad and o["grad_of"](p) is None:
                    self._frozen.append(p)
                    continue
                kind = storage_kind(p, o["master_weights"], o["store_param_remainders"])
                ps, gs, names = members[(p.device, kind, is_dtensor(p))]  # [Note: DTensor parameters]
                ps.append(p)
                gs.append(gi)
                names.append(f"param_groups[{gi}]['params'][{pi}]")
        self._buckets = [_bucket_class(o, device)(kind, ps, gs, len(self.param_groups), o, names,
                                                  shards_for(ps, names))
                         for (device, kind, _), (ps, gs, names) in members.items()]
        self._replaced.track(p for g in self.param_groups for p in g["params"])
        for b in self._buckets:
            for j, (p, views) in enumerate(zip(b.owners, b.views)):
                for name, view in views.items():
                    if id(p) in old:
                        view.copy_(old[id(p)][name])
                self.state[p].update(b.exposed_state(j))
            if o["flat_grads"]:
                b.use_flat_grads()
        self._structure = key
        return self._buckets

    def _params_moved(self) -> bool:
        """True when a parameter now lives in other memory (model.to(...),
        p.data = ...): the buckets must follow. A new shape cannot be followed
        (its state has the old one): that raises, before anything changes."""
        moved = False
        for b in self._buckets:
            current = b.shards.tensors(b.owners)
            for i in moved_indices(current, b.param_ptrs):
                p = current[i]
                if p.shape != b.param_shapes[i]:
                    raise ValueError(
                        f"{b.names[i]} changed shape from {tuple(b.param_shapes[i])} to {tuple(p.shape)} since the "
                        "optimizer last saw it (p.data = ... with another shape): its optimizer state has the old "
                        "shape. Build a new optimizer for the new parameter (or load a state dict of its shape)")
                moved = True
        return moved

    # ------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        # What can fail (hyperparameters, storage, gradients, plans) is checked
        # before anything changes: [Note: validate, then mutate] in _validate.py.
        check_step_groups(self.param_groups, self.rule)
        self._replaced.check()
        if any(self._opts["grad_of"](p) is not None for p in self._frozen):  # unfrozen since the layout was built
            self._structure = None
        buckets = self._layout()
        prepared = []
        for b in buckets:
            if self._opts["flat_grads"]:
                b.check_flat_grads()
            prepared.append(b.prepare())
        # Set by torch.amp.GradScaler.step (capturable only): the scale the
        # gradients still carry and the device flag of inf/NaN gradients. The
        # kernel stores the gradients back unscaled, as torch's fused Adam.
        scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and not self._opts["capturable"] and found_inf.item():
            return loss  # host step counters: a skipped step must not advance them
        if self.skip_nonfinite_grads:
            nonfinite = agree_on_flag(_nonfinite_grads(buckets, prepared), buckets)  # every rank skips alike
            if nonfinite is not None and not self._opts["capturable"]:
                if nonfinite.item():  # the host's step counters must know
                    self.skipped_steps += 1
                    _log.warning("%s: step skipped: the gradients hold inf or NaN (%d steps skipped so far)",
                                 type(self).__name__, self.skipped_steps)
                    return loss
            elif nonfinite is not None:
                found_inf = nonfinite if found_inf is None else torch.maximum(
                    found_inf.to(nonfinite.device, torch.float32).reshape(()), nonfinite)
                if not isinstance(self.skipped_steps, torch.Tensor):
                    self.skipped_steps = torch.zeros((), dtype=torch.int64, device=nonfinite.device)
                self.skipped_steps += (found_inf != 0).to(torch.int64).reshape(())
        if self._opts["capturable"]:
            for group in self.param_groups:
                group["step"] += 1 if found_inf is None else 1 - found_inf.to(group["step"].device)
        else:
            for group in self.param_groups:
                group["step"] += 1
        hyper = self.rule.hyper(self.param_groups)
        for b, ready in zip(buckets, prepared):
            if ready is None:
                continue
            # The kernels multiply gradients by grad_scale: pass 1 / scale.
            inv_scale = 1.0 if scale is None else torch.reciprocal(scale.to(b.device, torch.float32))
            b.launch(ready, hyper, inv_scale, None if found_inf is None else found_inf.to(b.device, torch.float32),
                     unscale_grads=scale is not None, rounding_seed=self.rounding_seed)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._opts["flat_grads"] and self._buckets is not None:
            for b in self._buckets:
                b.zero_flat_grads()
            return
        super().zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Per-parameter fp32 state (unscaled; masters as true fp32 values) and
        the groups' hyperparameters and step counters, independent of the state
        dtypes chosen here; through torch.optim's state-dict hooks ([Note:
        state-dict hooks] in _state_dict_hooks.py)."""
        return state_dict_through_hooks(self, self.plain_state_dict)

    def plain_state_dict(self) -> dict:
        """state_dict() without the hooks."""
        return pack_state(self, self._buckets or [])

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores states and hyperparameters; the caller's dict is not
        modified. Runs torch.optim's load hooks ([Note: state-dict hooks])."""
        load_buckets_state(self, self._layout, through_load_pre_hooks(self, state_dict))
        run_load_post_hooks(self)

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for i, g in enumerate(self.param_groups):
            values = ", ".join(f"{k}={plain_value(g[k])}" for k in self.rule.group_keys + ("maximize", "step"))
            lines.append(f"  group {i}: {len(g['params'])} params, {values}")
        shown = {k: v for k, v in self._opts.items()
                 if k not in ("rule", "state_dtypes", "grad_of", "host_state", "host_threads")}
        shown["state_device"] = "cpu" if self._opts["host_state"] else None
        options = dict(self.rule.options(), **shown,
                       **{f"{k}_dtype": v for k, v in self._opts["state_dtypes"].items()})
        opts = ", ".join(f"{k}={str(v).replace('torch.', '')}" for k, v in options.items())
        lines.append(f"  options: {opts}")
        lines.append(")")
        return "\n".join(lines)


def _bucket_class(opts: dict, device: torch.device):
    """Host state for GPU parameters when asked; CPU parameters' state is in host memory anyway."""
    return HostStateBucket if opts["host_state"] and device.type == "cuda" else Bucket


def _nonfinite_grads(buckets: list, prepared: list) -> torch.Tensor | None:
    """1.0 in a 0-d float32 tensor (on the first bucket's device) when any
    gradient a prepared step reads holds inf or NaN, else 0.0; None when no
    bucket steps. One norm launch per bucket, no host sync."""
    flags = [kernels.l2_norm(b.grads_read(ready)).nonfinite for b, ready in zip(buckets, prepared)
             if ready is not None]
    if not flags:
        return None
    total = flags[0]
    for flag in flags[1:]:
        total = torch.maximum(total, flag.to(total.device))
    return total.reshape(())


def _as_device_scalar(value, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError("lr must be a number or a one-element tensor")
        return value.to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(value), dtype=torch.float32, device=device)
