"""TransformerEngine's and apex's FusedAdam interface, on shardadam's FusedAdam.

What they have beyond torch.optim's: ``set_grad_none`` (apex's zero_grad
default, TE's older spelling of ``zero_grad(set_to_none=...)``), TE's
``use_decoupled_grad`` (gradients in ``p.decoupled_grad``), ``master_weights``
given as a list of tensors, and TE's per-state accessors
``get_unscaled_state`` / ``set_scaled_state`` / ``initialize_state``, which
read and write true fp32 values whatever the storage ([Note: storage codecs]
in _storage.py). Every check here runs before anything is written ([Note:
validate, then mutate] in _validate.py).
"""
from __future__ import annotations

import torch

from ._dtensor import is_dtensor
from ._fused_buckets import storage_kind
from ._state_dict import true_state
from ._storage import PARAM, REMAINDER, SEPARATE, codec, split_master, store

MASTER = "master_param"


def check_options(betas, exp_avg_dtype, exp_avg_sq_dtype, *, set_grad_none, use_decoupled_grad, flat_grads) -> None:
    """Options that only TE or apex spell this way, refused with the fix."""
    if isinstance(betas, bool):
        raise TypeError(
            f"FusedAdam: betas={betas!r}: positional arguments after lr follow TransformerEngine's (and torch's) "
            "order (lr, betas, eps, weight_decay, amsgrad); apex's order (lr, bias_correction, betas, eps, "
            "adam_w_mode, weight_decay, ...) must be passed by keyword")
    if set_grad_none is not None and not isinstance(set_grad_none, bool):
        raise TypeError(f"FusedAdam: set_grad_none must be True, False or None, got {set_grad_none!r}")
    if flat_grads and set_grad_none:
        raise ValueError("FusedAdam: flat_grads=True keeps gradients in the optimizer's buffers and zero_grad() "
                         "zeroes them: set_grad_none=True cannot apply (leave it None or False)")
    if flat_grads and use_decoupled_grad:
        raise ValueError("FusedAdam: flat_grads=True makes p.grad views of the optimizer's buffers, "
                         "use_decoupled_grad=True reads p.decoupled_grad: use one of them")


def check_plain_params(where: str, params) -> None:
    """TE's quantized parameters (Float8Tensor, MXFP8 and block-scaled tensors)
    hold their bytes in another format than their nominal dtype: refused."""
    for i, p in enumerate(params):
        if isinstance(p, torch.Tensor) and type(p).dequantize is not torch.Tensor.dequantize:
            raise TypeError(f"{where}['params'][{i}] is a quantized {type(p).__name__} (TransformerEngine FP8 model "
                            "weights): not supported; keep bf16/fp16 parameters with master_weights=True")


def master_list(master_weights, param_groups: list[dict]) -> list | None:
    """TE's master_weights given as a list: one fp32 tensor per parameter, in
    param_groups order, the initial value of its master. Checked here; None
    when master_weights is not a list."""
    if not isinstance(master_weights, (list, tuple)):
        return None
    params = [p for g in param_groups for p in g["params"]]
    if len(master_weights) != len(params):
        raise ValueError(f"FusedAdam: master_weights is a list of {len(master_weights)} tensors for {len(params)} "
                         "parameters: give one fp32 tensor per parameter, in param_groups order (or True)")
    for i, (p, m) in enumerate(zip(params, master_weights)):
        if not isinstance(m, torch.Tensor) or m.dtype != torch.float32 or m.shape != p.shape:
            what = f"a {m.dtype} tensor of shape {tuple(m.shape)}" if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(f"FusedAdam: master_weights[{i}] is {what}; the parameter has shape {tuple(p.shape)}: "
                             "give float32 tensors of the parameters' shapes")
    return list(zip(params, master_weights))


def check_master_list(pairs: list, store_param_remainders: bool) -> None:
    """A parameter that is its own master (fp32) or keeps no state (frozen)
    cannot take another value from the list: it must equal the parameter."""
    for i, (p, m) in enumerate(pairs):
        own = storage_kind(p, True, store_param_remainders) == PARAM or not p.requires_grad
        if own and not torch.equal(m.to(p.device), p.detach().float()):
            raise ValueError(f"FusedAdam: master_weights[{i}] differs from its parameter, which is its own master "
                             f"({p.dtype}{'' if p.requires_grad else ', requires_grad=False'}): give the "
                             "parameter's value, or set the parameter itself")


