"""shardadam's optimizers under transformers' Trainer (CPU, gloo), against
torch.optim.AdamW under the same Trainer: FusedAdam as a plain Trainer
optimizer, DistributedFusedAdam through DistributedFusedAdamTrainer (no DDP
wrapper) against DDP. The model is a tiny GPT-2 whose lm_head and wte share
one Parameter."""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers reads it: nothing is downloaded

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402,F401  (with accelerate, a test dependency: scripts/install.sh; no skip)

import shardadam  # noqa: E402
from conftest import DEVICES  # noqa: E402
from hf_models import tiny_gpt2, token_rows  # noqa: E402
from test_distributed import _exit, _rank_group, _spawn_all  # noqa: E402

# eps=1e-3: attention's key bias has a zero gradient up to rounding (softmax
# ignores a shift), and with a small eps Adam turns that rounding noise into
# whole lr-sized steps that differ between any two implementations.
OPTIM_KW = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.1)


def _args(tmp: str, **kw):
    from transformers import TrainingArguments
    base = dict(output_dir=tmp, use_cpu=True, per_device_train_batch_size=2, max_steps=4, learning_rate=OPTIM_KW["lr"],
                weight_decay=OPTIM_KW["weight_decay"], adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=OPTIM_KW["eps"],
                max_grad_norm=0.5, warmup_steps=1, lr_scheduler_type="linear", report_to="none",
                save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0, data_seed=0,
                dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(**base)


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_single(tmp_path, device: str, make_optimizer):
    """One process: Trainer with optimizers=(make_optimizer(model), linear schedule)."""
    from transformers import Trainer, get_linear_schedule_with_warmup
    model = tiny_gpt2().to(device)
    opt = make_optimizer(model)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=4)
    trainer = Trainer(model=model, args=_args(str(tmp_path), use_cpu=device == "cpu"), train_dataset=token_rows(8),
                      optimizers=(opt, sched))
    trainer.train()
    return model.cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_fused_adam_under_trainer_equals_torch_adamw(tmp_path, device):
    """optimizers=(FusedAdam, scheduler): Trainer clips with
    clip_grad_norm_ and steps the optimizer; the tied embedding is one
    parameter (updated once per step, not twice)."""
    got = _train_single(tmp_path / "fused", device, lambda m: shardadam.FusedAdam(m.parameters(), **OPTIM_KW))
    want = _train_single(tmp_path / "torch", device, lambda m: torch.optim.AdamW(m.parameters(), **OPTIM_KW))
    assert got.lm_head.weight is got.transformer.wte.weight
    before = _params(tiny_gpt2())
    for name, p in _params(want).items():
        assert not torch.equal(p, before[name]), f"{name} did not train"
        torch.testing.assert_close(_params(got)[name], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


LOW_BIT = {"8-bit": dict(exp_avg_dtype=shardadam.BLOCKWISE8, exp_avg_sq_dtype=shardadam.BLOCKWISE8),
           "FP8": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)}
LOW_BIT_MOVEMENT_ERROR = 0.05


