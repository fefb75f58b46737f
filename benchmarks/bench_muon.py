#!/usr/bin/env python
"""Goal: FusedMuon's step on GPT-1.4B shapes at least 1.3x faster than torch.optim.Muon + torch.optim.AdamW(fused=True),
its Newton-Schulz at least half the GPU's bf16 matmul rate, and the rest of its step (the element-wise passes) at 0.9 of
a device copy's bandwidth (judged: the step-time ratio, the Newton-Schulz TFLOP/s over the measured bf16 matmul TFLOP/s,
and the bytes the element-wise passes must move over the step's time with ns_steps=0, against a copy in the same run).

Matrices go to Muon, embeddings, head, biases and norms to AdamW. FLOPs per
Newton-Schulz iteration of an m x n matrix (m <= n): 4 m^2 n + 2 m^3.

    python benchmarks/bench_muon.py --out results/bench_muon_h200.json
    python benchmarks/bench_muon.py --layers 2 --steps 3      # smoke run (CUDA)
    python benchmarks/bench_muon.py --owners 2,4,8            # only the work split (CPU)

DistributedFusedMuon (--distributed: one NCCL rank, its reduce and gather included) is judged by its Newton-Schulz work
per rank against 1/N (goal: within 10%), from the owners its layout gives the same matrices at N ranks.
"""
from __future__ import annotations

import argparse
import os
from collections import Counter

import torch
import torch.distributed as dist

from bench_kernels import copy_gbs
from harness import md_table, run_meta, write_json
from shardadam import DistributedFusedMuon, FusedMuon
from shardadam._newton_schulz import newton_schulz_
from shardadam.distributed._muon_owners import plan_owner_buckets
from timing import capture_graph, median_ms

D_MODEL, FFN, VOCAB = 2048, 8192, 50304
NS_COEFFICIENTS, NS_STEPS = (3.4445, -4.775, 2.0315), 5


def gpt_params(layers: int, dtype: torch.dtype) -> tuple[list, list]:
    """(Muon's matrices, AdamW's other parameters) of a GPT-1.4B-shaped model, random."""
    def p(*shape):
        return torch.nn.Parameter(torch.randn(*shape, device="cuda", dtype=dtype) * 0.02)

    matrices, others = [], [p(VOCAB, D_MODEL), p(VOCAB, D_MODEL)]
    for _ in range(layers):
        matrices += [p(3 * D_MODEL, D_MODEL), p(D_MODEL, D_MODEL), p(FFN, D_MODEL), p(D_MODEL, FFN)]
        others += [p(3 * D_MODEL), p(D_MODEL), p(FFN), p(D_MODEL)] + [p(D_MODEL) for _ in range(4)]
    for q in matrices + others:
        q.grad = torch.randn_like(q) * 1e-3
    return matrices, others


def gpt_shapes(layers: int) -> list[tuple[int, int]]:
    return [(3 * D_MODEL, D_MODEL), (D_MODEL, D_MODEL), (FFN, D_MODEL), (D_MODEL, FFN)] * layers


def owner_shares(layers: int, world: int, bucket_cap_mb: float = 100) -> list[float]:
    """Each rank's share of the Newton-Schulz work at `world` ranks (1/N is even)."""
    shapes = gpt_shapes(layers)
    buckets = plan_owner_buckets(shapes, [torch.float32] * len(shapes), world, int(bucket_cap_mb * 2 ** 18))
    load = [0.0] * world
    for m in (m for b in buckets for m in b.matrices):
        load[m.owner] += ns_flops(Counter({(m.rows, m.cols): 1}))
    return [x / sum(load) for x in load]


def ns_flops(shapes: Counter) -> float:
    return sum(count * NS_STEPS * (4 * m * m * n + 2 * m ** 3) for (m, n), count in
               ((sorted(shape), count) for shape, count in shapes.items()))


def elementwise_bytes(layers: int, dtype: torch.dtype) -> float:
    """Bytes FusedMuon's element-wise passes must move, parameters and AdamW states of `dtype` (P bytes), bf16 NS. Muon,
    per element: the momentum pass reads gradient and momentum, writes momentum and the stacked bf16 input (3P + 2),
    the update pass reads the bf16 result, writes the parameter (2 + 2P); AdamW: param, states read, written, grad (7P)"""
    size = torch.empty((), dtype=dtype).element_size()
    muon = sum(rows * cols for rows, cols in gpt_shapes(layers))
    adamw = 2 * VOCAB * D_MODEL + layers * (3 * D_MODEL + 2 * D_MODEL + FFN + 4 * D_MODEL)
    return (5 * size + 4) * muon + 7 * size * adamw


