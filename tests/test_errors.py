"""Bad inputs raise ValueError/TypeError naming the argument, and change nothing."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_all_bits_equal, rand_pos, randn, snapshot
from shardadam import kernels

SIZES = [5, 7]


class Problem:
    """A valid Adam call's tensors; a case breaks one thing."""

    def __init__(self, device, sizes=SIZES):
        self.device = device
        self.p = [randn(n, device=device) for n in sizes]
        self.g = [randn(n, device=device) for n in sizes]
        self.m = [randn(n, device=device, scale=0.1) for n in sizes]
        self.v = [rand_pos(n, device=device) for n in sizes]

    def all(self):
        return self.p + self.g + self.m + self.v

    def adam(self, **kw):
        args = dict(params=self.p, grads=self.g, exp_avgs=self.m, exp_avg_sqs=self.v)
        for k in list(kw):
            if k in args:
                args[k] = kw.pop(k)
        kw.setdefault("lr", 1e-3)
        kw.setdefault("step", 1)
        return lambda: kernels.adam(args["params"], args["grads"], args["exp_avgs"], args["exp_avg_sqs"], **kw)


def check_raises(call, exc, words, tensors):
    before = snapshot(tensors)
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    for w in words:
        assert w in msg, f"message {msg!r} does not name {w!r}"
    assert_all_bits_equal(tensors, before, "a tensor changed although the call failed")


def _bf16_problem(pr):
    pr.p = [t.to(torch.bfloat16) for t in pr.p]
    return pr


