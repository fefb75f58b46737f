"""shardadam's optimizers under PyTorch Lightning (CPU, gloo), against
torch.optim.AdamW under the same Trainer: FusedAdam from configure_optimizers,
DistributedFusedAdam with DistributedFusedAdamStrategy (no DDP wrapper)
against DDPStrategy, with gradient accumulation and clipping."""
from __future__ import annotations

import contextlib
import os

import numpy as np
import lightning.pytorch as pl  # a test dependency (scripts/install.sh): no skip
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardadam
from conftest import DEVICES
from test_distributed import _exit, _rank_group, _spawn_all

OPTIM_KW = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
STEPS, ACCUMULATE, BATCH = 3, 2, 4


class TinyRegression(pl.LightningModule):
    def __init__(self, make_optimizer):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.make_optimizer = make_optimizer

    def training_step(self, batch, _):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


def _data(world: int):
    g = torch.Generator().manual_seed(1)
    rows = STEPS * ACCUMULATE * BATCH * world
    dataset = torch.utils.data.TensorDataset(torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g))
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=False)


def _fit(module, strategy, world: int, clip=0.5, device: str = "cpu", ckpt_path=None, precision="32-true"):
    trainer = pl.Trainer(accelerator=device, devices=world, strategy=strategy, max_steps=STEPS, precision=precision,
                         accumulate_grad_batches=ACCUMULATE, gradient_clip_val=clip, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, _data(world), ckpt_path=ckpt_path)
    return trainer


def _adamw(params):
    return torch.optim.AdamW(params, **OPTIM_KW)


