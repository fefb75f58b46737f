#!/usr/bin/env python
"""PyTorch Lightning with shardadam: a tiny causal transformer learns bytes of
the standard library's source.

--devices 1: FusedAdam from configure_optimizers. --devices N (N > 1):
DistributedFusedAdam from configure_optimizers with DistributedFusedAdamStrategy
(ZeRO-2, no DDP wrapper; Lightning launches the processes).

    python examples/lightning_train.py                       # CPU, FusedAdam
    python examples/lightning_train.py --devices 2           # CPU (gloo), DistributedFusedAdam
    python examples/lightning_train.py --device cuda --devices 2 --bf16   # NCCL
"""
from __future__ import annotations

import argparse
import os
import pathlib

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardadam
from shardadam.integrations.lightning import DistributedFusedAdamStrategy

SEQ = 64


class ByteModel(pl.LightningModule):
    def __init__(self, width: int, layers: int, distributed: bool):
        super().__init__()
        self.distributed = distributed
        self.embed = nn.Embedding(256, width)
        self.pos = nn.Parameter(torch.zeros(SEQ, width))
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, 256)

    def training_step(self, batch, _):
        x, y = batch[:, :-1], batch[:, 1:]
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        h = self.blocks(self.embed(x) + self.pos[:x.shape[1]], mask=mask, is_causal=True)
        loss = F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        kind = shardadam.DistributedFusedAdam if self.distributed else shardadam.FusedAdam
        return kind(self.parameters(), lr=3e-3, weight_decay=0.1)


def windows(count: int) -> torch.Tensor:
    data = torch.frombuffer(bytearray(pathlib.Path(os.__file__).read_bytes()), dtype=torch.uint8).long()
    starts = torch.linspace(0, len(data) - SEQ - 2, count).long()
    return torch.stack([data[s:s + SEQ + 1] for s in starts.tolist()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--bf16", action="store_true", help="bf16-mixed precision (CUDA)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    distributed = args.devices > 1
    torch.manual_seed(0)
    model = ByteModel(args.width, args.layers, distributed)
    loader = torch.utils.data.DataLoader(windows(8 * args.steps * args.devices), batch_size=8, shuffle=True)
    trainer = pl.Trainer(accelerator=args.device, devices=args.devices, max_steps=args.steps,
                         strategy=DistributedFusedAdamStrategy() if distributed else "auto",
                         precision="bf16-mixed" if args.bf16 else "32-true", gradient_clip_val=1.0,
                         logger=False, enable_checkpointing=False, log_every_n_steps=10)
    trainer.fit(model, loader)
    if trainer.is_global_zero:
        optimizer = "DistributedFusedAdam" if distributed else "FusedAdam"
        print(f"{optimizer}: {args.steps} steps, last loss {float(trainer.callback_metrics['loss']):.4f}")


if __name__ == "__main__":
    main()