CASES = {
    # name: (builder(problem) -> (call, extra tensors), exception, words)
    "list-lengths": (lambda pr: (pr.adam(grads=pr.g[:1]), []), ValueError, ["grads", "params"]),
    "numel-mismatch": (lambda pr: (pr.adam(grads=[pr.g[0], randn(8, device=pr.device)]), []), ValueError,
                       ["grads[1]", "params[1]"]),
    "float64-params": (lambda pr: (pr.adam(params=[pr.p[0].double(), pr.p[1]]), []), ValueError,
                       ["params[0]", "float64"]),
    "int32-grads": (lambda pr: (pr.adam(grads=[pr.g[0], torch.ones(7, dtype=torch.int32, device=pr.device)]), []),
                    ValueError, ["grads[1]", "int32"]),
    "int32-remainders": (lambda pr: (_bf16_problem(pr).adam(
        param_remainders=[torch.zeros(n, dtype=torch.int32, device=pr.device) for n in SIZES]), []),
        ValueError, ["param_remainders[0]", "int32"]),
    "non-dense-param": (lambda pr: (lambda t: (pr.adam(params=[t, pr.p[1]]), [t]))(
        randn((5, 2), device=pr.device)[:, ::2]), ValueError, ["params[0]", "dense"]),
    "non-dense-grad": (lambda pr: (pr.adam(grads=[pr.g[0], randn((7, 2), device=pr.device)[:, ::2]]), []),
                       ValueError, ["grads[1]", "dense"]),
    "exp-avgs-alias-params": (lambda pr: (pr.adam(exp_avgs=pr.p), []), ValueError,
                              ["exp_avgs[", "params[", "overlap"]),
    "overlapping-params": (lambda pr: (lambda buf: (pr.adam(params=[buf[0:5], buf[3:10]]), [buf]))(
        randn(10, device=pr.device)), ValueError, ["params[1]", "params[0]", "overlap"]),
    "params-out-aliases-grads": (lambda pr: (pr.adam(params_out=pr.g), []), ValueError,
                                 ["params_out[", "grads[", "overlap"]),
    "sparse-grad": (lambda pr: (pr.adam(grads=[pr.g[0].to_sparse(), pr.g[1]]), []), ValueError,
                    ["grads[0]", "sparse"]),
    "memory-order": (lambda pr: (lambda p4, g4: (
        kernels_adam_lists([p4], [g4], [torch.zeros_like(p4)], [torch.zeros_like(p4)]), [p4, g4]))(
        randn((2, 3, 4, 5), device=pr.device).to(memory_format=torch.channels_last),
        randn((2, 3, 4, 5), device=pr.device)), ValueError, ["grads[0]", "params[0]"]),
    "step-zero": (lambda pr: (pr.adam(step=0), []), ValueError, ["step"]),
    "beta1-one": (lambda pr: (pr.adam(beta1=1.0), []), ValueError, ["beta1"]),
    "beta2-negative": (lambda pr: (pr.adam(beta2=-0.1), []), ValueError, ["beta2"]),
    "beta2-per-group-out-of-range": (lambda pr: (pr.adam(beta2=[0.999, 1.5], group_sizes=[1, 1]), []),
                                     ValueError, ["beta2"]),
    "negative-lr": (lambda pr: (pr.adam(lr=-1e-3), []), ValueError, ["lr"]),
    "negative-eps": (lambda pr: (pr.adam(eps=-1e-8), []), ValueError, ["eps"]),
    "nan-weight-decay": (lambda pr: (pr.adam(weight_decay=float("nan")), []), ValueError, ["weight_decay"]),
    "bool-lr": (lambda pr: (pr.adam(lr=True), []), TypeError, ["lr"]),
    "two-element-lr": (lambda pr: (pr.adam(lr=torch.tensor([1e-3, 1e-3], device=pr.device)), []), ValueError,
                       ["lr"]),
    "float16-step-tensor": (lambda pr: (pr.adam(step=torch.tensor(1.0, dtype=torch.float16, device=pr.device)),
                                        []), ValueError, ["step"]),
    "per-group-list-length": (lambda pr: (pr.adam(lr=[1e-3], group_sizes=[1, 1]), []), ValueError, ["lr"]),
    "group-sizes-sum": (lambda pr: (pr.adam(group_sizes=[1, 2]), []), ValueError, ["group_sizes"]),
    "remainders-with-fp32-params": (lambda pr: (pr.adam(
        param_remainders=[torch.zeros(n, dtype=torch.int16, device=pr.device) for n in SIZES]), []), ValueError,
        ["param_remainders", "params[0]", "bfloat16"]),
    "remainders-and-master-scales": (lambda pr: (_bf16_problem(pr).adam(
        param_remainders=[torch.zeros(n, dtype=torch.int16, device=pr.device) for n in SIZES],
        master_scales=torch.ones(2, device=pr.device)), []), ValueError, ["param_remainders", "master_scales"]),
    "scales-wrong-length": (lambda pr: (pr.adam(exp_avg_scales=torch.ones(3, device=pr.device)), []), ValueError,
                            ["exp_avg_scales"]),
    "found-inf-float64": (lambda pr: (pr.adam(found_inf=torch.zeros(1, dtype=torch.float64, device=pr.device)),
                                      []), ValueError, ["found_inf"]),
    "found-inf-two-elements": (lambda pr: (pr.adam(found_inf=torch.zeros(2, device=pr.device)), []), ValueError,
                               ["found_inf"]),
    "exp-avgs-missing": (lambda pr: (pr.adam(exp_avgs=None), []), ValueError, ["exp_avgs"]),
    "grads-not-tensors": (lambda pr: (pr.adam(grads=[pr.g[0], 3.0]), []), TypeError, ["grads[1]"]),
    "plan-with-lists": (lambda pr: (lambda plan: (
        lambda: kernels.adam(plan, pr.g, lr=1e-3, step=1), []))(
        kernels.AdamPlan(pr.p, pr.g, pr.m, pr.v)), TypeError, ["AdamPlan"]),
    "plan-with-plan-keyword": (lambda pr: (lambda plan: (
        lambda: kernels.adam(plan, lr=1e-3, step=1, params_out=pr.g), []))(
        kernels.AdamPlan(pr.p, pr.g, pr.m, pr.v)), TypeError, ["AdamPlan"]),
    # Numbers must be finite; beta1, beta2, eps, weight_decay are host numbers.
    "inf-lr": (lambda pr: (pr.adam(lr=float("inf")), []), ValueError, ["lr", "finite"]),
    "inf-eps": (lambda pr: (pr.adam(eps=float("inf")), []), ValueError, ["eps", "finite"]),
    "inf-weight-decay": (lambda pr: (pr.adam(weight_decay=float("inf")), []), ValueError, ["weight_decay"]),
    "str-beta1": (lambda pr: (pr.adam(beta1="0.9"), []), TypeError, ["beta1"]),
    "tensor-beta2": (lambda pr: (pr.adam(beta2=torch.tensor(0.999, device=pr.device)), []), TypeError,
                     ["beta2", "Python number"]),
    "inf-step": (lambda pr: (pr.adam(step=float("inf")), []), ValueError, ["step", "finite"]),
    "inf-grad-scale": (lambda pr: (pr.adam(grad_scale=float("inf")), []), ValueError, ["grad_scale", "finite"]),
    "nan-grad-scale": (lambda pr: (pr.adam(grad_scale=float("nan")), []), ValueError, ["grad_scale"]),
    "zero-grad-scale": (lambda pr: (pr.adam(grad_scale=0.0), []), ValueError, ["grad_scale", "> 0"]),
    "negative-grad-scale": (lambda pr: (pr.adam(grad_scale=-1.0), []), ValueError, ["grad_scale", "> 0"]),
    "inf-lr-last-group": (lambda pr: (pr.adam(lr=[1e-3, float("inf")], group_sizes=[1, 1]), []), ValueError,
                          ["lr[1]"]),
}


