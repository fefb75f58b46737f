#!/usr/bin/env python
"""Training quality of FusedAdam's storage kinds, side by side in one run.

Goal: each low-bit kind ends within 1% of fp32's final loss. Judged by "vs
fp32": the final loss (mean of the last tenth of the steps) over fp32's.

The example GPT (examples/train.py: a small GPT learning Python source,
character by character) trained from the same seed on the same batches with
fp32 parameters (the reference), FP8 E4M3 exp_avg and exp_avg_sq, FP8 exp_avg
only, 8-bit blockwise states, bf16 parameters with fp32 masters, and bf16
parameters without a master rounded stochastically or to nearest; the loss
curves overlaid (CSV and SVG).

    python benchmarks/quality_storage.py --kinds "fp32,FP8 states,FP8 exp_avg" --out results/quality_storage_cpu
    python benchmarks/quality_storage.py --device cuda --steps 2000 --out results/quality_storage_h200
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch

import shardadam
from harness import md_table, run_meta, write_json

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
from report import write_loss_csv, write_loss_svg  # noqa: E402
from train import corpus, train  # noqa: E402

KINDS = {
    "fp32": (torch.float32, {}),
    "FP8 states": (torch.float32, dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)),
    "FP8 exp_avg": (torch.float32, dict(exp_avg_dtype=torch.uint8)),
    "8-bit blockwise states": (torch.float32, dict(exp_avg_dtype=shardadam.BLOCKWISE8,
                                                   exp_avg_sq_dtype=shardadam.BLOCKWISE8)),
    "bf16 + fp32 masters": (torch.bfloat16, dict(master_weights=True)),
    "bf16 stochastic rounding": (torch.bfloat16, dict(bf16_stochastic_round=True, stochastic_round_seed=0)),
    "bf16 round to nearest": (torch.bfloat16, {}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chars", type=int, default=2_000_000)
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of: " + ", ".join(KINDS))
    ap.add_argument("--out", type=pathlib.Path, help="write <out>.csv, <out>.svg and <out>.json")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or "fp32" not in kinds:
        ap.error(f"--kinds: unknown {unknown}, or fp32 (the reference) missing")
    args.log_every = max(1, args.steps // 6)
    text = corpus(args.chars)
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    curves = {}
    for name in kinds:
        dtype, options = KINDS[name]
        curves[name] = train(name, lambda groups, o=options: shardadam.FusedAdam(groups, lr=args.lr, **o), args,
                             data, len(chars), dtype)
    tail = max(1, args.steps // 10)
    final = {name: sum(c[-tail:]) / tail for name, c in curves.items()}
    print(f"\nfinal loss (mean of the last {tail} steps), {args.steps} steps on {args.device}:")
    print(md_table(["storage", "final loss", "vs fp32"],
                   [[name, f"{loss:.4f}", f"{loss / final['fp32'] - 1:+.2%}"] for name, loss in final.items()]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_loss_csv(args.out.with_suffix(".csv"), curves)
        write_loss_svg(args.out.with_suffix(".svg"), f"example GPT, {args.steps} steps, FusedAdam storage kinds",
                       curves)
        write_json(args.out.with_suffix(".json"), indent=2, meta=run_meta(args.device, steps=args.steps), final=final)


if __name__ == "__main__":
    main()
