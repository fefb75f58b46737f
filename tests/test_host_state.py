"""Optimizer state in host memory (state_device="cpu", [Note: host state]).

The host bucket is exercised on the CPU too: forced onto CPU parameters it
runs the whole pipeline (segments, staging, version checks) with plain
copies, and must give the bits of the ordinary optimizer (the same CPU
engine steps the same values). On a GPU it is compared with the GPU-state
optimizer (fp32 rounding: the two engines may contract multiply-adds
differently) and with torch.optim.AdamW.
"""
from __future__ import annotations

import contextlib
import os
import weakref

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import shardadam
from shardadam import _fused_optimizer, _host_state, _pinned, _plan
from shardadam._host_state import HostStateBucket, segment_bounds

from conftest import assert_bits_equal


def _model(device, dtype=torch.float32):
    torch.manual_seed(1)
    shapes = [(33, 7), (5,), (300,), (4, 4, 3), (1,), (129, 2), (0,), (70,)]
    return [torch.nn.Parameter(torch.randn(s, device=device).to(dtype)) for s in shapes]


def _grads(params, step, missing=()):
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        p.grad = None if i in missing else torch.randn(p.shape, generator=g).to(p.device, p.dtype)


def _step_alike(ref, host, ref_params, host_params, missing_per_step):
    """Both optimizers step on the same gradients; missing_per_step[k]: the
    parameters without one at step k."""
    for step, missing in enumerate(missing_per_step):
        _grads(ref_params, step, missing)
        _grads(host_params, step, missing)
        ref.step()
        host.step()


def _assert_same_params(ref_params, host_params):
    for a, b in zip(ref_params, host_params):
        assert_bits_equal(a.detach(), b.detach())


@contextlib.contextmanager
def host_state_forced():
    """Host buckets for CPU parameters too, in segments of at most 400
    elements. A context, not only a fixture: spawned ranks apply it in their
    own process."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_fused_optimizer, "_bucket_class",
                      lambda opts, device: HostStateBucket if opts["host_state"] else _fused_optimizer.Bucket)
        patch.setattr(_host_state, "HOST_SEGMENT_ELEMS", 400)
        yield


@pytest.fixture
def forced_host_state():
    with host_state_forced():
        yield


def test_segments_split_by_size_and_dtype():
    ps = [torch.zeros(n, dtype=d) for n, d in [(300, torch.float32), (50, torch.float32), (60, torch.float32),
                                               (10, torch.bfloat16), (1000, torch.bfloat16), (5, torch.bfloat16)]]
    assert segment_bounds(ps, 400) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6)]


OPTIONS = [
    dict(),
    dict(weight_decay=0.1, amsgrad=True),
    dict(exp_avg_dtype=shardadam.BLOCKWISE8, exp_avg_sq_dtype=shardadam.BLOCKWISE8),
    dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.float16),
]


@pytest.mark.parametrize("options", OPTIONS, ids=["fp32", "amsgrad", "blockwise8", "bf16-fp16"])
def test_forced_host_buckets_give_the_same_bits(forced_host_state, options):
    ref_params, host_params = _model("cpu"), _model("cpu")
    ref = shardadam.FusedAdam(ref_params, lr=1e-2, **options)
    host = shardadam.FusedAdam(host_params, lr=1e-2, state_device="cpu", **options)
    assert isinstance(host._layout()[0], HostStateBucket) and len(host._layout()[0].segments) > 2
    _step_alike(ref, host, ref_params, host_params, [(), (), (1, 5), ()])  # step 2: two without a gradient
    _assert_same_params(ref_params, host_params)
    for a, b in zip(ref_params, host_params):
        for name, value in ref.state[a].items():
            assert_bits_equal(value, host.state[b][name])


def test_forced_host_buckets_with_groups_across_segments(forced_host_state):
    """Segments cut across parameter groups (an empty one among them): each
    tensor still steps with its own group's hyperparameters."""
    def groups(params):
        return [dict(params=params[:3], lr=1e-2), dict(params=[], lr=5.0),
                dict(params=params[3:], lr=3e-3, weight_decay=0.1, betas=(0.8, 0.99))]
    ref_params, host_params = _model("cpu"), _model("cpu")
    ref = shardadam.FusedAdam(groups(ref_params), lr=1e-2)
    host = shardadam.FusedAdam(groups(host_params), lr=1e-2, state_device="cpu")
    _step_alike(ref, host, ref_params, host_params, [(), (4,), ()])
    _assert_same_params(ref_params, host_params)
    assert [g["step"] for g in host.param_groups] == [3, 3, 3]


