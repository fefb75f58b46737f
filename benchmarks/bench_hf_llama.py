#!/usr/bin/env python
"""Hugging Face LlamaForCausalLM trained with DistributedFusedAdam, DDP and FSDP2, in one torchrun job.

Goal: DistributedFusedAdam trains a Hugging Face model as fast as DDP and FSDP2 with torch's fused AdamW, to the
same loss. Judged by tokens/s against DDP's, and the loss curves (svg.py draws them). A 1B Llama from its config,
trained from the same seed on the same batches of Python source bytes.

    torchrun --standalone --nproc_per_node 2 benchmarks/bench_hf_llama.py \\
        --out benchmarks/results/bench_hf_llama_2xh200.json
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_hf_llama.py --tiny --device cpu \\
        --out benchmarks/results/bench_hf_llama_cpu_tiny.json       # smoke run (gloo, tiny model)
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train import corpus  # noqa: E402

import shardadam  # noqa: E402
from harness import add_device_arg, choose, finish, init_distributed, run_meta, say  # noqa: E402
from models import fill_defaults  # noqa: E402
from timing import timed_calls  # noqa: E402

RUNS = ("shardadam", "ddp", "fsdp2")
OPTIM = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def llama_config(tiny: bool):
    from transformers import LlamaConfig
    sizes = (dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, vocab_size=512,
                  max_position_embeddings=256) if tiny else
             dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=18, num_attention_heads=16,
                  vocab_size=32000, max_position_embeddings=2048))
    return LlamaConfig(**sizes, num_key_value_heads=sizes["num_attention_heads"], tie_word_embeddings=False)


def build_model(config, device: torch.device):
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    with device:
        return LlamaForCausalLM(config).train()


def setup(run: str, model, device: torch.device, bucket_cap_mb: float):
    """(the module to call, the optimizer, clip(max_norm) -> norm) for one run."""
    if run == "shardadam":
        opt = shardadam.DistributedFusedAdam(model.parameters(), **OPTIM, bucket_cap_mb=bucket_cap_mb,
                                             overlap_grad_sync=True, overlap_param_sync=True,
                                             contiguous_param_buffer=True,
                                             store_params=False)  # fp32 parameters are their own masters
        return model, opt, opt.clip_grad_norm
    if run == "ddp":
        module = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                         bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)
    else:
        for layer in model.model.layers:
            fully_shard(layer)
        module = fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), **OPTIM, fused=True)
    return module, opt, partial(torch.nn.utils.clip_grad_norm_, list(model.parameters()))


def batches(tokens: torch.Tensor, steps: int, global_batch: int, seq: int, rank: int, world: int):
    """Step s's slice of this rank: the same windows for every run."""
    local = global_batch // world
    for s in range(steps):
        g = torch.Generator().manual_seed(1000 + s)
        starts = torch.randint(0, len(tokens) - seq - 1, (global_batch,), generator=g)[rank * local:(rank + 1) * local]
        yield torch.stack([tokens[i:i + seq] for i in starts.tolist()])


def train(run: str, args, config, tokens, rank: int, world: int, device: torch.device) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(config, device)
    module, opt, clip = setup(run, model, device, args.bucket_cap_mb)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext()
    data = batches(tokens, args.steps, args.global_batch, args.seq, rank, world)

    def step(_) -> torch.Tensor:
        ids = next(data).to(device, non_blocking=True)
        with autocast:
            loss = module(input_ids=ids, labels=ids).loss
        loss.backward()
        clip(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach().float()
    _, step_ms, losses = timed_calls(step, device, args.steps - args.warmup, args.warmup)
    if run == "shardadam":
        opt.param_sync()
    losses = torch.stack(losses)
    dist.all_reduce(losses)
    result = dict(tokens_per_s=args.global_batch * args.seq / step_ms * 1e3, step_ms=step_ms,
                  peak_memory_gib=(torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None),
                  losses=(losses / world).tolist())
    del module, opt, model, clip
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_arg(parser)
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama and 12 steps (smoke test)")
    parser.add_argument("--steps", type=int, help="default 200 (12 with --tiny)")
    parser.add_argument("--warmup", type=int, help="untimed first steps; default 10 (2 with --tiny)")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step over all ranks")
    parser.add_argument("--seq", type=int, help="tokens per sequence; default 2048 (64 with --tiny)")
    parser.add_argument("--bucket-cap-mb", type=float, default=100.0)
    parser.add_argument("--no-bf16", dest="bf16", action="store_false", help="fp32 forward (no autocast)")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    parser.add_argument("--out", default="benchmarks/results/bench_hf_llama.json")
    args = parser.parse_args()
    fill_defaults(args, dict(steps=200, warmup=10, seq=2048), tiny=dict(steps=12, warmup=2, seq=64))
    runs = choose(parser, args.runs, RUNS, "--runs")
    if args.device == "cpu":
        torch.set_num_threads(1)
    device, _ = init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        parser.error(f"--global-batch {args.global_batch} must be a multiple of the {world} ranks")
    config = llama_config(args.tiny)
    text = corpus(4_000_000 if not args.tiny else 200_000).encode("utf-8", errors="replace")
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    results = {}
    for run in runs:
        r = results[run] = train(run, args, config, tokens, rank, world, device)
        memory = f", peak {r['peak_memory_gib']:.1f} GiB" if r["peak_memory_gib"] is not None else ""
        say(f"{run:>9}: {r['tokens_per_s']:,.0f} tokens/s ({r['step_ms']:.1f} ms/step){memory}, "
            f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}")
    if "ddp" in results:
        say("tokens/s vs DDP: " + ", ".join(f"{run} {r['tokens_per_s'] / results['ddp']['tokens_per_s']:.3f}x"
                                            for run, r in results.items()))
    params = sum(p.numel() for p in build_model(config, torch.device("meta")).parameters())
    meta = run_meta(device, world=world, parameters=params, optimizer=OPTIM,
                    **{k: v for k, v in vars(args).items() if k not in ("device", "out")})
    say(f"wrote {args.out}")
    finish(args.out, meta=meta, runs=results)


if __name__ == "__main__":
    main()
