"""FusedAdam's TransformerEngine / apex interface: positional order, apex's
keywords, set_grad_none, use_decoupled_grad, master_weights as a list,
get_unscaled_state / set_scaled_state / initialize_state, the refused TE-only
options, and GradScaler's attribute protocol (grad_scale / found_inf) with the
kernels writing the gradients back unscaled (Adam and Lion), against
torch.optim.AdamW (its CPU fused kernel for the protocol) and float64 math."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from shardadam import FusedAdam, kernels
from test_fused_adam_helpers import make_model

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
HYPER = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


def _params(dtype=F32, device="cpu", shapes=((5, 7), (33,), (2, 3, 4))):
    return [nn.Parameter(torch.randn(s, device=device).to(dtype)) for s in shapes]


def _fp32_copies(params):
    return [nn.Parameter(p.detach().float().clone()) for p in params]


def _steps(opt, ref, params, rparams, n=4, grad_attr="grad"):
    """n steps of opt and the torch reference on the same random gradients:
    fp32 in p.decoupled_grad, in the parameter's dtype in p.grad."""
    for _ in range(n):
        for p, r in zip(params, rparams):
            dtype = F32 if grad_attr == "decoupled_grad" else p.dtype
            r.grad = torch.randn(r.shape, device=r.device).to(dtype).float()
            setattr(p, grad_attr, r.grad.to(dtype))
        opt.step()
        ref.step()


# ------------------------------------------------------------ constructor

def test_positional_order_is_te_and_torch():
    params = _params()
    rparams = _fp32_copies(params)
    opt = FusedAdam(params, 1e-2, (0.8, 0.95), 1e-6, 0.1, True)  # lr, betas, eps, weight_decay, amsgrad
    ref = torch.optim.AdamW(rparams, 1e-2, (0.8, 0.95), 1e-6, 0.1, True)
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (1e-2, (0.8, 0.95), 1e-6, 0.1)
    assert opt.rule.amsgrad
    _steps(opt, ref, params, rparams)
    torch.testing.assert_close(params, rparams)
    for p, r in zip(params, rparams):
        torch.testing.assert_close(opt.get_unscaled_state(p, "max_exp_avg_sq"), ref.state[r]["max_exp_avg_sq"])


def test_apex_positional_order_raises_and_apex_keywords_work():
    params = _params()
    with pytest.raises(TypeError, match="apex's order .* must be passed by keyword"):
        FusedAdam(params, 1e-3, True, (0.9, 0.999), 1e-8)  # apex: lr, bias_correction, betas, eps
    with pytest.raises(TypeError, match="apex's order"):
        FusedAdam(params, 1e-3, False)
    rparams = _fp32_copies(params)
    opt = FusedAdam(params, lr=1e-2, bias_correction=True, betas=(0.8, 0.95), eps=1e-6, adam_w_mode=False,
                    weight_decay=0.1, amsgrad=False, set_grad_none=False, capturable=False, master_weights=False)
    ref = torch.optim.Adam(rparams, **HYPER)  # adam_w_mode=False: L2 weight decay
    _steps(opt, ref, params, rparams)
    torch.testing.assert_close(params, rparams)


def test_te_only_options_are_refused_with_the_fix():
    """(TE's FP8 states, exp_avg_dtype=torch.uint8, are supported: test_fp8_states.py.)"""
    with pytest.raises(ValueError, match="set_grad_none=True cannot apply"):
        FusedAdam(_params(), flat_grads=True, set_grad_none=True)
    with pytest.raises(ValueError, match="use one of them"):
        FusedAdam(_params(), flat_grads=True, use_decoupled_grad=True)

    class Quantized(torch.Tensor):  # stands for TE's Float8Tensor: bytes in another format
        def dequantize(self):
            return self.float()

    q = nn.Parameter(torch.randn(4)).as_subclass(Quantized)
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[1\] is a quantized Quantized"):
        FusedAdam([nn.Parameter(torch.randn(3)), q])
    opt = FusedAdam([nn.Parameter(torch.randn(3))])
    with pytest.raises(TypeError, match="quantized"):
        opt.add_param_group({"params": [q]})
    assert len(opt.param_groups) == 1
    model = nn.Linear(3, 2)
    opt.add_param_group({"params": model.parameters()})  # a generator: read once, still every parameter
    assert list(map(id, opt.param_groups[1]["params"])) == list(map(id, model.parameters()))


# ------------------------------------------------------------ zero_grad