@pytest.mark.parametrize("kind", LOW_BIT)
def test_low_bit_fused_adam_checkpoint_resumes_under_trainer(tmp_path, kind):
    """FusedAdam with low-bit states built by Trainer (optimizer_cls_and_kwargs):
    a checkpoint saved at step 2 holds fp32 state, and resume_from_checkpoint
    continues to step 4 as the uninterrupted run. 8-bit codes re-encode to
    themselves (bit for bit); FP8's per-tensor scale is chosen again from the
    loaded values and may be half the kernel's, so its run agrees to fp32
    rounding of the update."""
    from transformers import Trainer
    runs = {}
    for name in ("uninterrupted", "resumed"):
        model = tiny_gpt2()
        args = _args(str(tmp_path / "run"), save_strategy="steps", save_steps=2)
        trainer = Trainer(model=model, args=args, train_dataset=token_rows(8),
                          optimizer_cls_and_kwargs=(shardadam.FusedAdam, dict(OPTIM_KW, **LOW_BIT[kind])))
        if name == "resumed":
            with torch.no_grad():  # everything must come from the checkpoint
                for p in model.parameters():
                    p.add_(1.0)
            trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
        else:
            trainer.train()
        runs[name] = _params(model)
    saved = torch.load(tmp_path / "run" / "checkpoint-2" / "optimizer.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for e in saved["state"].values() for v in e.values())
    before = _params(tiny_gpt2())
    for name, want in runs["uninterrupted"].items():
        assert not torch.equal(want, before[name]), f"{name} did not train"
        tol = dict(rtol=0, atol=0) if kind == "8-bit" else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(runs["resumed"][name], want, **tol, msg=lambda m: f"{name}: {m}")


def _trainer_worker(rank: int, world: int, port: int, tmp: str, device: str, storage: str, out) -> None:
    """Rank `rank` of 2 gloo ranks: DDP + torch AdamW (Trainer's own
    optim="adamw_torch") and DistributedFusedAdamTrainer + DistributedFusedAdam
    (built by Trainer from optimizer_cls_and_kwargs, with its decay / no-decay
    groups, states stored as `storage`: "fp32" or a LOW_BIT kind), on the same
    data, with gradient accumulation and clipping. device "cuda": NCCL, one GPU
    per rank."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    with _rank_group(rank, world, port, out, "nccl" if device == "cuda" else "gloo"):
        from transformers import Trainer
        from shardadam.integrations.huggingface import DistributedFusedAdamTrainer
        results = {}
        for name in ("ddp", "distributed", "resumed"):
            model = tiny_gpt2()
            # The distributed run saves a checkpoint after step 2 (every rank
            # takes part), from which "resumed" continues to step 4.
            saving = dict(save_strategy="steps", save_steps=2) if name == "distributed" else {}
            args = _args(os.path.join(tmp, name if name != "resumed" else "distributed"), use_cpu=device == "cpu",
                         gradient_accumulation_steps=2, optim="adamw_torch", **saving)
            if name == "ddp":
                trainer = Trainer(model=model, args=args, train_dataset=token_rows(32))
            else:
                trainer = DistributedFusedAdamTrainer(
                    model=model, args=args, train_dataset=token_rows(32),
                    optimizer_cls_and_kwargs=(shardadam.DistributedFusedAdam,
                                              dict(OPTIM_KW, bucket_cap_mb=1e-3, overlap_param_sync=True,
                                                   **LOW_BIT.get(storage, {}))))
            if name == "resumed":
                with torch.no_grad():  # everything must come from the checkpoint
                    for p in model.parameters():
                        p.add_(1.0)
                trainer.train(resume_from_checkpoint=os.path.join(tmp, "distributed", "checkpoint-2"))
            else:
                trainer.train()
            if name != "ddp":
                trainer.optimizer.optimizer.param_sync()
                results[f"{name}_wrapped"] = type(trainer.model_wrapped).__name__
            results[name] = {n: p.cpu().numpy().copy() for n, p in _params(model).items()}
            results[f"{name}_tied"] = model.lm_head.weight is model.transformer.wte.weight
        out.put((rank, results))
    _exit()


@pytest.mark.parametrize("device,storage", [("cpu", "fp32"), ("cpu", "8-bit"), ("cpu", "FP8"),
                                            pytest.param("cuda", "fp32", marks=pytest.mark.multigpu)])
def test_distributed_fused_adam_trainer_equals_ddp_adamw(tmp_path, device, storage):
    """And its checkpoint (saved by every rank together) resumes to the
    uninterrupted run. Low-bit states: the checkpoint holds fp32 values, the
    resumed run is the uninterrupted one bit for bit, and both follow DDP +
    AdamW within the states' rounding."""
    ranks = _spawn_all(_trainer_worker, 2, str(tmp_path), device, storage)
    result = ranks[0]
    assert result["distributed_wrapped"] == result["resumed_wrapped"] == "GPT2LMHeadModel", \
        "DistributedFusedAdamTrainer must not wrap the model in DDP"
    assert result["ddp_tied"] and result["distributed_tied"] and result["resumed_tied"]
    before = _params(tiny_gpt2())
    for name, want in result["ddp"].items():
        assert not np.array_equal(want, before[name].numpy()), f"{name} did not train"
        np.testing.assert_array_equal(ranks[1]["distributed"][name], result["distributed"][name],
                                      err_msg=f"ranks disagree on {name}")
        got = torch.from_numpy(result["distributed"][name])
        if storage == "fp32":
            torch.testing.assert_close(got, torch.from_numpy(want), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        else:  # the movement from the start, within the states' rounding
            moved, want_moved = got - before[name], torch.from_numpy(want) - before[name]
            err = (moved - want_moved).norm() / want_moved.norm()
            assert err < LOW_BIT_MOVEMENT_ERROR, f"{name}: movement off by {err:.3f} against DDP + AdamW"
        # Resumed from the checkpoint of step 2: the uninterrupted run, bit for
        # bit; with low-bit states within their rounding, since the resumed
        # run quantizes the checkpoint's fp32 values into blocks of the layout
        # it has when it loads, which the uninterrupted run cut otherwise.
        if storage == "fp32":
            np.testing.assert_array_equal(result["resumed"][name], result["distributed"][name],
                                          err_msg=f"resumed run: {name}")
        else:
            moved = torch.from_numpy(result["distributed"][name]) - before[name]
            err = (torch.from_numpy(result["resumed"][name]) - before[name] - moved).norm() / moved.norm()
            assert err < LOW_BIT_MOVEMENT_ERROR, f"resumed run: {name}: movement off by {err:.3f}"


def test_contiguous_grad_buffer_is_refused_before_training(one_rank, tmp_path):
    """Trainer zeroes gradients with model.zero_grad() (set_to_none), which
    would drop the views of a contiguous gradient buffer: refused, naming the
    option, before any step."""
    from transformers import get_constant_schedule
    from shardadam.integrations.huggingface import DistributedFusedAdamTrainer
    model = tiny_gpt2()
    before = _params(model)
    opt = shardadam.DistributedFusedAdam(model.parameters(), contiguous_grad_buffer=True, **OPTIM_KW)
    trainer = DistributedFusedAdamTrainer(model=model, args=_args(str(tmp_path)), train_dataset=token_rows(8),
                                          optimizers=(opt, get_constant_schedule(opt)))
    with pytest.raises(ValueError, match=r"contiguous_grad_buffer=False"):
        trainer.train()
    assert all(int(g["step"]) == 0 for g in opt.param_groups)
    for name, p in _params(model).items():
        assert torch.equal(p, before[name]), f"{name} changed"