def test_forced_host_buckets_skip_nonfinite_grads(forced_host_state):
    params = _model("cpu")
    opt = shardadam.FusedAdam(params, lr=1e-2, state_device="cpu", skip_nonfinite_grads=True)
    _grads(params, 0)
    opt.step()
    before = [p.detach().clone() for p in params]
    state_before = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    _grads(params, 1)
    params[5].grad[3] = float("inf")
    opt.step()
    assert opt.skipped_steps == 1 and opt.param_groups[0]["step"] == 1
    for a, p, state in zip(before, params, state_before):
        assert_bits_equal(p.detach(), a)
        for name, value in state.items():
            assert_bits_equal(opt.state[p][name], value)


def test_forced_host_buckets_share_gradient_slots_safely(forced_host_state, monkeypatch):
    """Segments share _SLOTS staging slots; with whole segments lacking
    gradients, consecutive stepping segments map to one slot, which must wait
    for its segment's step (on the CPU the copies are immediate, so a slot
    overwritten too early shows in the bits)."""
    monkeypatch.setattr(_host_state, "HOST_SEGMENT_ELEMS", 100)
    sizes = [100, 60, 100, 100, 100, 80, 100, 100]
    ref_params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    host_params = [torch.nn.Parameter(p.detach().clone()) for p in ref_params]
    ref = shardadam.FusedAdam(ref_params, lr=1e-2)
    host = shardadam.FusedAdam(host_params, lr=1e-2, state_device="cpu")
    bucket = host._layout()[0]
    assert len(bucket.segments) == 8 and len(bucket._slots) == _host_state._SLOTS
    _step_alike(ref, host, ref_params, host_params, [(), (1, 2, 4, 5), (0, 3, 4, 6), ()])
    _assert_same_params(ref_params, host_params)


def test_forced_host_buckets_follow_a_change_of_gradient_dtype(forced_host_state):
    """A segment's gradients in another dtype land at the same staging
    address: the host plan must take their new dtype, not read them as the
    old one. (TE's decoupled gradients take any dtype.)"""
    ref_params, host_params = _model("cpu"), _model("cpu")
    ref = shardadam.FusedAdam(ref_params, lr=1e-2, use_decoupled_grad=True)
    host = shardadam.FusedAdam(host_params, lr=1e-2, use_decoupled_grad=True, state_device="cpu")
    for step, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float32]):
        for params in (ref_params, host_params):
            _grads(params, step)
            for p in params:
                p.decoupled_grad, p.grad = p.grad.to(dtype), None
        ref.step()
        host.step()
    _assert_same_params(ref_params, host_params)


def test_forced_host_buckets_take_gradients_of_another_shape(forced_host_state):
    """A contiguous gradient with the parameter's elements in another shape
    (TE's decoupled gradients may be flat) is staged as the parameter's."""
    ref_params, host_params = _model("cpu"), _model("cpu")
    ref = shardadam.FusedAdam(ref_params, lr=1e-2, use_decoupled_grad=True)
    host = shardadam.FusedAdam(host_params, lr=1e-2, use_decoupled_grad=True, state_device="cpu")
    for step in range(2):
        for params in (ref_params, host_params):
            _grads(params, step)
            for p in params:
                p.decoupled_grad, p.grad = p.grad.reshape(-1), None
        ref.step()
        host.step()
    _assert_same_params(ref_params, host_params)


def test_forced_host_buckets_keep_no_gradient_alive(forced_host_state):
    """After step(), zero_grad(set_to_none=True) frees the gradients: the
    host state keeps no reference to them."""
    params = _model("cpu")
    opt = shardadam.FusedAdam(params, lr=1e-2, state_device="cpu")
    _grads(params, 0)
    opt.step()
    refs = [weakref.ref(p.grad) for p in params]
    opt.zero_grad(set_to_none=True)
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("options", [dict(master_weights=True), dict(store_param_remainders=True),
                                     dict(bf16_stochastic_round=True, stochastic_round_seed=3)],
                         ids=["master", "remainders", "stochastic"])