@pytest.mark.parametrize("decoupled", [False, True])
def test_set_grad_none_and_zero_grad(decoupled):
    attr = "decoupled_grad" if decoupled else "grad"

    def fill(opt):
        for p in opt.param_groups[0]["params"]:
            setattr(p, attr, torch.ones(p.shape))

    def state(opt):
        return [None if getattr(p, attr, None) is None else float(getattr(p, attr).abs().sum())
                for p in opt.param_groups[0]["params"]]

    for set_grad_none, call, want_none in [(None, {}, True), (None, dict(set_to_none=False), False),
                                           (True, {}, True), (False, {}, False),
                                           (False, dict(set_to_none=False), False), (True, dict(set_to_none=True),
                                                                                     True)]:
        opt = FusedAdam(_params(), set_grad_none=set_grad_none, use_decoupled_grad=decoupled)
        fill(opt)
        opt.zero_grad(**call)
        assert state(opt) == ([None] * 3 if want_none else [0.0] * 3), (set_grad_none, call)
    opt = FusedAdam(_params(), set_grad_none=False, use_decoupled_grad=decoupled)
    fill(opt)
    with pytest.raises(ValueError, match="contradicts FusedAdam\\(set_grad_none=False\\)"):
        opt.zero_grad(set_to_none=True)
    assert state(opt) == [float(p.numel()) for p in opt.param_groups[0]["params"]]  # untouched


# ------------------------------------------------------------ use_decoupled_grad

@pytest.mark.parametrize("store_param_remainders", [False, True])
def test_decoupled_fp32_grads_for_bf16_params_with_masters(store_param_remainders):
    """TE's precision-aware path: bf16 params, fp32 masters, fp32 gradients in
    p.decoupled_grad; p.grad is never read. Masters equal torch AdamW on fp32
    copies; the params are the masters rounded to bf16."""
    params = _params(BF16)
    rparams = _fp32_copies(params)
    opt = FusedAdam(params, master_weights=True, use_decoupled_grad=True,
                    store_param_remainders=store_param_remainders, **HYPER)
    ref = torch.optim.AdamW(rparams, **HYPER)
    for p in params:
        p.grad = torch.full(p.shape, float("nan"), dtype=BF16)  # must be ignored
    _steps(opt, ref, params, rparams, grad_attr="decoupled_grad")
    masters = [opt.get_unscaled_state(p, "master_param") for p in params]
    torch.testing.assert_close(masters, [r.detach() for r in rparams])
    for p, m in zip(params, masters):
        assert torch.equal(p.detach(), m.to(BF16))
    # A parameter without a decoupled gradient is not updated (like p.grad None).
    before = [p.detach().clone() for p in params]
    params[1].decoupled_grad = None
    params[0].decoupled_grad = torch.randn(params[0].shape)
    params[2].decoupled_grad = torch.randn(params[2].shape)
    opt.step()
    assert torch.equal(params[1].detach(), before[1])
    assert not torch.equal(params[0].detach(), before[0])


def test_decoupled_grads_under_a_grad_scaler_are_refused():
    """GradScaler checks p.grad only: with decoupled gradients it would miss
    inf/NaN, so its attributes are refused before anything changes."""
    params = _params()
    opt = FusedAdam(params, use_decoupled_grad=True)
    for p in params:
        p.decoupled_grad = torch.randn(p.shape)
    before = [p.detach().clone() for p in params]
    opt.grad_scale, opt.found_inf = torch.tensor(8.0), torch.tensor(0.0)
    with pytest.raises(RuntimeError, match="checks and unscales p.grad, not p.decoupled_grad"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))


# ------------------------------------------------------------ master_weights as a list

def test_master_weights_list_starts_the_masters():
    params = _params(BF16) + [nn.Parameter(torch.randn(6))]
    exact = [p.detach().float() + 1e-3 * torch.randn(p.shape) for p in params[:3]] + [params[3].detach().clone()]
    opt = FusedAdam(params, master_weights=exact, **HYPER)
    for p, m in zip(params, exact):
        assert torch.equal(opt.get_unscaled_state(p, "master_param"), m)
    rparams = [nn.Parameter(m.clone()) for m in exact]
    ref = torch.optim.AdamW(rparams, **HYPER)
    _steps(opt, ref, params, rparams)
    torch.testing.assert_close([opt.get_unscaled_state(p, "master_param") for p in params],
                               [r.detach() for r in rparams])