def _params(module) -> dict:
    return {n: p.detach().cpu().numpy().copy() for n, p in module.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
def test_fused_adam_from_configure_optimizers_equals_torch_adamw(device):
    got = TinyRegression(lambda params: shardadam.FusedAdam(params, **OPTIM_KW))
    want = TinyRegression(_adamw)
    before = _params(want)
    _fit(got, "auto", 1, device=device)
    _fit(want, "auto", 1, device=device)
    for name, value in _params(want).items():
        assert not np.array_equal(value, before[name]), f"{name} did not train"
        np.testing.assert_allclose(_params(got)[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def make_distributed(params):
    return shardadam.DistributedFusedAdam(params, bucket_cap_mb=1e-4, overlap_param_sync=True, **OPTIM_KW)


def _numpy_state(sd: dict) -> dict:
    return {(i, k): v.cpu().numpy().copy() for i, entry in sd["state"].items() for k, v in entry.items()}


@contextlib.contextmanager
def _launched(rank: int, world: int, port: int, device: str, out):
    """A rank launched here: Lightning sees LOCAL_RANK and the initialised
    group and launches nothing; gloo, or NCCL with one GPU per rank."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    with _rank_group(rank, world, port, out, "nccl" if device == "cuda" else "gloo"):
        yield


def _strategy_worker(rank: int, world: int, port: int, device: str, tmp: str, out) -> None:
    """DDPStrategy + AdamW, then DistributedFusedAdamStrategy +
    DistributedFusedAdam, in the same ranks."""
    with _launched(rank, world, port, device, out):
        from lightning.pytorch.strategies import DDPStrategy
        from shardadam.integrations.lightning import DistributedFusedAdamStrategy
        ddp = TinyRegression(_adamw)
        _fit(ddp, DDPStrategy(), world, device=device)
        mine = TinyRegression(make_distributed)
        trainer = _fit(mine, DistributedFusedAdamStrategy(), world, device=device)
        opt = trainer.optimizers[0]
        opt.param_sync()
        # A checkpoint (every rank dumps it, rank 0 writes the gathered
        # optimizer state) restores parameters and optimizer state into a
        # fresh module on every rank.
        path = os.path.join(tmp, "last.ckpt")
        trainer.save_checkpoint(path)
        saved = _numpy_state(opt.state_dict())
        restored = TinyRegression(make_distributed)
        with torch.no_grad():
            for p in restored.parameters():
                p.add_(1.0)
        again = _fit(restored, DistributedFusedAdamStrategy(), world, device=device, ckpt_path=path)
        # bf16-mixed: Lightning's mixed-precision plugin refuses to clip for
        # optimizers that unscale by themselves; the strategy clips through the optimizer.
        ddp_bf16, mine_bf16 = TinyRegression(_adamw), TinyRegression(make_distributed)
        _fit(ddp_bf16, DDPStrategy(), world, device=device, precision="bf16-mixed")
        _fit(mine_bf16, DistributedFusedAdamStrategy(), world, device=device, precision="bf16-mixed")
        bf16 = dict(ddp=_params(ddp_bf16), distributed=_params(mine_bf16))
        out.put((rank, dict(ddp=_params(ddp), distributed=_params(mine), wrapped=type(trainer.strategy.model).__name__, bf16=bf16,
                            steps=[int(g["step"]) for g in opt.param_groups], restored=_params(restored),
                            saved_state=saved, restored_state=_numpy_state(again.optimizers[0].state_dict()))))
    _exit()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.multigpu)])
def test_distributed_fused_adam_strategy_equals_ddp_adamw(device, tmp_path):
    ranks = _spawn_all(_strategy_worker, 2, device, str(tmp_path))
    result = ranks[0]
    assert result["wrapped"] == "TinyRegression", "the strategy must not wrap the module in DDP"
    assert result["steps"] == [STEPS], "one optimizer step per accumulated batch"
    for name, want in result["ddp"].items():
        np.testing.assert_array_equal(ranks[1]["distributed"][name], result["distributed"][name],
                                      err_msg=f"ranks disagree on {name}")
        np.testing.assert_allclose(result["distributed"][name], want, rtol=1e-5, atol=1e-6, err_msg=name)
    for name, want in result["bf16"]["ddp"].items():  # the same bf16 autocast forward: fp32 rounding apart
        np.testing.assert_allclose(result["bf16"]["distributed"][name], want, rtol=1e-5, atol=1e-6, err_msg=name)
    for r in ranks:  # the checkpoint restores every rank
        for name, value in result["distributed"].items():
            np.testing.assert_array_equal(r["restored"][name], value, err_msg=f"restored {name}")
        assert r["restored_state"].keys() == result["saved_state"].keys()
        for key, value in result["saved_state"].items():
            np.testing.assert_array_equal(r["restored_state"][key], value, err_msg=f"restored state {key}")


def test_a_freed_copy_of_the_optimizer_leaves_its_hooks(one_rank):
    """Lightning's LightningOptimizer subclasses the optimizer's class and
    copies its __dict__; freeing such a copy must not remove the hooks of the
    optimizer still training ([Note: hooks die with their optimizer])."""
    import gc
    from lightning.pytorch.core.optimizer import LightningOptimizer
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = shardadam.DistributedFusedAdam(model.parameters(), overlap_param_sync=True)
    # The forward waits hook the modules that own the parameters ([Note: hooks on the modules that own
    # the parameters] in distributed/_hooks.py): the two Linear layers, not the Tanh.
    forward_hooks = [len(m._forward_pre_hooks) for m in model]
    grad_hooks = [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
    assert grad_hooks == [1] * 4 and forward_hooks == [1, 0, 1]
    copy = LightningOptimizer(opt)
    del copy
    gc.collect()
    assert [len(m._forward_pre_hooks) for m in model] == forward_hooks
    assert [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()] == grad_hooks
    del opt
    gc.collect()
    assert [len(m._forward_pre_hooks) for m in model] == [0, 0, 0], "the optimizer's own hooks go with it"
    assert [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()] == [0] * 4


def _value_clip_worker(rank: int, world: int, port: int, out) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with _rank_group(rank, world, port, out):
        from shardadam.integrations.lightning import DistributedFusedAdamStrategy
        module = TinyRegression(make_distributed)
        before = _params(module)
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=DistributedFusedAdamStrategy(),
                             max_steps=STEPS, gradient_clip_val=0.5, gradient_clip_algorithm="value", logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        try:
            trainer.fit(module, _data(world))
            message = None
        except ValueError as e:
            message = str(e)
        after = _params(module)
        out.put((rank, dict(message=message, untouched=all(np.array_equal(after[n], before[n]) for n in before))))
    _exit()


def test_clipping_by_value_is_refused():
    """The reduced gradients live in the optimizer's shards: clipping them by
    value is refused on every rank before the first step, naming the fix."""
    for r in _spawn_all(_value_clip_worker, 2):
        assert r["message"] is not None and "gradient_clip_algorithm='norm'" in r["message"], r["message"]
        assert r["untouched"], "a step ran before the refusal"


def _fp16_worker(rank: int, world: int, port: int, device: str, tmp: str, out) -> None:
    """16-mixed (a GradScaler): DDPStrategy + AdamW, then the strategy with DistributedFusedAdam."""
    with _launched(rank, world, port, device, out):
        from lightning.pytorch.strategies import DDPStrategy
        from shardadam.integrations.lightning import DistributedFusedAdamStrategy
        ddp, mine = TinyRegression(_adamw), TinyRegression(make_distributed)
        ddp_trainer = _fit(ddp, DDPStrategy(), world, device=device, precision="16-mixed")
        trainer = _fit(mine, DistributedFusedAdamStrategy(), world, device=device, precision="16-mixed")
        trainer.optimizers[0].param_sync()
        scales = [float(t.precision_plugin.scaler.get_scale()) for t in (ddp_trainer, trainer)]
        out.put((rank, dict(ddp=_params(ddp), distributed=_params(mine), scales=scales)))
    _exit()


@pytest.mark.cuda
def test_distributed_fused_adam_strategy_under_grad_scaler_equals_ddp_adamw(tmp_path):
    """Lightning's 16-mixed plugin steps through torch.amp.GradScaler: the
    optimizer unscales, clips and reports inf/NaN itself; the result equals
    DDP + AdamW under the same scaler, and both scalers end at one scale."""
    result = _spawn_all(_fp16_worker, 1, "cuda", str(tmp_path))[0]
    assert result["scales"][0] == result["scales"][1], f"loss scales differ: {result['scales']}"
    for name, want in result["ddp"].items():
        np.testing.assert_allclose(result["distributed"][name], want, rtol=1e-5, atol=1e-6, err_msg=name)
