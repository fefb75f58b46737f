"""DistributedFusedAdam's lean fp32 layout: by default an fp32 model keeps no
master of its own (the parameter shard is the fp32 master, bit for bit), and
with contiguous_grad_buffer the reduced gradient shard is this rank's part of
the gradient buffer ([Note: reduced shards in the gradient buffer]). With
both contiguous buffers the optimizer then holds only the rule's states:
8 bytes per parameter over N ranks for Adam. One gloo rank in process;
references: torch's AdamW and the same run with store_params=True. The
2-rank and 4-rank runs against AdamW are test_distributed.py's contiguous
variants, which use this layout by default."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_bits_equal
from test_apex_api import HYPER, _batch, _dfa, _model

BOTH = dict(contiguous_param_buffer=True, contiguous_grad_buffer=True)


def _step(model, opt, s: int, zero=None) -> None:
    (zero or opt.zero_grad)()
    x, y = _batch(s, next(model.parameters()).dtype)
    F.mse_loss(model(x), y).backward()
    opt.step()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_fp32_with_contiguous_buffers_holds_only_the_states(one_rank):
    model = _model()
    opt = _dfa(model, **BOTH)
    assert opt.store_params is False and opt.master is None and opt.grads_in_buffer
    assert {_storage(t) for t in opt.param_shards.tensors} == {_storage(t) for t in opt.param_buffer.tensors}
    assert {_storage(t) for t in opt.grad_shards.tensors} == {_storage(t) for t in opt.grad_buffer.tensors}
    held = {_storage(t): t.untyped_storage().nbytes() for t in [*opt.states.values(), *opt.state_scales.values()]}
    rows = len(opt.layout.buckets) * opt.shard_size
    assert sum(held.values()) == 2 * 4 * rows  # exp_avg and exp_avg_sq, fp32, this rank's shard (padding included)


@pytest.mark.parametrize("kw", [{}, BOTH, dict(BOTH, overlap_grad_sync=False)], ids=["plain", "contiguous",
                                                                                       "contiguous-no-overlap"])
def test_lean_layout_equals_stored_masters_bit_for_bit_and_adamw(one_rank, kw):
    lean, stored, want = _model(), _model(), _model()
    opts = _dfa(lean, **kw), _dfa(stored, store_params=True, **kw)
    reference = torch.optim.AdamW(want.parameters(), foreach=False, **HYPER)
    assert opts[0].master is None and opts[1].master is not None
    for s in range(4):
        for model, opt in zip((lean, stored, want), opts + (reference,)):
            _step(model, opt, s)
    for i, (a, b, w) in enumerate(zip(lean.parameters(), stored.parameters(), want.parameters())):
        assert_bits_equal(a.detach(), b.detach(), f"param {i}")
        torch.testing.assert_close(a.detach(), w.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype, kw, stored", [
    (torch.float32, {}, False),
    (torch.float32, dict(param_sync_dtype=torch.bfloat16), True),   # a bf16 shard is no fp32 master
    (torch.float32, dict(dtype=torch.bfloat16), True),
    (torch.bfloat16, {}, True),
    (torch.bfloat16, dict(store_param_remainders=True), False),
    (torch.bfloat16, dict(with_scaled_states=True, dtype=torch.float16), True),
    (torch.float32, dict(store_params=True), True),
], ids=["fp32", "fp32-bf16-sync", "bf16-state", "bf16", "remainders", "scaled-states", "asked"])
def test_store_params_default_keeps_a_master_only_where_the_shard_is_not_one(one_rank, dtype, kw, stored):
    opt = _dfa(_model(dtype), **kw)
    assert opt.store_params is stored and (opt.master is not None) is stored


def test_a_parameter_moved_to_bf16_sync_brings_a_master_back(one_rank):
    model = _model()
    opt = _dfa(model, overlap_grad_sync=False)
    assert opt.master is None
    opt.init_params([model[0].weight], param_sync_dtype=torch.bfloat16)
    assert opt.store_params is True and opt.master is not None


@pytest.mark.parametrize("overlap", [True, False], ids=["hooks", "no-hooks"])
def test_a_backward_into_the_consumed_buffer_is_refused(one_rank, overlap):
    """Without zero_grad() between a step and the next backward, autograd adds
    into a buffer whose shard holds the last step's sums: refused, naming
    the parameter and the fix; zero_grad() then lets training go on."""
    model = _model()
    opt = _dfa(model, overlap_grad_sync=overlap, **BOTH)
    _step(model, opt, 0)
    _step(model, opt, 1)
    x, y = _batch(2)
    with pytest.raises(RuntimeError, match=r"still holds the last step's reduced shard.*call optimizer.zero_grad\(\)"):
        F.mse_loss(model(x), y).backward()
        opt.step()
    _step(model, opt, 2)


def test_model_zero_grad_with_set_to_none_replaces_the_views(one_rank):
    """model.zero_grad() (set_to_none=True, as Hugging Face's Trainer calls
    it) drops the views: the new gradients are copied into the buffer and
    the run equals torch's AdamW."""
    model, want = _model(), _model()
    opt = _dfa(model, **BOTH)
    reference = torch.optim.AdamW(want.parameters(), foreach=False, **HYPER)
    for s in range(4):
        _step(model, opt, s, zero=model.zero_grad)
        _step(want, reference, s)
    opt.param_sync()
    for i, (a, w) in enumerate(zip(model.parameters(), want.parameters())):
        torch.testing.assert_close(a.detach(), w.detach(), rtol=1e-6, atol=1e-7, msg=lambda m: f"param {i}: {m}")


@pytest.mark.cuda
def test_nccl_reduces_in_place_on_one_gpu():
    """NCCL's reduce-scatter with its output inside its input (one rank on
    the GPU): trains as torch's AdamW."""
    from test_distributed import _config, _reference, _spawn, _worker
    result = _spawn(_worker, 1, _config(device="cuda", contiguous_grad_buffer=True, contiguous_param_buffer=True))
    assert result["grads_in_buffer"]
    for i, (got, want) in enumerate(zip(result["params"], _reference(1)[0])):
        torch.testing.assert_close(torch.from_numpy(got), want.contiguous(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"param {i}: {m}")