def test_master_weights_list_is_checked():
    params = _params(BF16) + [nn.Parameter(torch.randn(6))]
    good = [p.detach().float() for p in params]
    with pytest.raises(ValueError, match="list of 3 tensors for 4 parameters"):
        FusedAdam(params, master_weights=good[:3])
    with pytest.raises(ValueError, match=r"master_weights\[1\] is a torch.float16 tensor"):
        FusedAdam(params, master_weights=[good[0], good[1].half()] + good[2:])
    with pytest.raises(ValueError, match=r"master_weights\[0\] is a torch.float32 tensor of shape \(35,\)"):
        FusedAdam(params, master_weights=[good[0].flatten()] + good[1:])
    with pytest.raises(ValueError, match=r"master_weights\[3\] differs from its parameter"):
        FusedAdam(params, master_weights=good[:3] + [good[3] + 1])
    before = [p.detach().clone() for p in params]
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)


# ------------------------------------------------------------ state accessors

@pytest.mark.parametrize("opts", [
    dict(),
    dict(master_weights=True),
    dict(master_weights=True, master_weight_dtype=F16, exp_avg_dtype=F16, exp_avg_sq_dtype=BF16),
    dict(store_param_remainders=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=F16),
], ids=["plain", "fp32-master", "fp16-master-fp16-bf16-states", "remainders"])
def test_set_then_get_unscaled_state_round_trips(opts):
    """Values exactly representable in every storage (7 significant bits:
    multiples of 2^-4 below 4) come back bit for bit, whatever the dtype and
    scale chosen."""
    params = _params(BF16)
    opt = FusedAdam(params, **opts)
    for p in params:
        for name in ("exp_avg", "exp_avg_sq", "master_param"):
            values = torch.randint(-2 ** 6, 2 ** 6, p.shape).float() / 2 ** 4
            if name == "exp_avg_sq":
                values = values.abs()
            opt.set_scaled_state(p, name, values)
            assert torch.equal(opt.get_unscaled_state(p, name), values), name
            if name == "master_param" and opts.get("master_weights"):
                assert opt.state[p]["master_param"].dtype == opts.get("master_weight_dtype", F32)
    # The fp16 state's scale was set to keep the values precise (not left at 1).
    if opts.get("exp_avg_dtype") == F16:
        assert float(opt.state[params[-1]]["exp_avg_scale"]) == kernels.pow2_scale_for(
            float(opt.get_unscaled_state(params[-1], "exp_avg").abs().max())) > 1


def test_remainder_master_takes_te_int16_remainders():
    params = _params(BF16)
    opt = FusedAdam(params, store_param_remainders=True)
    exact = params[0].detach().float() + 2.0 ** -12 * torch.randint(1, 100, params[0].shape).float()
    opt.set_scaled_state(params[0], "master_param", exact)
    bits = opt.state[params[0]]["param_remainder"].clone()
    other = FusedAdam([nn.Parameter(params[0].detach().clone())], store_param_remainders=True)
    q = other.param_groups[0]["params"][0]
    other.set_scaled_state(q, "master_param", bits)  # TE's form: the int16 remainders
    assert torch.equal(other.get_unscaled_state(q, "master_param"), exact)


def test_state_accessor_refusals():
    params = _params()
    frozen = nn.Parameter(torch.randn(3), requires_grad=False)
    opt = FusedAdam(params + [frozen])
    with pytest.raises(ValueError, match="not a state of this optimizer"):
        opt.get_unscaled_state(params[0], "momentum_buffer")
    with pytest.raises(ValueError, match="requires_grad=False"):
        opt.get_unscaled_state(frozen, "exp_avg")
    with pytest.raises(ValueError, match="not in this optimizer"):
        opt.initialize_state(nn.Parameter(torch.randn(3)))
    with pytest.raises(ValueError, match="give a float32 tensor of the parameter's shape"):
        opt.set_scaled_state(params[0], "exp_avg", torch.zeros(params[0].shape, dtype=torch.float64))
    with pytest.raises(ValueError, match="give a float32 tensor"):
        opt.set_scaled_state(params[0], "exp_avg", torch.zeros(3))
    with pytest.raises(ValueError, match="chosen at construction"):
        opt.initialize_state(params[0], store_param_remainders=True)
    assert all(float(opt.get_unscaled_state(p, "exp_avg").abs().sum()) == 0 for p in params)


