"""GPU-only behaviour: 64-bit indexing, CUDA graphs, streams, CPU/GPU agreement."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_all_bits_equal, assert_bits_equal, rand_pos, randn, snapshot
from reference import AdamHyper, adam_step, assert_within, storage_tolerance
from shardadam import kernels

pytestmark = pytest.mark.cuda

BF16 = torch.bfloat16
B1, B2 = 0.875, 1.0 - 2.0 ** -10


def test_tensor_larger_than_2_31_elements():
    n = 2 ** 31 + 1000
    h = AdamHyper(lr=0.05, beta1=B1, beta2=B2, eps=1e-8, weight_decay=0.1)
    p = torch.randn(n, dtype=BF16, device="cuda")
    g = torch.randn(n, dtype=BF16, device="cuda")
    m = torch.randn(n, dtype=BF16, device="cuda") * 0.1
    v = torch.rand(n, dtype=BF16, device="cuda") * 0.01 + 1e-4
    # Regions: the start, across 2^31, and the very end.
    regions = [slice(0, 3000), slice(2 ** 31 - 1500, 2 ** 31 + 700), slice(n - 3000, n)]
    before = [(p[r].clone(), g[r].clone(), m[r].clone(), v[r].clone()) for r in regions]
    kernels.adam(p, g, m, v, step=2, **h.kwargs())
    for (p0, g0, m0, v0), r in zip(before, regions):
        ref = adam_step(p0, g0, m0, v0, step=2, h=h)
        assert_within(p[r], ref.param, storage_tolerance(ref.param, ref.param_terms, BF16), f"param[{r}]")
        assert_within(m[r], ref.exp_avg, storage_tolerance(ref.exp_avg, ref.exp_avg_terms, BF16), f"exp_avg[{r}]")
        assert_within(v[r], ref.exp_avg_sq, storage_tolerance(ref.exp_avg_sq, ref.exp_avg_sq_terms, BF16),
                      f"exp_avg_sq[{r}]")
        assert not torch.equal(p[r], p0)
    del m, v
    # scale in place, then copy with and without skip_if, into the grads' memory.
    want = [(p[r].float() * 0.5).to(BF16) for r in regions]
    kernels.scale(p, p, 0.5)
    for w, r in zip(want, regions):
        assert_bits_equal(p[r], w, f"scaled param[{r}]")
    g_before = [g[r].clone() for r in regions]
    kernels.copy(p, g, skip_if=torch.ones(1, device="cuda"))
    for w, r in zip(g_before, regions):
        assert_bits_equal(g[r], w, f"grads after skipped copy [{r}]")
    kernels.copy(p, g)
    for r in regions:
        assert_bits_equal(g[r], p[r], f"copy [{r}]")
    assert bool((g[-5:] == p[-5:]).all())


def _problem(sizes, device="cuda"):
    p = [randn(n, device=device) for n in sizes]
    m = [randn(n, device=device, scale=0.1) for n in sizes]
    v = [rand_pos(n, device=device) for n in sizes]
    return p, m, v


@pytest.mark.parametrize("scaled", [False, True], ids=["fp32-states", "scaled-bf16-states"])
def test_cuda_graph_capture_and_replay(scaled):
    sizes = [7, 0, 70001, 1]
    p, m, v = _problem(sizes)
    if scaled:
        m = [t.to(BF16) for t in m]
        v = [t.to(BF16) for t in v]
    g = [torch.zeros(n, device="cuda") for n in sizes]
    p2, m2, v2 = snapshot(p), snapshot(m), snapshot(v)
    sc = [torch.ones(len(sizes), device="cuda") for _ in range(2)] if scaled else [None, None]
    sc2 = [None if s is None else s.clone() for s in sc]
    lr_t = torch.zeros((), dtype=torch.float64, device="cuda")
    step_t = torch.zeros((), dtype=torch.int64, device="cuda")
    gs_t = torch.ones(1, device="cuda")
    flag = torch.zeros(1, device="cuda")
    plan = kernels.AdamPlan(p, g, m, v, exp_avg_scales=sc[0], exp_avg_sq_scales=sc[1])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.adam(plan, lr=lr_t, step=step_t, grad_scale=gs_t, weight_decay=0.01, found_inf=flag)
    # Capture ran nothing.
    torch.cuda.synchronize()
    assert_all_bits_equal(p, p2, "params after capture")
    skip_steps = {3}
    for step in range(1, 6):
        lr = 1e-3 * step
        new_g = [randn(n, device="cuda") for n in sizes]
        for dst, src in zip(g, new_g):
            dst.copy_(src)
        lr_t.fill_(lr)
        step_t.fill_(step)
        gs_t.fill_(0.5)
        flag.fill_(1.0 if step in skip_steps else 0.0)
        before = snapshot(p + m + v)
        graph.replay()
        if step in skip_steps:
            torch.cuda.synchronize()
            assert_all_bits_equal(p + m + v, before, f"replay {step} with found_inf set")
            continue
        kernels.adam(p2, new_g, m2, v2, lr=lr, step=step, grad_scale=0.5, weight_decay=0.01,
                     exp_avg_scales=sc2[0], exp_avg_sq_scales=sc2[1])
        torch.cuda.synchronize()
        assert_all_bits_equal(p, p2, f"replay {step} params")
        assert_all_bits_equal(m, m2, f"replay {step} exp_avgs")
        assert_all_bits_equal(v, v2, f"replay {step} exp_avg_sqs")
        if scaled:
            assert_bits_equal(sc[0], sc2[0], f"replay {step} exp_avg_scales")
            assert_bits_equal(sc[1], sc2[1], f"replay {step} exp_avg_sq_scales")


def test_plan_cannot_be_built_during_capture():
    p, m, v = _problem([100])
    g = [torch.zeros(100, device="cuda")]
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="before CUDA graph capture"):
        with torch.cuda.graph(graph):
            kernels.AdamPlan(p, g, m, v)


def test_kernels_run_on_the_current_stream():
    """Work queued on a side stream (behind a long sleep) is seen by the kernels,
    which must therefore launch on that stream, not the default one."""
    sizes = [7, 300001]
    p, m, v = _problem(sizes)
    grads = [randn(n, device="cuda") for n in sizes]
    p2, m2, v2 = snapshot(p), snapshot(m), snapshot(v)
    torch.cuda.synchronize()
    g = [torch.zeros(n, device="cuda") for n in sizes]
    out = [torch.zeros(n, device="cuda") for n in sizes]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the grads arrive
        for dst, src in zip(g, grads):
            dst.copy_(src)
        kernels.adam(p, g, m, v, lr=1e-3, step=1, weight_decay=0.01)
        torch.cuda._sleep(100_000_000)
        kernels.scale(p, out, 2.0)
        norms = kernels.l2_norm(p, per_tensor=True)
    torch.cuda.synchronize()
    kernels.adam(p2, grads, m2, v2, lr=1e-3, step=1, weight_decay=0.01)
    torch.cuda.synchronize()
    assert_all_bits_equal(p, p2, "params")
    assert_all_bits_equal(m, m2, "exp_avgs")
    assert_all_bits_equal(out, [t * 2.0 for t in p2], "scaled")
    want = kernels.l2_norm(p2, per_tensor=True)
    assert_bits_equal(norms.per_tensor, want.per_tensor, "per-tensor norms")


def _ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Units in the last place between fp32 values of the same sign."""
    ai = a.detach().cpu().view(torch.int32).to(torch.int64)
    bi = b.detach().cpu().view(torch.int32).to(torch.int64)
    assert bool(((a.cpu() >= 0) == (b.cpu() >= 0)).all())
    return (ai - bi).abs()


