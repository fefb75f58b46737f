"""The tensor scan ([Note: the tensor scan] in shardadam/_addresses.py): the
compiled pass and the Python fallback read what torch's own API reads, raise
where it raises, and the optimizers' move checks behave alike on both."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch.autograd.graph import increment_version

import shardadam
from shardadam import _addresses

ADDRESSES = Path(_addresses.__file__)
PUBLIC = ("addresses", "memory_records", "grads", "grads_and_records", "pointers", "pointer_record", "splice", "bump_versions")


def _python_fallback():
    """A copy of _addresses imported as if the build had no tensor scan."""
    saved = sys.modules.get("shardadam._tensor_scan")
    attribute = shardadam.__dict__.pop("_tensor_scan", None)
    sys.modules["shardadam._tensor_scan"] = None  # the import raises ImportError
    try:
        spec = importlib.util.spec_from_file_location("shardadam._addresses_fallback", ADDRESSES)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules["shardadam._tensor_scan"]
        else:
            sys.modules["shardadam._tensor_scan"] = saved
        if attribute is not None:
            shardadam._tensor_scan = attribute
    assert not module.SCAN_IN_C
    return module


FALLBACK = _python_fallback()


@pytest.fixture(params=["compiled", "python"])
def scan(request):
    return _addresses if request.param == "compiled" else FALLBACK


@pytest.fixture
def python_scan(monkeypatch):
    """Every caller of shardadam._addresses takes the Python passes."""
    for name in PUBLIC:
        monkeypatch.setattr(_addresses, name, getattr(FALLBACK, name))


def test_the_build_uses_the_compiled_scan():
    # Every documented build (pip install --no-build-isolation) sees torch, so
    # the helper is built, and for this very torch.
    scan_module = importlib.import_module("shardadam._tensor_scan")
    assert scan_module.TORCH_VERSION == torch.__version__
    assert _addresses.SCAN_IN_C


def _assorted():
    base = torch.arange(64, dtype=torch.float32)
    return [
        torch.nn.Parameter(torch.randn(3, 5)),
        base[7:19],                      # a view with a storage offset
        base.view(8, 8).t(),             # not contiguous
        base.view(torch.bfloat16)[3:9],  # a dtype view
        torch.zeros(4, dtype=torch.float16),
        torch.zeros(5, dtype=torch.int64),
        torch.zeros(0),                  # zero-size: pointer 0
        torch.zeros(2, 3, dtype=torch.complex64),
        torch.ones(3, dtype=torch.bool),
    ]


def test_addresses_are_the_data_pointers(scan):
    tensors = _assorted()
    assert scan.pointers(scan.addresses(tensors)) == [t.data_ptr() for t in tensors]
    assert scan.pointers(scan.addresses(tuple(tensors))) == [t.data_ptr() for t in tensors]
    assert scan.pointers(scan.addresses([])) == []


def test_memory_records_tell_apart_address_size_and_dtype(scan):
    tensors = _assorted()
    before = scan.memory_records(tensors)
    assert scan.memory_records(tensors) == before
    assert scan.pointer_record(before) == scan.addresses(tensors)
    same_bytes_other_dtype = tensors[0].detach().view(torch.int32)
    fewer_elements = tensors[0].detach().reshape(-1)[:10]
    for replacement in (same_bytes_other_dtype, fewer_elements, torch.randn(3, 5)):
        changed = list(tensors)
        changed[0] = replacement
        assert scan.memory_records(changed) != before, replacement


def test_grads_are_the_tensors_grads(scan):
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(4)] + [torch.randn(2, requires_grad=True)]
    (sum(p.sum() for p in params[1:])).backward()  # autograd's gradients: no Python object yet
    params[2].grad = torch.ones(3)  # one set from Python
    got = scan.grads(params)
    assert got[0] is None
    assert all(g is p.grad for g, p in zip(got, params))
    with pytest.raises((TypeError, AttributeError)):  # the fallback's attrgetter: AttributeError
        scan.grads([params[0], "not a tensor"])


def test_grads_and_records_are_grads_then_their_records(scan):
    params = [torch.nn.Parameter(torch.randn(3, dtype=dtype)) for dtype in (torch.float32, torch.float64,
                                                                             torch.bfloat16)]
    params[0].grad, params[1].grad = torch.ones(3), torch.ones(6, dtype=torch.float64)[::2]
    params[2].grad = torch.zeros(3, dtype=torch.bfloat16)
    got, records = scan.grads_and_records(params)
    assert all(g is p.grad for g, p in zip(got, params))
    assert records == scan.memory_records(got)
    params[1].grad = None
    got, records = scan.grads_and_records(params)
    assert got[1] is None and got[0] is params[0].grad and records is None
    params[1].grad = torch.ones(3, dtype=torch.float64).to_sparse()  # no storage: no records, the gradients still read
    got, records = scan.grads_and_records(params)
    assert got[1] is params[1].grad and records is None
    with pytest.raises((TypeError, AttributeError)):  # as grads
        scan.grads_and_records([params[0], "not a tensor"])


def test_splice_replaces_a_span(scan):
    a, b = _assorted()[:2], [torch.zeros(3), torch.zeros(4), torch.zeros(5)]
    record = scan.addresses(a + b)
    assert scan.pointers(scan.splice(record, 2, 5, scan.addresses(b[::-1]))) == [
        t.data_ptr() for t in a + b[::-1]]


def test_non_tensors_and_tensors_without_storage_raise_as_data_ptr_does(scan):
    t = torch.zeros(3)
    with pytest.raises(TypeError):
        scan.addresses([t, None])
    with pytest.raises(TypeError):
        scan.memory_records([t, 3.0])
    sparse = torch.zeros(4, 4).to_sparse()
    with pytest.raises(RuntimeError):
        sparse.data_ptr()
    with pytest.raises(RuntimeError):
        scan.addresses([t, sparse])
    with pytest.raises(RuntimeError):
        scan.memory_records([sparse])


def test_bumps_count_like_increment_version(scan):
    tensors = [torch.zeros(3), torch.nn.Parameter(torch.zeros(2)), torch.zeros(0)]
    reference = [t.detach().clone() for t in tensors]
    for _ in range(3):
        scan.bump_versions(tensors)
        increment_version(reference)
    assert [t._version for t in tensors] == [r._version for r in reference] == [3, 3, 3]
    scan.bump_versions([])


def test_a_bump_makes_backward_refuse_a_saved_tensor(scan):
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(3)
    y = (w * x).sum()  # saves x
    scan.bump_versions([x])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_an_inference_tensor_is_passed_over_as_increment_version_does(scan):
    with torch.inference_mode():
        t = torch.zeros(3)
    plain = torch.zeros(2)
    increment_version([t])  # torch's own: no counter to bump, no error
    scan.bump_versions([t, plain])
    assert plain._version == 1


# ---------------------------------------------------------------- the callers, on the Python passes


@pytest.mark.usefixtures("python_scan")
def test_a_moved_plan_tensor_is_refused_on_the_python_passes():
    p, g, m, v = (torch.randn(10) for _ in range(4))
    plan = shardadam.kernels.AdamPlan([p], [g], [m], [v])
    shardadam.kernels.adam(plan, lr=1e-3, step=1)
    m.data = torch.zeros(10)
    with pytest.raises(RuntimeError, match=r"exp_avgs\[0\] was moved to other memory"):
        shardadam.kernels.adam(plan, lr=1e-3, step=2)


@pytest.mark.usefixtures("python_scan")
def test_fused_adam_follows_moves_on_the_python_passes():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = shardadam.FusedAdam(params, lr=1e-2, weight_decay=0.01)
    ref = torch.optim.AdamW(refs, lr=1e-2, weight_decay=0.01)
    for step in range(4):
        if step == 2:  # a parameter and a gradient move to other memory
            params[1].data = params[1].data.clone()
            refs[1].data = refs[1].data.clone()
        for p, r in zip(params, refs):
            g = torch.randn_like(p)
            p.grad, r.grad = g, g.clone()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    for p, r in zip(params, refs):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    params[0].data = torch.randn(3, 5)
    params[0].grad = torch.randn(3, 5)
    with pytest.raises(ValueError, match="changed shape"):
        opt.step()