def test_initialize_state_resets_moments_and_master():
    params = _params(BF16)
    opt = FusedAdam(params, master_weights=True, exp_avg_dtype=F16, **HYPER)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape).to(BF16)
        opt.step()
    p = params[1]
    assert float(opt.get_unscaled_state(p, "exp_avg").abs().sum()) > 0
    opt.set_scaled_state(p, "master_param", p.detach().float() + 0.25)
    opt.initialize_state(p, store_param_remainders=False)
    assert float(opt.get_unscaled_state(p, "exp_avg").abs().sum()) == 0
    assert float(opt.get_unscaled_state(p, "exp_avg_sq").abs().sum()) == 0
    assert float(opt.state[p]["exp_avg_scale"]) == 1.0
    assert torch.equal(opt.get_unscaled_state(p, "master_param"), p.detach().float())
    assert float(opt.get_unscaled_state(params[0], "exp_avg").abs().sum()) > 0  # others untouched


# ------------------------------------------------------------ GradScaler's protocol

def _protocol_run(make_opt, params, scale, found_inf_at, steps=4):
    """Steps with GradScaler's attributes set as GradScaler.step sets them for
    an optimizer with _step_supports_amp_scaling; returns the gradients seen
    after each step."""
    opt = make_opt(params)
    torch.manual_seed(1)
    grads_after = []
    for s in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape) * scale
        opt.grad_scale = torch.tensor(scale)
        opt.found_inf = torch.tensor(1.0 if s == found_inf_at else 0.0)
        opt.step()
        del opt.grad_scale, opt.found_inf
        grads_after.append([p.grad.clone() for p in params])
    return opt, grads_after


def test_grad_scale_protocol_matches_torch_fused_adamw():
    """torch's fused AdamW (its CPU kernel) with grad_scale / found_inf: the
    gradients come back unscaled, a found_inf step writes nothing (the
    gradients stay scaled) and does not count."""
    params = _params()
    rparams = _fp32_copies(params)
    opt, got = _protocol_run(lambda ps: FusedAdam(ps, **HYPER), params, 1024.0, found_inf_at=2)
    ref, want = _protocol_run(lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER), rparams, 1024.0,
                              found_inf_at=2)
    for s, (g, w) in enumerate(zip(got, want)):
        for a, b in zip(g, w):
            assert torch.equal(a, b), f"gradients after step {s}"
    torch.testing.assert_close(params, rparams)
    assert opt.param_groups[0]["step"] == 3 == int(ref.state[rparams[0]]["step"])


@pytest.mark.parametrize("rule", ["adam", "lion"])
@pytest.mark.parametrize("grad_dtype", [F32, BF16, F16])
def test_kernels_write_unscaled_grads(rule, grad_dtype, device):
    """kernels.adam / kernels.lion with unscale_grads: the gradients become
    grad * grad_scale in their dtype (exact: a power of two), the update equals
    one on pre-unscaled gradients, and nothing is written when found_inf is set."""
    n = [37, 64, 5, 4099]
    # |grad| / 512 stays a normal number of every gradient dtype: a subnormal
    # fp16 result would round, and the unscale would not be exact.
    grads = [(torch.randn(k, device=device).clamp(-8, 8) * 512) for k in n]
    grads = [(g.sign() * g.abs().clamp_min(1.0)).to(grad_dtype) for g in grads]
    unscaled = [(g.float() / 512).to(grad_dtype) for g in grads]

    def start(k):
        return torch.linspace(-1, 1, k, device=device)

    def run(gs, grad_scale, unscale, found_inf=None):
        ps = [start(k) for k in n]
        states = [[torch.zeros(k, device=device) for k in n] for _ in range(2 if rule == "adam" else 1)]
        kw = dict(lr=1e-2, grad_scale=grad_scale, unscale_grads=unscale, found_inf=found_inf)
        if rule == "adam":
            kernels.adam(ps, gs, *states, step=1, **kw)
        else:
            kernels.lion(ps, gs, *states, **kw)
        return ps, states

    gs = [g.clone() for g in grads]
    ps, states = run(gs, 1 / 512, True)
    for g, u in zip(gs, unscaled):
        assert torch.equal(g, u)
    rps, rstates = run([u.clone() for u in unscaled], 1.0, False)
    assert all(torch.equal(a, b) for a, b in zip(ps + sum(states, []), rps + sum(rstates, [])))
    gs = [g.clone() for g in grads]
    ps, _ = run(gs, 1 / 512, True, found_inf=torch.ones(1, device=device))
    assert all(torch.equal(a, b) for a, b in zip(gs, grads))
    assert all(torch.equal(p, start(k)) for p, k in zip(ps, n))