def test_cpu_and_cuda_agree():
    sizes = [1, 7, 0, 70001]
    # Params away from zero, so an ulp of the param is large next to the
    # update's own rounding: from the same inputs, the two devices' updates
    # differ far below half an ulp of the param (FMA contraction differs), so
    # the rounded params may differ by at most one ulp. Each step restarts the
    # GPU from the CPU's state, so differences cannot accumulate.
    p_cpu = [(1 + torch.rand(n)) * torch.sign(torch.randn(n)) for n in sizes]
    m_cpu = [randn(n, scale=0.1) for n in sizes]
    v_cpu = [rand_pos(n) for n in sizes]
    for step in range(1, 11):
        cuda = [[t.cuda() for t in ts] for ts in (p_cpu, m_cpu, v_cpu)]
        g = [randn(n) for n in sizes]
        kw = dict(lr=1e-3, step=step, weight_decay=0.01, beta1=0.9, beta2=0.999)
        kernels.adam(p_cpu, g, m_cpu, v_cpu, **kw)
        kernels.adam(cuda[0], [t.cuda() for t in g], cuda[1], cuda[2], **kw)
        torch.cuda.synchronize()
        for i, n in enumerate(sizes):
            if not n:
                continue
            assert int(_ulp_distance(cuda[0][i], p_cpu[i]).max()) <= 1, f"step {step}: params[{i}]"
            for name, a, b in (("exp_avg", cuda[1][i], m_cpu[i]), ("exp_avg_sq", cuda[2][i], v_cpu[i])):
                torch.testing.assert_close(a.cpu(), b, rtol=2 * 2.0 ** -23, atol=2 * 2.0 ** -23 * b.abs().max().item(),
                                           msg=lambda s: f"step {step}: {name}[{i}]: {s}")


def test_a_caught_cuda_error_does_not_fail_the_next_launch():
    """A refused runtime call (here, opening a CUDA IPC handle of zeros) also
    records its error as the thread's last error; caught in Python, it must
    not resurface as the failure of the next, unrelated kernel launch (the
    copy engines' fallback to NCCL catches such refusals)."""
    from shardadam import _core
    with pytest.raises(RuntimeError, match="cudaIpcOpenMemHandle"):
        _core.ipc_open(torch.cuda.current_device(), bytes(64))
    x = randn(1000, dtype=torch.float32, device="cuda")
    out = torch.empty_like(x)
    kernels.scale(x, out, 0.5)
    assert_bits_equal(out, x * 0.5, "scaled")