def resolve_set_to_none(set_grad_none, set_to_none) -> bool:
    """zero_grad's choice: set_grad_none when given at construction (a
    contradicting set_to_none raises, as in TE), else set_to_none (True)."""
    if set_grad_none is not None:
        if set_to_none is not None and set_to_none != set_grad_none:
            raise ValueError(f"zero_grad(set_to_none={set_to_none}) contradicts FusedAdam(set_grad_none="
                             f"{set_grad_none}): pass one of them")
        return set_grad_none
    return True if set_to_none is None else bool(set_to_none)


def zero_decoupled_grads(param_groups: list[dict], set_to_none: bool) -> None:
    for g in param_groups:
        for p in g["params"]:
            grad = getattr(p, "decoupled_grad", None)
            if set_to_none:
                p.decoupled_grad = None
            elif grad is not None:
                grad.zero_()


class StateAccess:
    """TE's per-parameter state accessors over the optimizer's buckets."""

    def __init__(self, opt):
        self.opt = opt
        self._buckets = None
        self._where: dict = {}

    def locate(self, param, name: str | None = None) -> tuple:
        """(bucket, index) of param, laying the buckets out if needed; name
        (when given) must be a state the parameter keeps."""
        buckets = self.opt._layout()
        if buckets is not self._buckets:  # rebuilt (new groups, moved storage): index it again
            self._where = {id(p): (b, j) for b in buckets for j, p in enumerate(b.owners)}
            self._buckets = buckets
        hit = self._where.get(id(param))
        if hit is not None and is_dtensor(param):
            raise ValueError("FusedAdam: TE's state accessors take plain parameters; for a DTensor parameter "
                             "read or write optimizer.state[param] (DTensors of its placements)")
        if hit is not None:
            if name is not None and name not in hit[0].states and name != MASTER:
                raise ValueError(f"FusedAdam: state_name {name!r} is not a state of this optimizer; one of "
                                 f"{list(hit[0].states) + [MASTER]}")
            return hit
        if any(p is param for g in self.opt.param_groups for p in g["params"]):
            raise ValueError("FusedAdam: the parameter has requires_grad=False: it keeps no optimizer state")
        raise ValueError("FusedAdam: the parameter is not in this optimizer's param_groups")

    def get(self, param, name: str) -> torch.Tensor:
        """A new fp32 tensor of the true values; ``master_param`` of a parameter
        that is its own master is the parameter's value."""
        b, j = self.locate(param, name)
        if name == MASTER and b.kind == PARAM:
            return param.detach().to(torch.float32, copy=True)
        return true_state(b, j, name)

    def set(self, param, name: str, values: torch.Tensor) -> None:
        """Store true values: fp16 states and masters get the scale the kernels
        would choose; a remainder master takes fp32 values (the parameter
        becomes their bf16 rounding) or, as TE stores it, the int16
        remainders; a parameter that is its own master is set itself."""
        b, j = self.locate(param, name)
        remainder_bits = name == MASTER and b.kind == REMAINDER and isinstance(values, torch.Tensor) \
            and values.dtype == torch.int16
        if not isinstance(values, torch.Tensor) or values.shape != param.shape or not (
                values.dtype == torch.float32 or remainder_bits):
            what = f"a {values.dtype} tensor of shape {tuple(values.shape)}" if isinstance(values, torch.Tensor) \
                else type(values).__name__
            raise ValueError(f"FusedAdam.set_scaled_state: unscaled_state is {what}; give a float32 tensor of the "
                             f"parameter's shape {tuple(param.shape)}")
        views = b.views[j]
        with torch.no_grad():
            if name != MASTER:
                store(views[name], values, **codec(views, name))
            elif b.kind == SEPARATE:
                store(views[MASTER], values, views.get("master_scale"))
            elif remainder_bits:
                views["param_remainder"].copy_(values.to(param.device))
            elif b.kind == REMAINDER:
                split_master(values, param.detach(), views["param_remainder"])
            else:
                param.copy_(values)

    def initialize(self, param, store_param_remainders) -> None:
        """TE's initialize_state: zero the rule's states (scales back to 1)
        and start the master from the parameter's value."""
        b, j = self.locate(param)
        if store_param_remainders is not None and bool(store_param_remainders) != (b.kind == REMAINDER):
            raise ValueError(f"FusedAdam.initialize_state: store_param_remainders={store_param_remainders} but this "
                             f"parameter ({param.dtype}) is stored {'with' if b.kind == REMAINDER else 'without'} "
                             "remainders: that is chosen at construction (FusedAdam(store_param_remainders=...))")
        views = b.views[j]
        with torch.no_grad():
            for name in b.states:
                store(views[name], torch.zeros_like(views[name], dtype=torch.float32), **codec(views, name))
            if b.kind == SEPARATE:
                store(views[MASTER], param.detach(), views.get("master_scale"))
            elif b.kind == REMAINDER:
                views["param_remainder"].zero_()
