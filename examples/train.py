#!/usr/bin/env python
"""A real training run with shardadam: a small GPT learns to write Python,
character by character, from the standard library's own source code (no
download needed). CPU by default, the GPU with --device cuda.

Run as a plain script, it trains with shardadam.FusedAdam, then the same model
from the same seed with torch.optim.AdamW, and prints both loss curves: the two
optimizers compute the same update, so the curves must agree (closely in fp32;
within bf16 rounding with --bf16).

Run under torchrun, every rank builds the same model and trains on its slice of
each global batch with shardadam.DistributedFusedAdam (ZeRO-2, no DDP wrapper),
then the same model again with DDP + torch.optim.AdamW on the same global
batches. Rank 0 shows a progress bar, prints both curves side by side, writes
the loss log (CSV) and the loss curves (SVG) to --out, and checks that the
final losses agree. gloo on CPU; NCCL, one GPU per process, with --device cuda.

    python examples/train.py                      # CPU, fp32, about a minute on 2 cores
    python examples/train.py --device cuda --bf16 --steps 500
    torchrun --standalone --nproc_per_node 2 examples/train.py [--device cuda]   # bash examples/run.sh
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import sysconfig
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardadam
from report import ProgressBar, write_loss_csv, write_loss_svg


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


def learning_rate(step: int, args) -> float:
    """Linear warm-up over 20 steps, then cosine decay to zero at the last step."""
    return args.lr * min(1.0, step / 20) * 0.5 * (1 + math.cos(math.pi * step / args.steps))


def sample_batch(gen: torch.Generator, data: torch.Tensor, batch: int, ctx: int) -> torch.Tensor:
    """batch random windows of ctx + 1 characters (inputs and next-character targets), on the CPU."""
    starts = torch.randint(0, data.numel() - ctx - 1, (batch,), generator=gen)
    return torch.stack([data[s:s + ctx + 1] for s in starts.tolist()])


def next_char_loss(model, batch: torch.Tensor, vocab: int) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, vocab), batch[:, 1:].reshape(-1))


# ------------------------------------------------------------------ single process

def train(name: str, make_opt, args, data: torch.Tensor, vocab: int, dtype: torch.dtype) -> list[float]:
    torch.manual_seed(args.seed)
    model = TinyGPT(vocab, args.ctx).to(device=args.device, dtype=dtype)
    opt = make_opt(model)
    gen = torch.Generator().manual_seed(args.seed + 1)
    losses, t0 = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = learning_rate(step, args)
        batch = sample_batch(gen, data, args.batch, args.ctx).to(args.device)
        loss = next_char_loss(model, batch, vocab)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % args.log_every == 0 or step == 1:
            recent = sum(losses[-args.log_every:]) / len(losses[-args.log_every:])
            print(f"{name:>18} step {step:5d}  loss {recent:.4f}  {time.perf_counter() - t0:7.1f} s", flush=True)
    return losses


def encode(text: str) -> tuple[torch.Tensor, list[str]]:
    """The text as character ids, and its vocabulary (the sorted characters)."""
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), chars


def run_single(args, text: str) -> None:
    """FusedAdam against torch AdamW in this process."""
    data, chars = encode(text)
    print(f"shardadam {shardadam.__version__} {shardadam.build_info()}")
    print(f"corpus: {len(text):,} characters of Python, vocabulary {len(chars)}; device {args.device}, "
          f"{'bf16 model + fp32 masters' if args.bf16 else 'fp32'}")
    ours = train("shardadam.FusedAdam",
                 lambda model: shardadam.FusedAdam(param_groups(model, 0.1), lr=args.lr, master_weights=args.bf16),
                 args, data, len(chars), torch.bfloat16 if args.bf16 else torch.float32)
    # The reference: torch AdamW on the fp32 model (what fp32 masters stand for).
    theirs = train("torch AdamW", lambda model: torch.optim.AdamW(param_groups(model, 0.1), lr=args.lr), args, data,
                   len(chars), torch.float32)
    tail = max(1, args.steps // 10)
    a, b = sum(ours[-tail:]) / tail, sum(theirs[-tail:]) / tail
    print(f"\nfinal loss (mean of last {tail} steps): FusedAdam {a:.4f}, torch AdamW {b:.4f}, "
          f"start {ours[0]:.4f}")
    if not a < 0.7 * ours[0]:
        raise SystemExit("FusedAdam did not learn: the loss did not fall by 30%")
    if abs(a - b) > 0.05 * b:
        raise SystemExit("FusedAdam and torch AdamW diverged by more than 5%")


# ------------------------------------------------------------------ torchrun

def init_distributed(args) -> torch.device:
    """Join the torchrun job: gloo on the CPU, NCCL with one GPU per process."""
    torch.set_num_threads(1)  # the ranks share the machine's cores
    if args.device == "cpu":
        dist.init_process_group("gloo")
        return torch.device("cpu")
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if torch.cuda.device_count() < local_world:
        raise SystemExit(f"--device cuda needs a GPU per process: {local_world} processes, "
                         f"{torch.cuda.device_count()} GPUs")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device


def mean_over_ranks(value: torch.Tensor) -> float:
    """The global batch's loss: every rank's slice has the same size."""
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def rank_slice(batch: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a global batch (the same on every rank)."""
    per_rank = batch.shape[0] // dist.get_world_size()
    return batch[dist.get_rank() * per_rank:(dist.get_rank() + 1) * per_rank]


