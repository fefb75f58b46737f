"""What a launch trusts, checked: plans refuse tensors re-pointed since they
were built (before launching anything), launches bump autograd version
counters like torch's in-place ops, and hyperparameter numbers are finite and
in range before anything is written."""
from __future__ import annotations

import gc

import pytest
import torch

from conftest import assert_all_bits_equal, assert_bits_equal, rand_pos, randn, snapshot
from shardadam import kernels
from test_errors import Problem  # a valid Adam call's tensors (p, g, m, v; all())

SIZES = [5, 7, 3]
BF16 = torch.bfloat16
HYPER = dict(lr=1e-3, step=1, weight_decay=0.01)


class Full:
    """An AdamPlan with every kind of list the kernel writes or reads (bf16
    scaled states, AMSGrad, a bf16 params copy), and every tensor it holds."""

    def __init__(self, device, check_addresses=True):
        self.lists = dict(
            params=[randn(n, device=device) for n in SIZES],
            grads=[randn(n, device=device) for n in SIZES],
            exp_avgs=[randn(n, device=device, scale=0.1).to(BF16) for n in SIZES],
            exp_avg_sqs=[rand_pos(n, device=device).to(BF16) for n in SIZES],
            max_exp_avg_sqs=[rand_pos(n, device=device, low=1e-2, high=2e-2) for n in SIZES],
            params_out=[torch.zeros(n, dtype=BF16, device=device) for n in SIZES],
        )
        self.scales = dict(exp_avg_scales=torch.ones(len(SIZES), device=device),
                           exp_avg_sq_scales=torch.ones(len(SIZES), device=device))
        ls = self.lists
        self.plan = kernels.AdamPlan(ls["params"], ls["grads"], ls["exp_avgs"], ls["exp_avg_sqs"],
                                     max_exp_avg_sqs=ls["max_exp_avg_sqs"], params_out=ls["params_out"],
                                     check_addresses=check_addresses, **self.scales)

    def tensor(self, name, i):
        return self.scales[name] if name in self.scales else self.lists[name][i]

    def everything(self, but=None):
        out = [t for ts in self.lists.values() for t in ts] + list(self.scales.values())
        return [t for t in out if t is not but]


def _repoint(kind, t, device):
    """Re-point t in place; returns what must stay alive (the old memory where
    it can be kept, so that code without the check fails cleanly)."""
    keep = [t.data]
    n = t.numel()
    if kind == "data-same-shape":
        t.data = torch.zeros_like(t)
    elif kind == "data-other-shape":
        t.data = torch.zeros(2 * n + 1, dtype=t.dtype, device=device)
    elif kind == "data-other-dtype":  # same memory, read as another dtype
        t.data = t.data.view(torch.int32 if t.element_size() == 4 else torch.int16)
    elif kind == "set":
        t.set_(torch.zeros(n, dtype=t.dtype, device=device))
    elif kind == "resize-bigger":
        keep = []  # resize_ reallocates the storage itself: the old memory goes
        t.resize_(4 * n + 64)
    elif kind == "resize-smaller":
        t.resize_(n - 1)
    elif kind == "storage-freed":
        keep = []
        t.untyped_storage().resize_(0)
    else:
        raise AssertionError(kind)
    return keep


