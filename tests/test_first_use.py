"""overlap_param_sync=True never lets anyone read a stale parameter
([Note: first-use guard] in distributed/_first_use.py): parameters kept in
nn.ParameterList / nn.ParameterDict (no forward of their own), a functional
embedding, and every read after step() (p.sum(), model.state_dict(), an
evaluation forward, deepcopy) see the values torch.optim.AdamW computes on
the same batches. One rank in-process: the all-gather still lands only when
waited for, so a read that skipped the wait would see the old values."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardadam

STEPS = 4
HYPER = dict(lr=1e-2, weight_decay=0.1)


class _Containers(nn.Module):
    """apex's test model keeps its parameters in a ParameterList; here an
    nn.ParameterList and an nn.ParameterDict (whose forwards never run), a
    table read by F.embedding, and an nn.Linear (whose forward does run)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ParameterList([nn.Parameter(torch.randn(6, 6) * 0.4) for _ in range(3)])
        self.extra = nn.ParameterDict({"table": nn.Parameter(torch.randn(10, 6)),
                                       "scale": nn.Parameter(torch.ones(6))})
        self.head = nn.Linear(6, 2)

    def forward(self, tokens):
        h = F.embedding(tokens, self.extra["table"])
        for w in self.layers:
            h = torch.tanh(h @ w)
        return self.head(h * self.extra["scale"]).sum(1)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 10, (STEPS, 8, 5), generator=g), torch.randn(STEPS, 8, 2, generator=g)


def _loss(model, s):
    tokens, target = _data()
    return F.mse_loss(model(tokens[s]), target[s])


def _reference():
    """torch.optim.AdamW: the loss of every step and the parameters after each."""
    model = _Containers()
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    losses, params = [], []
    for s in range(STEPS):
        opt.zero_grad()
        loss = _loss(model, s)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        params.append([p.detach().clone() for p in model.parameters()])
    return losses, params


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _optimizer(model):
    return shardadam.DistributedFusedAdam(model.parameters(), overlap_param_sync=True, bucket_cap_mb=1e-4, **HYPER)


def test_parameter_containers_train_on_current_values(one_rank):
    """The forward reads ParameterList / ParameterDict entries and an
    F.embedding table, none through a module of their own: every step's loss
    is torch's, so no forward saw last step's values."""
    want_losses, want_params = _reference()
    model = _Containers()
    opt = _optimizer(model)
    for s in range(STEPS):
        opt.zero_grad()
        loss = _loss(model, s)
        _close(loss.detach(), want_losses[s], f"loss of step {s}")
        loss.backward()
        opt.step()
    for i, (p, w) in enumerate(zip(model.parameters(), want_params[-1])):
        _close(p.detach(), w, f"param {i}")


READS = {
    "p.sum()": lambda model: [p.sum() for p in model.parameters()],
    "model.state_dict()": lambda model: list(model.state_dict().values()),
    "p.data": lambda model: [p.data.clone() for p in model.parameters()],
    "deepcopy(model)": lambda model: list(copy.deepcopy(model).parameters()),
    "torch._foreach_mul": lambda model: torch._foreach_mul(list(model.parameters()), 1.0),
    "eval forward": lambda model: [model.eval()(torch.arange(5).view(1, 5)).detach()],
}


@pytest.mark.parametrize("read", list(READS))
def test_reads_after_step_see_the_new_values(one_rank, read):
    """After each step, before any forward, a read of the parameters sees
    what AdamW's step wrote (the evaluation forward: what a model holding
    those values outputs)."""
    _, want_params = _reference()
    model, reference = _Containers(), _Containers()
    opt = _optimizer(model)
    for s in range(2):
        opt.zero_grad()
        _loss(model, s).backward()
        opt.step()
        with torch.no_grad():
            for r, w in zip(reference.parameters(), want_params[s]):
                r.copy_(w)
        got = READS[read](model)
        model.train()
        want = READS[read](reference) if read != "p.sum()" else [w.sum() for w in want_params[s]]
        reference.train()
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            _close(a.detach(), b.detach(), f"step {s}, {read} [{i}]")
    assert all(type(p) is nn.Parameter for p in model.parameters()), "a parameter kept the waiting class"


def test_zero_grad_and_metadata_do_not_end_the_overlap(one_rank):
    """zero_grad() and reads of .grad / .shape between step() and the next
    forward leave the all-gathers in flight; the forward then lands them and
    every parameter is a plain nn.Parameter again."""
    model = _Containers()
    opt = _optimizer(model)
    _loss(model, 0).backward()
    opt.step()
    pending = set(opt._param_sync.pending)
    assert pending, "overlap_param_sync must leave the all-gathers in flight after step()"
    opt.zero_grad()
    model.zero_grad()
    shapes = [(p.shape, p.grad, p.requires_grad, p.data_ptr()) for p in model.parameters()]
    assert len(shapes) == 7
    assert set(opt._param_sync.pending) == pending, "a metadata read waited for the all-gathers"
    assert not any(type(p) is nn.Parameter for p in model.parameters()), "step() must arm every parameter"
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())
    _loss(model, 1).backward()
    assert not opt._param_sync.pending
    assert all(type(p) is nn.Parameter for p in model.parameters())


def test_param_sync_and_a_dropped_optimizer_disarm(one_rank):
    """param_sync() lands everything and disarms; an optimizer dropped while
    its parameters are armed gives them their class back."""
    model = _Containers()
    opt = _optimizer(model)
    _loss(model, 0).backward()
    opt.step()
    opt.param_sync()
    assert all(type(p) is nn.Parameter for p in model.parameters())
    _loss(model, 1).backward()
    opt.step()
    del opt
    assert all(type(p) is nn.Parameter for p in model.parameters())