def test_forced_host_buckets_bf16_kinds(forced_host_state, options):
    ref_params, host_params = _model("cpu", torch.bfloat16), _model("cpu", torch.bfloat16)
    ref = shardadam.FusedAdam(ref_params, lr=1e-2, **options)
    host = shardadam.FusedAdam(host_params, lr=1e-2, state_device="cpu", **options)
    _step_alike(ref, host, ref_params, host_params, [()] * 3)
    if "bf16_stochastic_round" in options:
        # The rounding bits follow a tensor's place in its plan, which segments
        # change: each of the three roundings may land one bf16 step apart.
        for a, b in zip(ref_params, host_params):
            torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=3 * 2 ** -7, atol=0)
        return
    _assert_same_params(ref_params, host_params)
    ref_sd, host_sd = ref.state_dict(), host.state_dict()
    for key, entry in ref_sd["state"].items():
        for name, value in entry.items():
            assert_bits_equal(value, host_sd["state"][key][name])


def test_forced_host_buckets_follow_writes_to_params(forced_host_state):
    """A parameter written through torch between steps (its version moves) is
    read back before the next step, as the GPU-state optimizer reads it."""
    ref_params, host_params = _model("cpu"), _model("cpu")
    ref = shardadam.FusedAdam(ref_params, lr=1e-2)
    host = shardadam.FusedAdam(host_params, lr=1e-2, state_device="cpu")
    for _ in range(3):
        _step_alike(ref, host, ref_params, host_params, [()])
        with torch.no_grad():
            for ps in (ref_params, host_params):
                ps[2].mul_(0.5)
                torch.nn.init.constant_(ps[5], 0.25)
    _assert_same_params(ref_params, host_params)


def test_forced_host_buckets_checkpoint_round_trip(forced_host_state):
    """A state dict saved from host state loads into host state (the
    parameters take the loaded masters) and training goes on exactly."""
    ref_params, host_params = _model("cpu", torch.bfloat16), _model("cpu", torch.bfloat16)
    ref = shardadam.FusedAdam(ref_params, lr=1e-2, master_weights=True)
    host = shardadam.FusedAdam(host_params, lr=1e-2, master_weights=True, state_device="cpu")
    _step_alike(ref, host, ref_params, host_params, [()] * 2)
    saved = host.state_dict()
    fresh_params = _model("cpu", torch.bfloat16)  # other values: the load must set them
    fresh = shardadam.FusedAdam(fresh_params, lr=1e-2, master_weights=True, state_device="cpu")
    fresh.load_state_dict(saved)
    _assert_same_params(ref_params, fresh_params)
    _step_alike(ref, fresh, ref_params, fresh_params, [()])
    _assert_same_params(ref_params, fresh_params)


def test_forced_host_buckets_on_dtensors_follow_writes(forced_host_state, one_rank):
    """DTensor parameters (one rank's mesh, so the plain optimizer on the full
    tensors is the reference): the host bucket steps their local tensors,
    reads back writes through the parameter and through to_local() (each
    moves another version counter), and hands out DTensor state."""
    mesh = init_device_mesh("cpu", (1,))
    ref_params = _model("cpu")
    host_params = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)])) for p in ref_params]
    ref = shardadam.FusedAdam(ref_params, lr=1e-2)
    host = shardadam.FusedAdam(host_params, lr=1e-2, state_device="cpu")
    for step in range(3):
        if step:
            with torch.no_grad():
                for ps in (ref_params, [p.to_local() for p in host_params]):
                    ps[2].mul_(0.5)
                for ps in (ref_params, host_params):
                    torch.nn.init.constant_(ps[5], 0.25)
        _grads(ref_params, step, (1,) if step == 1 else ())
        for p, r in zip(host_params, ref_params):
            p.grad = None if r.grad is None else distribute_tensor(r.grad, mesh, [Shard(0)])
        ref.step()
        host.step()
    assert isinstance(host._layout()[0], HostStateBucket) and len(host._layout()[0].segments) > 2
    _assert_same_params(ref_params, [p.full_tensor() for p in host_params])
    for key, entry in host.state_dict()["state"].items():
        for name, value in entry.items():
            if name != "step":
                assert isinstance(value, DTensor) and value.placements == (Shard(0),)
                assert_bits_equal(ref.state[ref_params[key]][name], value.full_tensor())
                assert isinstance(host.state[host_params[key]][name], DTensor)


def test_state_device_cpu_on_cpu_params_changes_nothing():
    ref_params, host_params = _model("cpu"), _model("cpu")
    ref = shardadam.FusedLion(ref_params, lr=1e-3)
    host = shardadam.FusedLion(host_params, lr=1e-3, state_device=torch.device("cpu"))
    _step_alike(ref, host, ref_params, host_params, [()] * 3)
    assert not isinstance(host._layout()[0], HostStateBucket)
    _assert_same_params(ref_params, host_params)
    assert "state_device=cpu" in repr(host)