def step_ms(build, layers: int, dtype, steps: int, graph: bool) -> float:
    torch.cuda.empty_cache()
    matrices, others = gpt_params(layers, dtype)
    opts = build(matrices, others)
    grads = [(q, q.grad) for q in matrices + others]

    def step():
        for q, g in grads:  # a distributed step hands the gradients over and lets go of them
            q.grad = g
        for o in opts:
            o.step()

    step()  # the state is allocated
    run = capture_graph(step, 1)[0].replay if graph else step
    return median_ms(run, torch.device("cuda"), steps, warmup=3)


def newton_schulz_ms(shapes: Counter, steps: int) -> float:
    stacks = [torch.randn(count, rows, cols, device="cuda", dtype=torch.bfloat16)
              for (rows, cols), count in shapes.items()]

    def run():
        for x in stacks:
            newton_schulz_(x, NS_COEFFICIENTS, NS_STEPS, 1e-7)

    return median_ms(run, torch.device("cuda"), steps, warmup=3)


def matmul_tflops(steps: int) -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192 ** 3 / median_ms(lambda: a @ b, torch.device("cuda"), steps, warmup=3) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the parameters' dtype")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per case")
    ap.add_argument("--distributed", action="store_true", help="also DistributedFusedMuon on one NCCL rank")
    ap.add_argument("--owners", default="", help="only print the Newton-Schulz share per rank at these world sizes")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    if args.owners:
        for world in map(int, args.owners.split(",")):
            shares = owner_shares(args.layers, world)
            print(f"{world} ranks: Newton-Schulz work per rank {min(shares):.4f}-{max(shares):.4f}, the largest "
                  f"{max(shares) * world:.3f}x of 1/N")
        return
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    adamw = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)

    def fused(capturable, ns_steps=NS_STEPS):
        return lambda m, o: [FusedMuon([dict(params=m), dict(params=o, use_muon=False, **adamw)], lr=0.02,
                                       ns_steps=ns_steps, capturable=capturable)]

    reference = step_ms(lambda m, o: [torch.optim.Muon(m, lr=0.02), torch.optim.AdamW(o, fused=True, **adamw)],
                        args.layers, dtype, args.steps, False)
    times = {"torch.optim.Muon + AdamW(fused=True)": reference,
             "FusedMuon": step_ms(fused(False), args.layers, dtype, args.steps, False),
             "FusedMuon, CUDA graph": step_ms(fused(True), args.layers, dtype, args.steps, True),
             "FusedMuon, ns_steps=0": step_ms(fused(False, 0), args.layers, dtype, args.steps, False)}
    if args.distributed:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1)
        times["DistributedFusedMuon, 1 rank"] = step_ms(
            lambda m, o: [DistributedFusedMuon([dict(params=m), dict(params=o, use_muon=False, **adamw)], lr=0.02)],
            args.layers, dtype, args.steps, False)
    shapes = Counter(gpt_shapes(args.layers))
    ns_ms, peak = newton_schulz_ms(shapes, args.steps), matmul_tflops(args.steps)
    ns_tflops = ns_flops(shapes) / ns_ms / 1e9
    copy, rest_ms = copy_gbs("cuda", 1 << 28, args.steps, 3), times["FusedMuon, ns_steps=0"]  # no matmul chain
    rest_of_copy = elementwise_bytes(args.layers, dtype) / rest_ms / 1e6 / copy
    ref = times["torch.optim.Muon + AdamW(fused=True)"]
    rows = [[name, f"{ms:.2f}", f"{ref / ms:.2f}x"] for name, ms in times.items()]
    print(md_table(["step", "ms", "speed-up over torch"], rows))
    print(f"Newton-Schulz alone: {ns_ms:.2f} ms, {ns_tflops:.0f} TFLOP/s = {ns_tflops / peak:.2f} of the "
          f"bf16 matmul's {peak:.0f} TFLOP/s; FusedMuon's step without it (ns_steps=0): "
          f"{rest_ms:.2f} ms ({rest_ms / ns_ms:.0%} on top), {elementwise_bytes(args.layers, dtype) / 1e9:.1f} GB "
          f"that its element-wise passes must move: {rest_of_copy:.2f} of copy ({copy:.0f} GB/s)")
    if args.out:
        write_json(args.out, meta=run_meta(torch.device("cuda"), config=vars(args)), step_ms=times,
                   newton_schulz_ms=ns_ms, newton_schulz_tflops=ns_tflops, bf16_matmul_tflops=peak,
                   rest_ms=rest_ms, copy_gbs=copy, rest_of_copy=rest_of_copy,
                   owner_shares={w: owner_shares(args.layers, w) for w in (2, 4, 8)})


if __name__ == "__main__":
    main()