# Re-pointings that give a tensor other memory (or none): refused.
KINDS = ["data-same-shape", "data-other-shape", "set", "resize-bigger", "storage-freed"]
# Re-viewings that keep the memory: the plan goes on writing the bytes it was built on, which the tensor still owns.
SAME_MEMORY = ["data-other-dtype", "resize-smaller"]
ADAM_TARGETS = ["params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "params_out", "exp_avg_scales"]


def _expect_refusal(call, plan_name, label, untouched, moved=None):
    before = snapshot(untouched)
    moved_before = None if moved is None or moved.untyped_storage().nbytes() == 0 else moved.detach().clone()
    with pytest.raises(RuntimeError) as info:
        call()
    msg = str(info.value)
    assert msg.startswith(f"{plan_name}: {label} "), msg
    assert "new plan" in msg, msg
    assert_all_bits_equal(untouched, before, "a tensor changed although the launch was refused")
    if moved_before is not None:
        assert_bits_equal(moved, moved_before, "the re-pointed tensor")
    return msg


# ---------------------------------------------------------------- address checks

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("target", ADAM_TARGETS)
def test_adam_plan_refuses_repointed_tensor(device, target, kind):
    f = Full(device)
    kernels.adam(f.plan, **HYPER)  # a first launch is fine
    t = f.tensor(target, 1)
    keep = _repoint(kind, t, device)
    label = target if target in f.scales else f"{target}[1]"
    msg = _expect_refusal(lambda: kernels.adam(f.plan, **HYPER), "AdamPlan", label, f.everything(but=t) + keep, t)
    if kind in ("data-same-shape", "set"):
        assert "moved to other memory" in msg
    if kind == "storage-freed":
        assert "lost its memory" in msg, msg
    if target == "grads" and kind == "data-same-shape":
        assert "refresh_read_list(1, ...)" in msg


@pytest.mark.parametrize("kind", SAME_MEMORY)
def test_a_tensor_viewed_otherwise_in_its_own_memory_is_written_as_before(device, kind):
    """No refusal where the launch stays inside memory the tensor owns: the
    bytes written are the ones an untouched twin plan writes."""
    torch.manual_seed(1)
    f = Full(device)
    torch.manual_seed(1)
    twin = Full(device)
    t, u = f.tensor("params", 1), twin.tensor("params", 1)
    _repoint(kind, t, device)
    kernels.adam(f.plan, **HYPER)
    kernels.adam(twin.plan, **HYPER)
    raw = t.untyped_storage()
    assert_bits_equal(torch.empty(0, dtype=u.dtype, device=device).set_(raw, 0, (u.numel(),)), u, "params[1]")
    for a, b in zip(f.everything(but=t), twin.everything(but=u)):
        assert_bits_equal(a, b, "another tensor")


@pytest.mark.parametrize("kind", ["data-same-shape", "set", "resize-bigger", "storage-freed"])
def test_adam_plan_with_remainders_refuses_repointed_remainder(device, kind):
    p = [randn(n, device=device).to(BF16) for n in SIZES]
    g = [randn(n, device=device) for n in SIZES]
    m = [torch.zeros(n, device=device) for n in SIZES]
    v = [torch.zeros(n, device=device) for n in SIZES]
    r = [torch.zeros(n, dtype=torch.int16, device=device) for n in SIZES]
    plan = kernels.AdamPlan(p, g, m, v, param_remainders=r)
    keep = _repoint(kind, r[2], device)
    _expect_refusal(lambda: kernels.adam(plan, **HYPER), "AdamPlan", "param_remainders[2]",
                    p + g + m + v + r[:2] + keep, r[2])


@pytest.mark.parametrize("kind", ["data-same-shape", "data-other-shape", "set", "resize-bigger", "storage-freed"])
@pytest.mark.parametrize("target", ["inputs", "outputs", "in-place"])
def test_scale_plan_refuses_repointed_tensor(device, target, kind):
    x = [randn(n, device=device) for n in SIZES]
    y = [torch.zeros(n, dtype=BF16, device=device) for n in SIZES]
    flag = torch.zeros(1, device=device)
    if target == "in-place":
        plan, t, label, others = kernels.ScalePlan(x, x), x[0], "inputs[0]", x[1:]
    else:
        plan = kernels.ScalePlan(x, y)
        t = (x if target == "inputs" else y)[0]
        label, others = f"{target}[0]", [u for u in x + y if u is not t]
    keep = _repoint(kind, t, device)
    _expect_refusal(lambda: kernels.scale(plan, scale=2.0, found_inf=flag), "ScalePlan", label,
                    others + keep + [flag], t)
    _expect_refusal(lambda: kernels.copy(plan), "ScalePlan", label, others + keep + [flag], t)


@pytest.mark.parametrize("kind", ["data-same-shape", "set", "resize-bigger", "storage-freed"])
def test_norm_plan_refuses_repointed_tensor(device, kind):
    x = [randn(n, device=device) for n in SIZES]
    flag = torch.zeros(1, device=device)
    plan = kernels.NormPlan(x)
    keep = _repoint(kind, x[2], device)
    _expect_refusal(lambda: kernels.l2_norm(plan, found_inf=flag), "NormPlan", "tensors[2]", x[:2] + keep + [flag],
                    x[2])


def test_zero_size_tensor_may_move_but_others_may_not(device):
    """Nothing of a zero-size tensor is read or written: moving one is accepted
    (the plan notes its new address); a non-empty one in the same plan is not."""
    p = [randn(5, device=device), torch.empty(0, device=device), randn(3, device=device)]
    g, m, v = ([randn(t.numel(), device=device) for t in p] for _ in range(3))
    v = [t.abs() for t in v]
    plan = kernels.AdamPlan(p, g, m, v)
    p[1].data = torch.empty(0, device=device)
    kernels.adam(plan, **HYPER)
    keep = _repoint("data-same-shape", p[2], device)
    _expect_refusal(lambda: kernels.adam(plan, **HYPER), "AdamPlan", "params[2]", p[:2] + g + m + v + keep, p[2])


def test_many_tensors_name_the_right_one(device):
    """The check runs slice by slice: a tensor deep in a long plan is found
    and named, zero-size ones in other slices may move."""
    n = 700
    sizes = [0 if i % 97 == 5 else 1 + i % 3 for i in range(n)]
    p = [randn(k, device=device) if k else torch.empty(0, device=device) for k in sizes]
    g, m, v = ([torch.zeros(k, device=device) for k in sizes] for _ in range(3))
    plan = kernels.AdamPlan(p, g, m, v)
    p[5].data = torch.empty(0, device=device)
    p[684].data = torch.empty(0, device=device)
    kernels.adam(plan, **HYPER)
    keep = _repoint("data-same-shape", v[601], device)
    _expect_refusal(lambda: kernels.adam(plan, **HYPER), "AdamPlan", "exp_avg_sqs[601]",
                    p + g + m + v[:601] + v[602:] + keep, v[601])


def test_refresh_read_list_repoints_and_is_then_checked(device):
    p = [randn(n, device=device) for n in SIZES]
    g = [randn(n, device=device) for n in SIZES]
    m = [torch.zeros(n, device=device) for n in SIZES]
    v = [torch.zeros(n, device=device) for n in SIZES]
    p2, m2, v2 = snapshot(p), snapshot(m), snapshot(v)
    plan = kernels.AdamPlan(p, g, m, v)
    new_grads = [randn(n, device=device) for n in SIZES]
    kernels.adam(p2, snapshot(new_grads), m2, v2, **HYPER)  # what the refreshed plan must compute
    plan.refresh_read_list(1, new_grads)
    ids = [id(t) for t in new_grads]
    del g, new_grads
    gc.collect()  # the plan keeps the new gradients alive
    kernels.adam(plan, **HYPER)
    assert_all_bits_equal(p, p2, "params after refresh_read_list")
    assert_all_bits_equal(m + v, m2 + v2, "states after refresh_read_list")
    held = plan.lists["grads"]
    assert [id(t) for t in held] == ids
    # The refreshed list is watched from now on.
    keep = _repoint("data-same-shape", held[2], device)
    msg = _expect_refusal(lambda: kernels.adam(plan, **HYPER), "AdamPlan", "grads[2]", p + m + v + keep, held[2])
    assert "refresh_read_list" in msg
    # ... and refreshing the list again is the cure.
    plan.refresh_read_list(1, list(held))
    kernels.adam(plan, lr=1e-3, step=2)
    # New tensors must match the plan: count, sizes, dtypes, written lists fixed.
    with pytest.raises(ValueError, match=r"grads\[0\] has 6 elements"):
        plan.refresh_read_list(1, [randn(6, device=device)] + list(held[1:]))
    with pytest.raises(ValueError, match=r"grads\[1\] has 7 elements of bfloat16"):
        plan.refresh_read_list(1, [held[0], held[1].to(BF16), held[2]])
    with pytest.raises(ValueError, match="grads has 3 tensors, got 2"):
        plan.refresh_read_list(1, list(held[:2]))
    with pytest.raises(ValueError, match="params is written"):
        plan.refresh_read_list(0, [randn(n, device=device) for n in SIZES])
    with pytest.raises(ValueError, match=r"grads\[1\] is not dense"):
        plan.refresh_read_list(1, [held[0], randn(14, device=device)[::2], held[2]])
    kernels.adam(plan, lr=1e-3, step=3)  # refused refreshes changed nothing


def test_check_addresses_false_skips_the_check(device):
    """The caller vouches for the addresses: a re-pointed tensor is not noticed
    and the kernel keeps using the memory of build time (kept alive here)."""
    f = Full(device, check_addresses=False)
    assert f.plan.check_addresses is False and Full(device).plan.check_addresses is True
    p = f.lists["params"][0]
    original = p.data  # the memory the table points at stays valid
    before = original.clone()
    p.data = torch.zeros_like(p)
    kernels.adam(f.plan, **HYPER)
    assert not torch.equal(original, before), "the kernel wrote the memory the plan was built with"
    assert torch.count_nonzero(p).item() == 0, "the new memory was not written"
    x, y = [randn(n, device=device) for n in SIZES], [torch.zeros(n, device=device) for n in SIZES]
    splan = kernels.ScalePlan(x, y, check_addresses=False)
    old_y = y[1].data
    y[1].data = torch.zeros_like(y[1])
    kernels.scale(splan, scale=2.0)
    assert_bits_equal(old_y, x[1] * 2.0, "outputs[1] (the plan's memory)")
    nplan = kernels.NormPlan(x, check_addresses=False)
    old_x = x[0].data
    x[0].data = torch.zeros_like(x[0])
    assert kernels.l2_norm(nplan).total.item() > 0
    del old_x
    for cls, args in ((kernels.AdamPlan, f.lists["params"][:1] * 4), (kernels.ScalePlan, (x, x)),
                      (kernels.NormPlan, (x,))):
        with pytest.raises(TypeError, match="check_addresses"):
            cls(*args, check_addresses=1)


# ---------------------------------------------------------------- version counters

def _versions(tensors):
    return [t._version for t in tensors]


@pytest.mark.parametrize("form", ["plan", "lists"])
def test_adam_bumps_written_tensors(device, form):
    f = Full(device)
    read = f.lists["grads"]
    written = [t for n, ts in f.lists.items() if n != "grads" for t in ts] + list(f.scales.values())
    w0, r0 = _versions(written), _versions(read)
    if form == "plan":
        kernels.adam(f.plan, **HYPER)
    else:
        ls = f.lists
        kernels.adam(ls["params"], ls["grads"], ls["exp_avgs"], ls["exp_avg_sqs"],
                     max_exp_avg_sqs=ls["max_exp_avg_sqs"], params_out=ls["params_out"], **f.scales, **HYPER)
    assert all(a > b for a, b in zip(_versions(written), w0)), "a written tensor kept its version"
    assert _versions(read) == r0, "gradients are only read"


def test_adam_bumps_remainders(device):
    p = [randn(n, device=device).to(BF16) for n in SIZES]
    g, m, v = ([torch.zeros(n, device=device) for n in SIZES] for _ in range(3))
    r = [torch.zeros(n, dtype=torch.int16, device=device) for n in SIZES]
    before = _versions(p + m + v + r)
    kernels.adam(p, g, m, v, param_remainders=r, **HYPER)
    assert all(a > b for a, b in zip(_versions(p + m + v + r), before))
    assert _versions(g) == [0] * len(g)


@pytest.mark.parametrize("form", ["plan", "lists"])
def test_scale_and_copy_bump_outputs_and_flags(device, form):
    x = [randn(n, device=device) for n in SIZES]
    y = [torch.zeros(n, dtype=BF16, device=device) for n in SIZES]
    flag, skip = torch.zeros(1, device=device), torch.zeros(1, device=device)
    plan = kernels.ScalePlan(x, y)
    src = (plan,) if form == "plan" else (x, y)
    kernels.scale(*src, scale=0.5, found_inf=flag)
    assert _versions(y) == [1] * 3 and _versions(x) == [0] * 3 and flag._version == 1
    kernels.copy(*src, skip_if=skip)
    assert _versions(y) == [2] * 3 and _versions(x) == [0] * 3 and skip._version == 0
    kernels.scale(x, x, 2.0)  # in place: each tensor once at least
    assert all(v >= 1 for v in _versions(x))
    norms = kernels.l2_norm(kernels.NormPlan(y) if form == "plan" else y, found_inf=flag)
    assert flag._version == 2 and norms.nonfinite is flag and _versions(y) == [2] * 3


def test_views_bump_their_base_once(device):
    flat = torch.zeros(sum(SIZES), device=device)
    m_flat, v_flat = torch.zeros_like(flat), torch.zeros_like(flat)
    offsets = [0, 5, 12]
    p = [flat[o:o + n] for o, n in zip(offsets, SIZES)]
    m = [m_flat[o:o + n].view(n, 1) for o, n in zip(offsets, SIZES)]  # a view of a view: _base is m_flat
    v = [v_flat[o:o + n] for o, n in zip(offsets, SIZES)]
    g = [randn(n, device=device) for n in SIZES]
    plan = kernels.AdamPlan(p, g, m, v)
    assert len(plan._roots) == 3 and {id(t) for t in plan._roots} == {id(flat), id(m_flat), id(v_flat)}
    kernels.adam(plan, **HYPER)
    assert (flat._version, m_flat._version, v_flat._version) == (1, 1, 1)
    assert _versions(p + m + v) == [1] * 9  # views read their base's counter
    kernels.adam(p, g, m, v, lr=1e-3, step=2)
    assert flat._version == 2


def _saved_power_graph(w):
    # pow saves its input: backward needs w itself.
    return (w ** 2).sum()


def test_autograd_sees_the_update_like_torch_optim(device):
    """A parameter saved by the forward and updated before backward: backward
    raises the same error after kernels.adam as after torch.optim.AdamW."""
    errors = []
    for how in ("torch", "plan", "lists"):
        w = torch.nn.Parameter(randn(16, device=device))
        w.grad = randn(16, device=device)
        m, v = torch.zeros_like(w), torch.zeros_like(w)
        loss = _saved_power_graph(w)
        if how == "torch":
            torch.optim.AdamW([w], lr=1e-3).step()
        elif how == "plan":
            kernels.adam(kernels.AdamPlan([w], [w.grad], [m], [v]), **HYPER)
        else:
            kernels.adam([w], [w.grad], [m], [v], **HYPER)
        with pytest.raises(RuntimeError) as info:
            loss.backward()
        errors.append(str(info.value))
        # A graph built after the update is fine.
        w.grad = None
        _saved_power_graph(w).backward()
    for msg in errors:
        assert "modified by an inplace operation" in msg, msg
        assert "expected version 0 instead" in msg, msg


def test_adam_states_saved_by_a_graph_are_seen(device):
    """A state that is a view, saved by a graph: the kernel bumps its base,
    whose counter the view shares; backward then raises as after torch's own
    in-place update of the view."""
    for how in ("torch", "kernel"):
        w = randn(8, device=device)
        m_flat = torch.zeros(16, device=device)
        m_view = m_flat[4:12]
        v = torch.zeros(8, device=device)
        x = torch.randn(8, device=device, requires_grad=True)
        out = (x * m_view).sum()  # saves m_view for x's gradient
        if how == "torch":
            with torch.no_grad():
                m_view.add_(1.0)
        else:
            kernels.adam([w], [randn(8, device=device)], [m_view], [v], **HYPER)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward()


# ---------------------------------------------------------------- hyperparameter numbers

BAD_NUMBERS = [("inf", float("inf"), ValueError), ("-inf", float("-inf"), ValueError),
               ("nan", float("nan"), ValueError), ("str", "0.1", TypeError), ("bool", True, TypeError)]


def _refused(call, exc, words, tensors, versions=True):
    before, v0 = snapshot(tensors), _versions(tensors)
    with pytest.raises(exc) as info:
        call()
    for w in words:
        assert w in str(info.value), f"{str(info.value)!r} does not name {w!r}"
    assert_all_bits_equal(tensors, before, "a tensor changed although the call failed")
    if versions:
        assert _versions(tensors) == v0, "a refused call bumped a version counter"


@pytest.mark.parametrize("name", ["lr", "weight_decay", "eps", "beta1", "beta2", "grad_scale", "step"])
def test_adam_refuses_bad_numbers(device, name):
    pr = Problem(device, SIZES)
    plan = kernels.AdamPlan(pr.p, pr.g, pr.m, pr.v)
    for label, value, exc in BAD_NUMBERS:
        if name == "step" and label == "-inf":
            continue  # refused as < 1 already
        kw = dict(HYPER, **{name: value})
        _refused(lambda: kernels.adam(pr.p, pr.g, pr.m, pr.v, **kw), exc, [name], pr.all())
        _refused(lambda: kernels.adam(plan, **kw), exc, [name], pr.all())


def test_adam_grad_scale_must_be_positive(device):
    pr = Problem(device, SIZES)
    for value in (0.0, -1.0, -2.0 ** -10):
        _refused(lambda: kernels.adam(pr.p, pr.g, pr.m, pr.v, grad_scale=value, **HYPER), ValueError,
                 ["grad_scale", "> 0"], pr.all())
    kernels.adam(pr.p, pr.g, pr.m, pr.v, grad_scale=2.0 ** -20, **HYPER)


@pytest.mark.parametrize("name", ["beta1", "beta2", "eps", "weight_decay"])
def test_adam_host_hyperparameters_are_not_tensors(device, name):
    """beta1, beta2, eps, weight_decay are host numbers: a tensor would be
    read back (a sync) without its value being checked."""
    pr = Problem(device, SIZES)
    kw = dict(HYPER, **{name: torch.tensor(0.5, device=device)})
    _refused(lambda: kernels.adam(pr.p, pr.g, pr.m, pr.v, **kw), TypeError, [name, "Python number"], pr.all())


def test_every_group_is_checked_before_anything_is_written(device):
    pr = Problem(device, SIZES)
    plan = kernels.AdamPlan(pr.p, pr.g, pr.m, pr.v, group_sizes=[1, 1, 1])
    cases = [(dict(lr=[1e-3, 1e-3, float("inf")]), ValueError, ["lr[2]", "finite"]),
             (dict(eps=[1e-8, float("nan"), 1e-8]), ValueError, ["eps[1]"]),
             (dict(weight_decay=[0.0, 0.0, float("inf")]), ValueError, ["weight_decay[2]"]),
             (dict(beta1=[0.9, 0.9, "0.9"]), TypeError, ["beta1[2]"]),
             (dict(step=[1, 1, float("inf")]), ValueError, ["step[2]"])]
    for kw, exc, words in cases:
        args = dict(HYPER, **kw)
        _refused(lambda: kernels.adam(plan, **args), exc, words, pr.all())
    # Tensor values are read on the device, not checked: accepted as they are.
    kernels.adam(plan, lr=[torch.tensor(1e-3, device=device)] * 3, step=1,
                 grad_scale=torch.tensor(0.5, device=device))


def test_scale_refuses_bad_numbers(device):
    x = [randn(n, device=device) for n in SIZES]
    y = [torch.zeros(n, device=device) for n in SIZES]
    flag = torch.zeros(1, device=device)
    plan = kernels.ScalePlan(x, y)
    for label, value, exc in BAD_NUMBERS:
        _refused(lambda: kernels.scale(x, y, value, found_inf=flag), exc, ["scale"], x + y + [flag])
        _refused(lambda: kernels.scale(plan, scale=value), exc, ["scale"], x + y)
        _refused(lambda: kernels.scale(x, x, value), exc, ["scale"], x)
    kernels.scale(plan, scale=-0.0)  # any finite number, zero and negatives too
    kernels.scale(plan, scale=-3.5)