def train_ranks(name: str, model, opt, clip, args, data, vocab, device) -> tuple[list[float], list[float]]:
    """Train on this rank's slice of every global batch; returns the global
    batches' losses and the milliseconds of each step."""
    gen = torch.Generator().manual_seed(args.seed + 1)  # every rank draws the same global batches
    bar = ProgressBar(f"{name:>20}", args.steps) if dist.get_rank() == 0 else None
    losses, times = [], []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = learning_rate(step, args)
        batch = rank_slice(sample_batch(gen, data, args.batch, args.ctx)).to(device)
        loss = next_char_loss(model, batch, vocab)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        clip(1.0)
        opt.step()
        losses.append(mean_over_ranks(loss))  # .item() waits for the step on CUDA too
        times.append(1e3 * (time.perf_counter() - t0))
        if bar:
            bar.update(step, f"loss {losses[-1]:.4f}")
    return losses, times


@torch.no_grad()
def evaluate(model, data, args, vocab, device, batches: int = 4) -> float:
    """Loss on held-out text: the same fixed global batches for every model."""
    gen = torch.Generator().manual_seed(args.seed + 2)
    total = 0.0
    for _ in range(batches):
        batch = rank_slice(sample_batch(gen, data, args.batch, args.ctx)).to(device)
        total += mean_over_ranks(next_char_loss(model, batch, vocab))
    return total / batches


def new_model(args, vocab: int, device, dtype) -> TinyGPT:
    torch.manual_seed(args.seed)  # every rank, every run: the same initial weights
    return TinyGPT(vocab, args.ctx).to(device=device, dtype=dtype)


def run_shardadam(args, data, held_out, vocab, device):
    model = new_model(args, vocab, device, torch.bfloat16 if args.bf16 else torch.float32)
    # No DDP wrapper: the optimizer broadcasts rank 0's parameters, reduce-scatters
    # each bucket of gradients as backward completes it, and all-gathers the new
    # parameters while the next forward runs (each module waits for its own).
    opt = shardadam.DistributedFusedAdam(param_groups(model, 0.1), lr=args.lr, bucket_cap_mb=args.bucket_cap_mb,
                                         overlap_grad_sync=True, overlap_param_sync=True,
                                         contiguous_param_buffer=True)
    # With overlap_grad_sync backward hands the gradients to the optimizer and
    # leaves .grad empty (torch.nn.utils.clip_grad_norm_ would see nothing to
    # clip): the optimizer computes the global norm and folds clipping into the step.
    losses, times = train_ranks("DistributedFusedAdam", model, opt, opt.clip_grad_norm, args, data, vocab, device)
    opt.param_sync()  # the last step's all-gathers may still be running
    return losses, times, evaluate(model, held_out, args, vocab, device)


def run_ddp(args, data, held_out, vocab, device):
    model = new_model(args, vocab, device, torch.float32)  # fp32: what the fp32 masters stand for
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=args.lr)
    losses, times = train_ranks("DDP + torch AdamW", ddp, opt,
                                lambda max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm),
                                args, data, vocab, device)
    return losses, times, evaluate(ddp, held_out, args, vocab, device)


