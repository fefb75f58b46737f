"""The models and data the benchmarks train: the GPT (default 1.4B
parameters), GPT-2 medium's parameter shapes, the size options, and the optimizers' storage kinds."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardadam

# The tiny model's 135k parameters fill several 0.1 MiB buckets, some parameters
# split across two, as the full model fills 100 MiB ones.
FULL = dict(d_model=2048, layers=24, heads=16, vocab=50304, seq=1024, batches="4,8", iters=10, rounds=2,
            bucket_cap_mb=100)
TINY = dict(d_model=64, layers=2, heads=4, vocab=256, seq=32, batches="2", iters=5, rounds=1, bucket_cap_mb=0.1)
SIZE_KEYS = ("d_model", "layers", "heads", "vocab", "seq")

# Storage kinds: name -> (parameter dtype, FusedAdam / DistributedFusedAdam options)
FP8 = dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
BLOCKWISE8 = dict(exp_avg_dtype=shardadam.BLOCKWISE8, exp_avg_sq_dtype=shardadam.BLOCKWISE8)
STOCHASTIC = dict(bf16_stochastic_round=True, stochastic_round_seed=0)
KINDS = {"fp32": (torch.float32, {}), "FP8 states": (torch.float32, FP8),
    "FP8 exp_avg": (torch.float32, dict(exp_avg_dtype=torch.uint8)),
    "8-bit blockwise states": (torch.float32, BLOCKWISE8),
    "bf16 + fp32 masters": (torch.bfloat16, dict(master_weights=True)),
    "bf16 stochastic rounding": (torch.bfloat16, STOCHASTIC), "bf16 round to nearest": (torch.bfloat16, {}),
}


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and learned position embeddings, blocks, final LayerNorm, untied LM head."""

    def __init__(self, d: int, layers: int, heads: int, vocab: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for m in self.modules():  # GPT-2's init: the first loss is then about ln(vocab)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt2_medium_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of GPT-2 medium (355M elements)."""
    d, layers, vocab, ctx = 1024, 24, 50257, 1024
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def build_model(args, dev, dtype: torch.dtype | None = None) -> GPT:
    """args' GPT from args.seed (0 without one), built on `dev` in `dtype`. The same seed on every rank: FSDP2 shards
    each rank's own copy, so the copies must be equal; DDP and DistributedFusedAdam broadcast rank 0's anyway."""
    torch.manual_seed(getattr(args, "seed", 0))
    if dtype is not None:
        torch.set_default_dtype(dtype)  # built in its dtype: no fp32 copy first
    try:
        with torch.device(dev):
            return GPT(args.d_model, args.layers, args.heads, args.vocab, args.seq)
    finally:
        torch.set_default_dtype(torch.float32)


def make_batch(args, batch: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed batch of random tokens per rank, reused every iteration: the model memorises it, so the loss falls
    within a few iterations (on fresh uniform tokens it would start at its minimum, ln(vocab), and stay there)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    g = torch.Generator(device=dev).manual_seed(getattr(args, "seed", 0) + 1 + rank)
    tokens = torch.randint(args.vocab, (batch, args.seq + 1), generator=g, device=dev)
    return tokens[:, :-1], tokens[:, 1:]


def autocast(cuda: bool):
    """bf16 autocast on the GPU; the CPU runs fp32 (they check wiring, not speed)."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()


def lm_loss(module, inputs: torch.Tensor, targets: torch.Tensor, cuda: bool) -> torch.Tensor:
    """The forward under autocast and an fp32 cross-entropy loss."""
    with autocast(cuda):
        logits = module(inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def add_size_args(ap, tiny: dict = TINY, full: dict = FULL) -> None:
    """The GPT's size options and --tiny; fill_defaults gives them their values."""
    ap.add_argument("--tiny", action="store_true", help=f"smoke run, CPU or GPU: {tiny}")
    ap.add_argument("--d-model", type=int, help=f"model width (default {full['d_model']}; --tiny {tiny['d_model']})")
    ap.add_argument("--layers", type=int, help=f"blocks (default {full['layers']}; --tiny {tiny['layers']})")
    ap.add_argument("--heads", type=int, help=f"attention heads (default {full['heads']}; --tiny {tiny['heads']})")
    ap.add_argument("--vocab", type=int, help=f"vocabulary (default {full['vocab']}; --tiny {tiny['vocab']})")
    ap.add_argument("--seq", type=int, help=f"sequence length (default {full['seq']}; --tiny {tiny['seq']})")


def fill_defaults(args, full: dict = FULL, keys=None, tiny: dict = TINY) -> None:
    """Whatever was not given (of `keys`, default all) from `tiny` with --tiny, else `full`."""
    defaults = tiny if args.tiny else full
    for key in keys or defaults:
        if getattr(args, key, None) is None:
            setattr(args, key, defaults[key])
