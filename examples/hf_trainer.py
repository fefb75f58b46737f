#!/usr/bin/env python
"""transformers' Trainer with shardadam: a tiny GPT-2 (built from its config,
no download) learns bytes of the standard library's source.

One process: Trainer(optimizers=(shardadam.FusedAdam(...), scheduler)).
Under torchrun: DistributedFusedAdamTrainer builds DistributedFusedAdam from
optimizer_cls_and_kwargs (ZeRO-2, no DDP wrapper).

    python examples/hf_trainer.py                                        # CPU, FusedAdam
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py      # CPU (gloo), DistributedFusedAdam
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py --device cuda --bf16   # NCCL
"""
from __future__ import annotations

import argparse
import os
import pathlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402
from transformers import get_linear_schedule_with_warmup  # noqa: E402

import shardadam  # noqa: E402
from shardadam.integrations.huggingface import DistributedFusedAdamTrainer  # noqa: E402


def byte_rows(seq: int, count: int) -> list[dict]:
    """`count` windows of `seq` bytes of the standard library's source, as a Trainer dataset."""
    data = torch.frombuffer(bytearray(pathlib.Path(os.__file__).read_bytes()), dtype=torch.uint8).long()
    starts = torch.linspace(0, len(data) - seq - 1, count).long()
    return [{"input_ids": data[s:s + seq], "labels": data[s:s + seq]} for s in starts.tolist()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (CUDA)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--out", default="examples/out/hf_trainer")
    args = parser.parse_args()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=args.width, n_layer=args.layers,
                                       n_head=4, bos_token_id=0, eos_token_id=0))
    training = TrainingArguments(output_dir=args.out, use_cpu=args.device == "cpu", bf16=args.bf16,
                                 per_device_train_batch_size=8, max_steps=args.steps, learning_rate=3e-3,
                                 weight_decay=0.1, warmup_steps=5, max_grad_norm=1.0, logging_steps=10,
                                 save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
    dataset = byte_rows(64, 8 * args.steps * int(os.environ.get("WORLD_SIZE", "1")))
    if distributed:
        trainer = DistributedFusedAdamTrainer(
            model=model, args=training, train_dataset=dataset,
            optimizer_cls_and_kwargs=(shardadam.DistributedFusedAdam, dict(lr=3e-3, weight_decay=0.1)))
    else:
        model.to(args.device)
        opt = shardadam.FusedAdam(model.parameters(), lr=3e-3, weight_decay=0.1)
        schedule = get_linear_schedule_with_warmup(opt, num_warmup_steps=5, num_training_steps=args.steps)
        trainer = Trainer(model=model, args=training, train_dataset=dataset, optimizers=(opt, schedule))
    result = trainer.train()
    if trainer.is_world_process_zero():
        optimizer = "DistributedFusedAdam" if distributed else "FusedAdam"
        print(f"{optimizer}: {args.steps} steps, mean training loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