def test_unscale_grads_refuses_overlapping_grads():
    """Read-only gradients may share memory; written back they may not: the
    refusal comes before anything is written, also after the plan's gradient
    list was re-pointed."""
    ps = [torch.zeros(8), torch.zeros(8)]
    shared = torch.ones(8)
    plan = kernels.AdamPlan(ps, [shared, shared], [torch.zeros(8), torch.zeros(8)], [torch.zeros(8), torch.zeros(8)])
    kernels.adam(plan, lr=0.1, step=1)  # fine read-only
    before = [p.clone() for p in ps]
    with pytest.raises(ValueError, match="overlaps"):
        kernels.adam(plan, lr=0.1, step=2, grad_scale=0.5, unscale_grads=True)
    assert all(torch.equal(a, b) for a, b in zip(ps, before)) and torch.equal(shared, torch.ones(8))
    plan.refresh_read_list(1, [torch.ones(8), torch.ones(8)])
    kernels.adam(plan, lr=0.1, step=2, grad_scale=0.5, unscale_grads=True)
    plan.refresh_read_list(1, [shared, shared])
    with pytest.raises(ValueError, match="overlaps"):
        kernels.adam(plan, lr=0.1, step=3, grad_scale=0.5, unscale_grads=True)


def test_model_steps_like_adamw_under_the_protocol():
    """A small model whose grads carry a scale: FusedAdam (with the protocol)
    equals AdamW stepping on the unscaled gradients."""
    model = make_model()
    ref = make_model()
    ref.load_state_dict(model.state_dict())
    opt = FusedAdam(model.parameters(), **HYPER)
    topt = torch.optim.AdamW(ref.parameters(), **HYPER)
    for _ in range(3):
        x = torch.randn(8, 3, 8, 8)
        model(x).square().mean().mul(256.0).backward()
        ref(x).square().mean().backward()
        opt.grad_scale = torch.tensor(256.0)
        opt.found_inf = torch.tensor(0.0)
        opt.step()
        topt.step()
        for p, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, r.grad)
        opt.zero_grad()
        topt.zero_grad()
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()))


@pytest.mark.cuda
def test_captured_step_unscales_like_torch_fused_adamw():
    """capturable=True in a CUDA graph with GradScaler's attributes in static
    tensors (the scale and the flag change between replays): each replay
    leaves the gradients unscaled, or scaled and everything unchanged when
    found_inf is set, as torch's fused capturable AdamW does eagerly."""
    params = _params(device="cuda")
    rparams = _fp32_copies(params)
    lr = 2.0 ** -8  # exact in the float32 lr tensor
    hyper = dict(HYPER, lr=lr)
    opt = FusedAdam(params, capturable=True, **hyper)
    ref = torch.optim.AdamW(rparams, fused=True, capturable=True, **hyper)
    scale, flag = torch.ones((), device="cuda"), torch.ones((), device="cuda")
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.grad_scale, opt.found_inf = scale, flag
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step()  # warm-up with found_inf set: builds the plan, changes nothing
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    assert opt.param_groups[0]["step"].item() == 0
    for s, (factor, skip) in enumerate([(1024.0, 0.0), (512.0, 0.0), (512.0, 1.0), (2048.0, 0.0)]):
        scaled = [torch.randn(p.shape, device="cuda") * factor for p in params]
        for p, r, g in zip(params, rparams, scaled):
            p.grad.copy_(g)
            r.grad = g.clone()
        scale.fill_(factor)
        flag.fill_(skip)
        graph.replay()
        ref.grad_scale, ref.found_inf = scale.clone(), flag.clone()
        ref.step()
        for p, r in zip(params, rparams):
            assert torch.equal(p.grad, r.grad), f"gradients after replay {s}"
        torch.testing.assert_close(params, rparams)
    del opt.grad_scale, opt.found_inf
    assert opt.param_groups[0]["step"].item() == 3 == int(ref.state[rparams[0]]["step"])


def test_tensor_without_requires_grad_but_with_a_gradient_is_stepped():
    """torch.optim, TE and apex step whatever has a gradient: a plain tensor
    (requires_grad=False) given .grad by hand (TE's and apex's large-tensor
    test does this) is trained, not taken for a frozen parameter."""
    t = torch.zeros(1000)
    r = torch.zeros(1000)
    t.grad = torch.randn(1000)
    r.grad = t.grad.clone()
    opt = FusedAdam([t], **HYPER)
    ref = torch.optim.AdamW([r], **HYPER)
    for _ in range(2):
        opt.step()
        ref.step()
    torch.testing.assert_close(t, r)
    assert float(t.abs().min()) > 0
