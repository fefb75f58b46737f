"""Independent float64 optimizer steps, written from the algorithms'
definitions and the reference implementations' documented conventions, not
from shardadam's code: Adam / AdamW (Kingma & Ba; Loshchilov & Hutter for
decoupled decay; torch.optim) and Lion (Chen et al. 2023; lion-pytorch).

All inputs may be of any float dtype; everything is computed in float64 and
float64 tensors come back. ``step`` is the number of the update being applied
(1 for the first one); ``grad_scale`` multiplies the gradient.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class AdamHyper:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    adam_w_mode: bool = True
    bias_correction: bool = True
    maximize: bool = False
    grad_scale: float = 1.0

    def kwargs(self) -> dict:
        """The same hyperparameters as shardadam.kernels.adam keywords."""
        return dict(lr=self.lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                    weight_decay=self.weight_decay, adam_w_mode=self.adam_w_mode,
                    bias_correction=self.bias_correction, maximize=self.maximize,
                    grad_scale=self.grad_scale)


@dataclass
class StepResult:
    param: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor | None
    # Magnitudes of the terms each result was computed from: fp32 arithmetic on
    # them errs by a few units of 2^-24 times these (used for tolerances).
    param_terms: torch.Tensor
    exp_avg_terms: torch.Tensor
    exp_avg_sq_terms: torch.Tensor


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(dtype=torch.float64, device="cpu").reshape(-1)


def adam_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq=None, *, step: int, h: AdamHyper) -> StepResult:
    p, g, m, v = _f64(param), _f64(grad), _f64(exp_avg), _f64(exp_avg_sq)
    vmax = _f64(max_exp_avg_sq) if max_exp_avg_sq is not None else None

    g = g * h.grad_scale
    if h.maximize:
        g = -g
    g_terms = g.abs()
    if h.adam_w_mode:
        p_decayed = p * (1.0 - h.lr * h.weight_decay)
    else:
        g_terms = g_terms + (h.weight_decay * p).abs()
        g = g + h.weight_decay * p
        p_decayed = p

    m_new = h.beta1 * m + (1.0 - h.beta1) * g
    v_new = h.beta2 * v + (1.0 - h.beta2) * g * g
    m_terms = (h.beta1 * m).abs() + (1.0 - h.beta1) * g_terms
    v_terms = (h.beta2 * v).abs() + (1.0 - h.beta2) * g_terms * g_terms

    if vmax is not None:
        vmax_new = torch.maximum(vmax, v_new)
        v_used = vmax_new
    else:
        vmax_new = None
        v_used = v_new

    if h.bias_correction:
        bc1 = 1.0 - h.beta1 ** step
        bc2 = 1.0 - h.beta2 ** step
    else:
        bc1 = bc2 = 1.0
    denom = v_used.sqrt() / math.sqrt(bc2) + h.eps
    step_size = h.lr / bc1
    update = step_size * m_new / denom
    p_new = p_decayed - update
    p_terms = p_decayed.abs() + step_size * m_terms / denom
    return StepResult(p_new, m_new, v_new, vmax_new, p_terms, m_terms, v_terms)


def adam_steps(param, grads, exp_avg, exp_avg_sq, max_exp_avg_sq=None, *, first_step: int = 1,
               h: AdamHyper) -> StepResult:
    """Several steps in float64 throughout (no rounding between steps)."""
    p, m, v, vmax = _f64(param), _f64(exp_avg), _f64(exp_avg_sq), None
    if max_exp_avg_sq is not None:
        vmax = _f64(max_exp_avg_sq)
    r = None
    for i, g in enumerate(grads):
        r = adam_step(p, g, m, v, vmax, step=first_step + i, h=h)
        p, m, v, vmax = r.param, r.exp_avg, r.exp_avg_sq, r.max_exp_avg_sq
    return r


@dataclass
class LionHyper:
    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.0
    maximize: bool = False
    grad_scale: float = 1.0

    def kwargs(self) -> dict:
        """The same hyperparameters as shardadam.kernels.lion keywords."""
        return dict(lr=self.lr, beta1=self.beta1, beta2=self.beta2, weight_decay=self.weight_decay,
                    maximize=self.maximize, grad_scale=self.grad_scale)


@dataclass
class LionStepResult:
    param: torch.Tensor
    exp_avg: torch.Tensor
    update: torch.Tensor  # beta1 * exp_avg + (1 - beta1) * grad, whose sign moves the param
    # Magnitudes of the terms each result was computed from (see StepResult).
    param_terms: torch.Tensor
    exp_avg_terms: torch.Tensor
    update_terms: torch.Tensor


def lion_step(param, grad, exp_avg, *, h: LionHyper) -> LionStepResult:
    """One Lion step (Chen et al. 2023): decoupled weight decay, the
    sign of an interpolation of momentum and gradient, then the momentum.
    sign(0) = 0; a NaN interpolation gives a NaN step."""
    p, g, m = _f64(param), _f64(grad), _f64(exp_avg)
    g = g * h.grad_scale
    if h.maximize:
        g = -g
    p_decayed = p * (1.0 - h.lr * h.weight_decay)
    update = h.beta1 * m + (1.0 - h.beta1) * g
    direction = torch.where(update.isnan(), update, torch.sign(update))
    m_new = h.beta2 * m + (1.0 - h.beta2) * g
    return LionStepResult(
        param=p_decayed - h.lr * direction,
        exp_avg=m_new,
        update=update,
        param_terms=p.abs() + h.lr,
        exp_avg_terms=(h.beta2 * m).abs() + (1.0 - h.beta2) * g.abs(),
        update_terms=(h.beta1 * m).abs() + (1.0 - h.beta1) * g.abs(),
    )


# Unit roundoff-ish constants per storage dtype: relative spacing (ulp at 1)
# and the smallest positive (subnormal) step.
ULP = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
TINY = {torch.float32: 2.0 ** -149, torch.float16: 2.0 ** -24, torch.bfloat16: 2.0 ** -133}
FP32_U = 2.0 ** -24


def storage_tolerance(ref: torch.Tensor, terms: torch.Tensor, dtype: torch.dtype, c: float = 16.0) -> torch.Tensor:
    """Elementwise bound for a value computed in fp32 from `terms` and stored as `dtype`:
    one ulp of the storage dtype at the reference value, plus c fp32 roundings of
    the terms it was computed from, plus the storage dtype's smallest step."""
    return ULP[dtype] * ref.abs() + c * FP32_U * terms + TINY[dtype]


def assert_within(actual: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor, what: str) -> None:
    a = _f64(actual)
    ref = ref.reshape(-1)
    tol = tol.reshape(-1)
    assert a.shape == ref.shape, f"{what}: shape {tuple(a.shape)} != {tuple(ref.shape)}"
    err = (a - ref).abs()
    bad = ~(err <= tol)  # NaN counts as bad
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.numel()} elements outside tolerance; worst ratio "
            f"{float((err / tol)[bad].nan_to_num(float('inf')).max()):.3g}; first at {i}: got {float(a[i])!r}, "
            f"reference {float(ref[i])!r}, tolerance {float(tol[i]):.3g}")
