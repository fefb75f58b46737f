#!/usr/bin/env python
"""A real training run with shardadam.FusedAdam: a small GPT learns to write
Python, character by character, from the standard library's own source code
(no download needed). CPU by default, the GPU with --device cuda.

It trains the same model from the same seed with torch.optim.AdamW too and
prints both loss curves: the two optimizers compute the same update, so the
curves must agree (closely in fp32; within bf16 rounding with --bf16).

    python examples/train.py                      # CPU, fp32, about a minute on 2 cores
    python examples/train.py --device cuda --bf16 --steps 500
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardadam


def corpus(max_chars: int) -> str:
    """Python source text from the standard library, in a fixed order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    text, size = [], 0
    for path in sorted(root.glob("*.py")):
        chunk = path.read_text(encoding="utf-8", errors="replace")
        text.append(chunk)
        size += len(chunk)
        if size >= max_chars:
            break
    return "".join(text)[:max_chars]


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, ctx: int, d: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1), persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices, not biases, norms or embeddings' positions (the usual GPT recipe)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def train(name: str, make_opt, args, data: torch.Tensor, vocab: int, dtype: torch.dtype) -> list[float]:
    torch.manual_seed(args.seed)
    model = TinyGPT(vocab, args.ctx).to(device=args.device, dtype=dtype)
    opt = make_opt(param_groups(model, 0.1))
    gen = torch.Generator().manual_seed(args.seed + 1)
    losses, t0 = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        lr = args.lr * min(1.0, step / 20) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, data.numel() - args.ctx - 1, (args.batch,), generator=gen)
        batch = torch.stack([data[s:s + args.ctx + 1] for s in starts.tolist()]).to(args.device)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % args.log_every == 0 or step == 1:
            recent = sum(losses[-args.log_every:]) / len(losses[-args.log_every:])
            print(f"{name:>18} step {step:5d}  loss {recent:.4f}  {time.perf_counter() - t0:7.1f} s", flush=True)
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--bf16", action="store_true", help="bf16 model; FusedAdam keeps fp32 master weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--chars", type=int, default=2_000_000)
    args = ap.parse_args()
    text = corpus(args.chars)
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    print(f"shardadam {shardadam.__version__} {shardadam.build_info()}")
    print(f"corpus: {len(text):,} characters of Python, vocabulary {len(chars)}; device {args.device}, "
          f"{'bf16 model + fp32 masters' if args.bf16 else 'fp32'}")
    ours = train("shardadam.FusedAdam",
                 lambda groups: shardadam.FusedAdam(groups, lr=args.lr, master_weights=args.bf16),
                 args, data, len(chars), torch.bfloat16 if args.bf16 else torch.float32)
    # The reference: torch AdamW on the fp32 model (what fp32 masters stand for).
    theirs = train("torch AdamW", lambda groups: torch.optim.AdamW(groups, lr=args.lr), args, data, len(chars),
                   torch.float32)
    tail = max(1, args.steps // 10)
    a, b = sum(ours[-tail:]) / tail, sum(theirs[-tail:]) / tail
    print(f"\nfinal loss (mean of last {tail} steps): FusedAdam {a:.4f}, torch AdamW {b:.4f}, "
          f"start {ours[0]:.4f}")
    if not a < 0.7 * ours[0]:
        raise SystemExit("FusedAdam did not learn: the loss did not fall by 30%")
    if abs(a - b) > 0.05 * b:
        raise SystemExit("FusedAdam and torch AdamW diverged by more than 5%")


if __name__ == "__main__":
    main()
