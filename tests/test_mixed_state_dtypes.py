"""Mixed state dtypes (bf16 for both states, FP8 exp_avg with fp32 or bf16
exp_avg_sq, scaled fp16 for both) have kernels of their own on the GPU
(cuda/adam.cu); they must compute what the CPU engine computes, for fp32
parameters, fp32 masters with a bf16 copy and bf16 parameters that are their
own master: parameters within fp32 rounding, stored state bytes equal but for
rare ties (the compilers contract the update's multiply-adds differently)."""
from __future__ import annotations

import pytest
import torch

from shardadam import kernels

F8 = torch.float8_e4m3fn
STATES = {"bf16+bf16": (torch.bfloat16, torch.bfloat16), "fp8+fp32": (F8, torch.float32),
          "fp8+bf16": (F8, torch.bfloat16), "fp16+fp16": (torch.float16, torch.float16)}
SIZES = [2 * 65536 + 5, 4099, 1000, 3]


def _run(device: str, states: tuple, params: str) -> tuple:
    gen = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16 if params == "bf16" else torch.float32
    p = [torch.randn(n, generator=gen).to(device, dtype) for n in SIZES]
    out = [torch.empty(n, dtype=torch.bfloat16, device=device) for n in SIZES] if params == "fp32+bf16-copy" else None
    m = [torch.zeros(n, device=device).to(states[0]) for n in SIZES]
    v = [torch.zeros(n, device=device).to(states[1]) for n in SIZES]
    scales = {}
    for name, dt in zip(("exp_avg_scales", "exp_avg_sq_scales"), states):
        if dt in (F8, torch.float16):
            scales[name] = torch.ones(len(SIZES), device=device)
    rounding = dict(stochastic_rounding_seed=99) if params == "bf16" else {}
    for step in range(1, 4):
        grads = [torch.randn(n, generator=gen).mul(1e-2).to(device, dtype) for n in SIZES]
        kernels.adam(p, grads, m, v, lr=1e-2, step=step, weight_decay=0.1, params_out=out, **scales, **rounding)
    return p, out, m, v, scales


@pytest.mark.cuda
@pytest.mark.parametrize("params", ["fp32", "fp32+bf16-copy", "bf16"])
@pytest.mark.parametrize("states", list(STATES))
def test_mixed_state_kernels_compute_what_the_cpu_engine_computes(states, params):
    cpu = _run("cpu", STATES[states], params)
    gpu = _run("cuda", STATES[states], params)
    for i, (a, b) in enumerate(zip(cpu[0], gpu[0])):
        b = b.cpu()
        if a.dtype == torch.bfloat16:
            off = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
            assert off.max() <= 1 and (off != 0).float().mean() < 1e-3, f"params[{i}]"
        else:
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=lambda m: f"params[{i}]: {m}")
    if params == "fp32+bf16-copy":
        for i, (o, q) in enumerate(zip(gpu[1], gpu[0])):
            assert torch.equal(o.view(torch.int16), q.to(torch.bfloat16).view(torch.int16)), f"params_out[{i}]"
    for name, a_list, b_list in (("exp_avg", cpu[2], gpu[2]), ("exp_avg_sq", cpu[3], gpu[3])):
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            assert a.abs().float().max() > 0, f"{name}[{i}] was never written"
            differ = (a.view(torch.uint8) != b.cpu().view(torch.uint8)).float().mean()
            assert differ < 1e-3, f"{name}[{i}]: {differ:.2e} of the bytes differ"
    for name in cpu[4]:
        torch.testing.assert_close(gpu[4][name].cpu(), cpu[4][name], rtol=0, atol=0)