def summarize(args, ours, theirs) -> None:
    """Rank 0: both curves side by side, the CSV and SVG files, the checks."""
    (ours_loss, ours_ms, ours_eval), (theirs_loss, theirs_ms, theirs_eval) = ours, theirs
    print(f"\n{'step':>7} {'DistributedFusedAdam':>21} {'DDP + AdamW':>12}   (mean loss since the previous row)")
    previous = 0
    for step in sorted({1, args.steps, *range(args.log_every, args.steps + 1, args.log_every)}):
        a = sum(ours_loss[previous:step]) / (step - previous)
        b = sum(theirs_loss[previous:step]) / (step - previous)
        print(f"{step:7d} {a:21.4f} {b:12.4f}")
        previous = step
    # The first steps include warm-up (allocations, first collectives).
    half = args.steps // 2
    print(f"{'ms/step':>7} {sum(ours_ms[half:]) / (args.steps - half):21.1f} "
          f"{sum(theirs_ms[half:]) / (args.steps - half):12.1f}   (second half of the run)")
    print(f"{'eval':>7} {ours_eval:21.4f} {theirs_eval:12.4f}   (held-out text)")

    args.out.mkdir(parents=True, exist_ok=True)
    csv_path, svg_path = args.out / "loss.csv", args.out / "loss.svg"
    write_loss_csv(csv_path, {"loss_shardadam": ours_loss, "loss_torch": theirs_loss,
                              "ms_per_step_shardadam": ours_ms, "ms_per_step_torch": theirs_ms})
    world = dist.get_world_size()
    write_loss_svg(svg_path, f"TinyGPT on Python source, {world} ranks ({dist.get_backend()}), "
                             f"{'bf16 + fp32 masters' if args.bf16 else 'fp32'}",
                   {"shardadam.DistributedFusedAdam": ours_loss, "DDP + torch.optim.AdamW": theirs_loss})
    print(f"wrote {csv_path} and {svg_path}")

    tail = max(1, args.steps // 10)
    a, b = sum(ours_loss[-tail:]) / tail, sum(theirs_loss[-tail:]) / tail
    tolerance = 0.05 if args.bf16 else 1e-3  # bf16 parameters round every update
    print(f"\nfinal loss (mean of last {tail} steps): DistributedFusedAdam {a:.4f}, DDP + AdamW {b:.4f}, "
          f"start {ours_loss[0]:.4f}; relative difference {abs(a - b) / b:.1e} (tolerance {tolerance:g})")
    if not a < 0.7 * ours_loss[0]:
        raise SystemExit("DistributedFusedAdam did not learn: the loss did not fall by 30%")
    if abs(a - b) > tolerance * b:
        raise SystemExit(f"DistributedFusedAdam and DDP + AdamW differ by more than {tolerance:g} (relative)")


def run_distributed(args, text: str) -> None:
    """DistributedFusedAdam against DDP + torch AdamW on every rank of the job."""
    device = init_distributed(args)
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        if args.batch % world:
            raise SystemExit(f"--batch {args.batch} must be a multiple of the {world} ranks")
        # Train on the first --chars characters; hold out the rest for evaluation.
        tokens, chars = encode(text)
        data, held_out = tokens[:args.chars], tokens[args.chars:]
        if rank == 0:
            print(f"shardadam {shardadam.__version__} {shardadam.build_info()}")
            print(f"corpus: {args.chars:,} characters of Python to train on, {held_out.numel():,} held out, "
                  f"vocabulary {len(chars)}; {world} ranks on {args.device} ({dist.get_backend()}), "
                  f"global batch {args.batch}, {'bf16 model + fp32 masters' if args.bf16 else 'fp32'}", flush=True)
        ours = run_shardadam(args, data, held_out, len(chars), device)
        theirs = run_ddp(args, data, held_out, len(chars), device)
        if rank == 0:
            summarize(args, ours, theirs)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16, help="the global batch under torchrun")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--bf16", action="store_true", help="bf16 model; the shardadam optimizer keeps fp32 master weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--chars", type=int, default=2_000_000)
    ap.add_argument("--bucket-cap-mb", type=float, default=0.25,
                    help="torchrun: DistributedFusedAdam's bucket size (small: the model spans several buckets)")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "out",
                    help="torchrun: where rank 0 writes loss.csv and loss.svg")
    args = ap.parse_args()
    if "WORLD_SIZE" in os.environ:  # started by torchrun
        run_distributed(args, corpus(args.chars + 200_000))
    else:
        run_single(args, corpus(args.chars))


if __name__ == "__main__":
    main()