def kernels_adam_lists(p, g, m, v):
    return lambda: kernels.adam(p, g, m, v, lr=1e-3, step=1)


@pytest.mark.parametrize("case", list(CASES))
def test_adam_rejects(device, case):
    pr = Problem(device)
    build, exc, words = CASES[case]
    call, extra = build(pr)
    check_raises(call, exc, words, pr.all() + extra)


def test_plan_builds_check_the_same_rules(device):
    pr = Problem(device)
    check_raises(lambda: kernels.AdamPlan(pr.p, pr.g, pr.p, pr.v), ValueError, ["exp_avgs[", "params[", "overlap"],
                 pr.all())
    check_raises(lambda: kernels.AdamPlan(pr.p, [pr.g[0].double(), pr.g[1]], pr.m, pr.v), ValueError,
                 ["grads[0]", "float64"], pr.all())


# ---------------------------------------------------------------- scale / copy / l2_norm

def test_scale_rejects(device):
    a, b, c = randn(5, device=device), randn(7, device=device), randn(5, device=device)
    everything = [a, b, c]
    check_raises(lambda: kernels.scale([a, b], [b], 2.0), ValueError, ["outputs", "inputs"], everything)
    check_raises(lambda: kernels.scale([a], None, 2.0), ValueError, ["outputs"], everything)
    check_raises(lambda: kernels.scale([a], [torch.empty(5, dtype=torch.float64, device=device)], 2.0), ValueError,
                 ["outputs[0]", "float64"], everything)
    check_raises(lambda: kernels.scale([a, c], [c, a], 2.0), ValueError, ["overlap"], everything)
    check_raises(lambda: kernels.scale([a], [a], 2.0, found_inf=torch.zeros(1, dtype=torch.int32, device=device)),
                 ValueError, ["found_inf"], everything)
    check_raises(lambda: kernels.copy([a], [a[:]], skip_if=torch.zeros(1, dtype=torch.float16, device=device)),
                 ValueError, ["skip_if"], everything)
    check_raises(lambda: kernels.scale([a], [torch.empty(10, device=device)[::2]], 2.0), ValueError,
                 ["outputs[0]", "dense"], everything)
    plan = kernels.ScalePlan([a], [a])
    check_raises(lambda: kernels.scale(plan, [b], 2.0), TypeError, ["ScalePlan"], everything)
    check_raises(lambda: kernels.scale([a], [c], float("inf")), ValueError, ["scale", "finite"], everything)
    check_raises(lambda: kernels.scale(plan, scale=float("nan")), ValueError, ["scale", "finite"], everything)


def test_scale_in_place_rejects_a_tensor_given_twice(device):
    """In place, each output may alias its own input only: the same tensor twice
    is two writers of one memory (it would be scaled twice)."""
    a = randn(1000, device=device)
    check_raises(lambda: kernels.scale([a, a], [a, a], 2.0), ValueError, ["overlap"], [a])
    b = randn(1000, device=device)
    check_raises(lambda: kernels.scale([b, b[:500]], [b, b[:500]], 2.0), ValueError, ["overlap"], [b])


def test_l2_norm_rejects(device):
    a = randn(5, device=device)
    check_raises(lambda: kernels.l2_norm([a, torch.ones(3, dtype=torch.int32, device=device)]), ValueError,
                 ["tensors[1]", "int32"], [a])
    check_raises(lambda: kernels.l2_norm([a], found_inf=torch.zeros(1, dtype=torch.float64, device=device)),
                 ValueError, ["found_inf"], [a])
    check_raises(lambda: kernels.l2_norm(3.0), TypeError, ["tensors"], [a])


# ---------------------------------------------------------------- devices

@pytest.mark.cuda
def test_mixed_cpu_and_cuda_tensors_rejected():
    pr = Problem("cpu")
    on_gpu = pr.g[1].cuda()
    check_raises(pr.adam(grads=[pr.g[0], on_gpu]), ValueError, ["grads[1]", "cuda"], pr.all() + [on_gpu])
    pr2 = Problem("cuda")
    check_raises(pr2.adam(found_inf=torch.zeros(1)), ValueError, ["found_inf", "cpu"], pr2.all())
    # A GPU lr for CPU tensors is read when called (test_adam.py::test_gpu_scalar_tensor_for_cpu_tensors).
    x = randn(8, device="cuda")
    check_raises(lambda: kernels.scale([x], [torch.empty(8)], 2.0), ValueError, ["outputs[0]"], [x])
