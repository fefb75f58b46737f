"""FusedMuon on CUDA only: capturable steps (no host sync, CUDA-graph
replay) and GradScaler."""
from __future__ import annotations

import pytest
import torch

from shardadam import FusedMuon

from muon_reference import gradients

pytestmark = pytest.mark.cuda

ADAMW = dict(use_muon=False, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)


def _params():
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32, 64), (4, 16, 48), (64,), (10, 4)]
    return [torch.randn(s, generator=gen).cuda().requires_grad_(True) for s in shapes]


def _opt(ps, **kw):
    # fp32 Newton-Schulz: runs that should agree are not a bf16 step apart
    # wherever cuBLAS picks another algorithm (inside a graph capture, say).
    return FusedMuon([dict(params=ps[:3]), dict(params=ps[3:], **ADAMW)], lr=0.02, ns_dtype=torch.float32, **kw)


def test_capturable_step_never_syncs_with_the_host():
    ps = _params()
    opt = _opt(ps, capturable=True)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()  # plans built, state allocated
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_graph_replay_matches_eager_steps():
    grads = gradients(_params(), steps=4)
    eager_ps, graph_ps = _params(), _params()
    eager, graphed = _opt(eager_ps, capturable=True), _opt(graph_ps, capturable=True)
    for step_grads in grads:
        for p, g in zip(eager_ps, step_grads):
            p.grad = g.cuda()
        eager.step()
    static = [g.cuda() for g in grads[0]]
    for p, g in zip(graph_ps, static):
        p.grad = g
    graphed.step()  # step 1 eagerly: plans and state exist before capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        graphed.step()
    torch.cuda.current_stream().wait_stream(side)
    for step_grads in grads[1:]:
        for s, g in zip(static, step_grads):
            s.copy_(g)
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(graph_ps, eager_ps):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert float(graphed.state[graph_ps[3]]["step"]) == 4


def test_grad_scaler_unscales_and_skips_overflowing_steps():
    scaled_ps, plain_ps = _params(), _params()
    scaled, plain = _opt(scaled_ps, capturable=True), _opt(plain_ps, capturable=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
    grads = gradients(scaled_ps, steps=2)
    for step_grads in grads:
        loss = sum((p * g.cuda()).sum() for p, g in zip(scaled_ps, step_grads))
        scaler.scale(loss).backward()
        scaler.step(scaled)
        scaler.update()
        scaled.zero_grad()
        for p, g in zip(plain_ps, step_grads):
            p.grad = g.cuda()
        plain.step()
    for a, b in zip(scaled_ps, plain_ps):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    before = [p.detach().clone() for p in scaled_ps] + [v.clone() for p in scaled_ps
                                                        for v in scaled.state[p].values()]
    loss = sum((p * float("inf")).sum() for p in scaled_ps)
    scaler.scale(loss).backward()
    scaler.step(scaled)
    scaler.update()
    after = [p.detach() for p in scaled_ps] + [v for p in scaled_ps for v in scaled.state[p].values()]
    for a, b in zip(after, before, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
