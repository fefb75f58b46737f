"""FusedAdam with torch.amp.GradScaler: steps with inf/NaN gradients are skipped
bit for bit, the others equal torch AdamW under the same scaler. Without
capturable the scaler unscales and skips step() itself; with capturable=True
(CUDA) FusedAdam takes the scale and the found-inf flag on the device
(``_step_supports_amp_scaling``) and the kernel writes the gradients back
unscaled, as torch's fused AdamW (scaled ones stay after a skipped step).
Either way no FutureWarning: GradScaler's attribute protocol, no grad_scaler
keyword."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_bits_equal
from shardadam import FusedAdam
from test_fused_adam_helpers import (assert_opt_unchanged, assert_params_match, assert_states_match, batches,
                                     clone_model, copy_grads, make_model, snapshot_opt)

LR = 2.0 ** -10  # exact in float32: capturable keeps lr in a float32 tensor
HYPER = dict(lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)
STEPS = 10
# step -> (value written into one gradient element, param index)
INJECT = {3: (float("inf"), 0), 6: (float("nan"), 5), 7: (float("-inf"), 3)}


def _run_with_scaler(device, capturable):
    model = make_model(device)
    ref = clone_model(model)
    params, rparams = list(model.parameters()), list(ref.parameters())
    opt = FusedAdam(params, capturable=capturable, **HYPER)
    assert opt._step_supports_amp_scaling is capturable
    topt = torch.optim.AdamW(rparams, foreach=False, **HYPER)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2)
    rscaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2)
    assert scaler.is_enabled()
    scales = []
    for s, (x, y) in enumerate(batches(STEPS, device), 1):
        opt.zero_grad()
        topt.zero_grad()
        loss = F.mse_loss(model(x), y)
        scaled = scaler.scale(loss)
        scaled.backward()
        # rscaler's gradients are copies of these; it scales the same loss alike.
        assert_bits_equal(rscaler.scale(loss.detach()), scaled.detach(), f"step {s} scaled loss")
        if s in INJECT:
            value, i = INJECT[s]
            params[i].grad.view(-1)[2] = value
        copy_grads(params, rparams)
        scaled_grads = [p.grad.clone() for p in params]
        before = snapshot_opt(opt, params)
        scale_before = scaler.get_scale()
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            scaler.step(opt)
        scaler.update()
        rscaler.step(topt)
        rscaler.update()
        scales.append(scaler.get_scale())
        assert scaler.get_scale() == rscaler.get_scale()
        # torch's unscale_ multiplies by 1/scale, a power of two: the unscaled
        # gradients are bit-equal however they were made. A skipped capturable
        # step writes nothing, gradients included (torch's fused AdamW).
        want = scaled_grads if capturable and s in INJECT else [p.grad for p in rparams]
        for i, (p, g) in enumerate(zip(params, want)):
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m: f"step {s}: grad[{i}] after scaler.step: {m}")
        if s in INJECT:
            assert scaler.get_scale() == scale_before / 2
            assert_opt_unchanged(opt, params, before, f"step {s} with a non-finite gradient")
        else:
            step = opt.param_groups[0]["step"]
            step = step.item() if isinstance(step, torch.Tensor) else step
            prev = before["steps"][0]
            prev = prev.item() if isinstance(prev, torch.Tensor) else prev
            assert step == prev + 1
    # The scale both fell (skipped steps) and grew (growth_interval 2).
    assert max(scales) > 2.0 ** 10 and min(scales) < max(scales)
    assert_params_match(params, rparams)
    assert_states_match(opt, params, topt, rparams)
    step = opt.param_groups[0]["step"]
    assert (step.item() if isinstance(step, torch.Tensor) else step) == STEPS - len(INJECT)


def test_grad_scaler_skips_nonfinite_steps_like_torch(device):
    _run_with_scaler(device, capturable=False)


@pytest.mark.cuda
def test_grad_scaler_with_capturable_step():
    _run_with_scaler("cuda", capturable=True)