def test_host_step_threads(monkeypatch):
    """[Note: host step threads]: the cores this process may use, shared among
    the ranks of its host, whatever torch's own count (torchrun sets it to 1)."""
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("SHARDADAM_HOST_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _host_state.host_step_threads() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _host_state.host_step_threads() == max(1, cores // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cores))
    assert _host_state.host_step_threads() == 1
    monkeypatch.setenv("SHARDADAM_HOST_THREADS", "3")
    assert _host_state.host_step_threads() == 3
    for bad in ("0", "-2", "two", ""):
        monkeypatch.setenv("SHARDADAM_HOST_THREADS", bad)
        with pytest.raises(ValueError, match="SHARDADAM_HOST_THREADS must be a positive integer"):
            shardadam.FusedAdam(_model("cpu"), state_device="cpu")


def test_forced_host_buckets_step_on_the_host_step_threads(forced_host_state, monkeypatch):
    """Every launch of the host step runs on host_step_threads(), not torch's count."""
    monkeypatch.setenv("SHARDADAM_HOST_THREADS", "3")
    torch.set_num_threads(1)  # as torchrun leaves it
    seen = []
    target = _plan.TensorPlan.target
    monkeypatch.setattr(_plan.TensorPlan, "target", lambda plan: seen.append(target(plan)[3]) or target(plan))
    params = _model("cpu")
    opt = shardadam.FusedAdam(params, lr=1e-3, state_device="cpu")
    _grads(params, 0)
    opt.step()
    assert seen and set(seen) == {3}, seen
    seen.clear()
    shardadam.kernels.l2_norm([torch.ones(4)])  # outside the host step: torch's count
    assert seen == [1]


def test_page_locking_failure_is_named(monkeypatch):
    class FailingRuntime:
        @staticmethod
        def cudaHostRegister(ptr, nbytes, flags):
            return 2  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FailingRuntime)
    with pytest.raises(RuntimeError, match=r"page-locking 0\.00 GiB of host memory failed .*error 2.*ulimit -l"):
        _pinned.pinned_empty(1024, torch.float32, torch.device("cuda", 0))


@pytest.mark.parametrize("kwargs, match", [
    (dict(state_device="cuda"), "state_device must be None"),
    (dict(state_device="disk"), "state_device must be None"),
    (dict(state_device="cpu", capturable=True), "cannot be captured"),
    (dict(state_device="cpu", flat_grads=True), "flat_grads"),
])
def test_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        shardadam.FusedAdam(_model("cpu"), **kwargs)


# ---------------------------------------------------------------- GPU


def _gpu_model(dtype=torch.float32, count=40):
    torch.manual_seed(2)
    layers = [torch.nn.Linear(64, 64) for _ in range(count // 2)]
    model = torch.nn.Sequential(torch.nn.Embedding(3000, 64), *layers).cuda().to(dtype)
    return model


def _train(model, opt, steps, scaler=None, scheduler=None, clip=None):
    g = torch.Generator(device="cuda").manual_seed(9)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 3000, (8, 16), device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.float16, enabled=scaler is not None):
            loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if scheduler:
            scheduler.step()
        losses.append(loss.item())
    return losses


@pytest.mark.cuda
@pytest.mark.parametrize("segment_elems", [1 << 24, 3000], ids=["one-segment", "many-segments"])
def test_gpu_host_state_matches_gpu_state_and_torch(monkeypatch, segment_elems):
    monkeypatch.setattr(_host_state, "HOST_SEGMENT_ELEMS", segment_elems)
    ref, host, torch_model = _gpu_model(), _gpu_model(), _gpu_model()
    opts = [shardadam.FusedAdam(ref.parameters(), lr=1e-3, weight_decay=0.01),
            shardadam.FusedAdam(host.parameters(), lr=1e-3, weight_decay=0.01, state_device="cpu"),
            torch.optim.AdamW(torch_model.parameters(), lr=1e-3, weight_decay=0.01)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in opts]
    for model, opt, sched in zip((ref, host, torch_model), opts, scheds):
        _train(model, opt, 5, scheduler=sched, clip=0.5)
    for a, b, c in zip(ref.parameters(), host.parameters(), torch_model.parameters()):
        torch.testing.assert_close(b, a, rtol=2e-6, atol=2e-7)
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)
    p = next(host.parameters())
    assert opts[1].state[p]["exp_avg"].device.type == "cpu"


@pytest.mark.cuda
def test_gpu_host_state_reads_a_gpu_tensor_lr():
    """lr as a one-element CUDA tensor that the schedule fills in place (as
    for capturable steps): the host step reads its value every step, as the
    GPU-state optimizer's kernel does."""
    ref, host = _gpu_model(), _gpu_model()
    opts = [shardadam.FusedAdam(m.parameters(), lr=torch.tensor(1e-3, device="cuda"), weight_decay=0.01, **kw)
            for m, kw in ((ref, {}), (host, dict(state_device="cpu")))]
    for model, opt in zip((ref, host), opts):
        _train(model, opt, 5, scheduler=torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))
    assert opts[1].param_groups[0]["lr"].device.type == "cuda"
    for a, b in zip(ref.parameters(), host.parameters()):
        torch.testing.assert_close(b, a, rtol=2e-6, atol=2e-7)


@pytest.mark.cuda
def test_gpu_host_state_keeps_no_gpu_memory():
    model = _gpu_model()
    opt = shardadam.FusedAdam(model.parameters(), lr=1e-3, state_device="cpu")
    _train(model, opt, 1)
    opt.zero_grad()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    _train(model, opt, 2)
    opt.zero_grad()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    host_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert host_bytes == 2 * params  # exp_avg and exp_avg_sq, fp32, all on the host


@pytest.mark.cuda
@pytest.mark.parametrize("options", [dict(master_weights=True), dict(store_param_remainders=True),
                                     dict(exp_avg_dtype=shardadam.BLOCKWISE8,
                                          exp_avg_sq_dtype=shardadam.BLOCKWISE8)],
                         ids=["master", "remainders", "blockwise8"])
def test_gpu_host_state_bf16_and_low_bit(monkeypatch, options):
    monkeypatch.setattr(_host_state, "HOST_SEGMENT_ELEMS", 5000)
    dtype = torch.float32 if "exp_avg_dtype" in options else torch.bfloat16
    ref, host = _gpu_model(dtype), _gpu_model(dtype)
    opt_ref = shardadam.FusedAdam(ref.parameters(), lr=1e-3, **options)
    opt_host = shardadam.FusedAdam(host.parameters(), lr=1e-3, state_device="cpu", **options)
    _train(ref, opt_ref, 4)
    _train(host, opt_host, 4)
    for a, b in zip(ref.parameters(), host.parameters()):
        # One fp32 rounding apart can flip a bf16 rounding or an 8-bit code: a step's worth at most.
        torch.testing.assert_close(b.float(), a.float(), rtol=0, atol=2e-3)
    sd_ref, sd_host = opt_ref.state_dict(), opt_host.state_dict()
    for key, entry in sd_ref["state"].items():
        for name, value in entry.items():
            torch.testing.assert_close(sd_host["state"][key][name].float().cpu(), value.float().cpu(),
                                       rtol=0.02, atol=1e-6)


@pytest.mark.cuda
def test_gpu_host_state_grad_scaler_skips_exactly():
    model = _gpu_model()
    opt = shardadam.FusedAdam(model.parameters(), lr=1e-3, state_device="cpu")
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 16)
    _train(model, opt, 2, scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()}
    for p in model.parameters():
        p.grad = torch.full_like(p, float("inf"))
    scaler.step(opt)
    scaler.update()
    for a, p in zip(before, model.parameters()):
        assert_bits_equal(a, p.detach())
    for name, value in opt.state[next(model.parameters())].items():
        assert_bits_equal(state_before[name], value)


@pytest.mark.cuda
def test_gpu_host_state_decoupled_fp32_grads_of_bf16_params():
    """TE's decoupled fp32 gradients of bf16 parameters: staged as fp32."""
    ref, host = _gpu_model(torch.bfloat16), _gpu_model(torch.bfloat16)
    opts = [shardadam.FusedAdam(m.parameters(), lr=1e-3, master_weights=True, use_decoupled_grad=True, **kw)
            for m, kw in ((ref, {}), (host, dict(state_device="cpu")))]
    for step in range(3):
        for model in (ref, host):
            g = torch.Generator(device="cuda").manual_seed(step)
            for p in model.parameters():
                p.decoupled_grad = torch.randn(p.shape, device="cuda", generator=g)
        for opt in opts:
            opt.step()
    for a, b in zip(ref.parameters(), host.parameters()):
        torch.testing.assert_close(b.float(), a.float(), rtol=0, atol=2 ** -7 * a.float().abs().max().item())
