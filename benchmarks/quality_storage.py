#!/usr/bin/env python
"""Training quality of FusedAdam's storage kinds, side by side in one run.

Goal: each low-bit kind ends within 1% of fp32's final loss. Judged by "vs fp32": the final loss (mean of the last tenth
of the steps) over fp32's. The example GPT (examples/train.py) from the same seed on the same batches in each kind of
models.KINDS, and Muon (FusedMuon on the blocks' matrices, AdamW on the rest) against AdamW, each over --lr-scales;
curves as CSV and SVG.

    python benchmarks/quality_storage.py --kinds "fp32,FP8 states,FP8 exp_avg" --out results/quality_storage_cpu
    python benchmarks/quality_storage.py --kinds "fp32,Muon + AdamW" --lr-scales 0.5,1,2 --out results/quality_muon_cpu
    python benchmarks/quality_storage.py --device cuda --steps 2000 --out results/quality_storage_h200
"""
from __future__ import annotations

import argparse
import copy
import itertools
import pathlib
import sys

import torch

import shardadam
from harness import choose, md_table, run_meta, write_json
from models import KINDS

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from report import write_loss_csv, write_loss_svg  # noqa: E402
from train import corpus, encode, param_groups, train  # noqa: E402

MUON = "Muon + AdamW"  # FusedMuon: Muon on the blocks' matrices, AdamW (use_muon=False) on the rest


def muon_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Muon for the transformer blocks' matrices; embeddings, the head, norms and biases on AdamW (the usual split),
    matrices decayed, the rest not. Muon's lr is scaled to AdamW's update RMS ("match_rms_adamw"), so both parts follow
    one learning-rate schedule."""
    hidden = {n for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2}
    rest = [p for n, p in model.named_parameters() if n not in hidden]
    return [dict(params=[p for n, p in model.named_parameters() if n in hidden], weight_decay=weight_decay),
            dict(params=[p for p in rest if p.dim() >= 2], use_muon=False, weight_decay=weight_decay),
            dict(params=[p for p in rest if p.dim() < 2], use_muon=False, weight_decay=0.0)]


def add_kind_args(ap, default: str, known) -> None:
    ap.add_argument("--kinds", default=default, help="comma-separated subset of: " + ", ".join(known))
    ap.add_argument("--lr-scales", default="1", help="each kind at --lr times each of these (comma-separated; 1, "
                    "the kinds' own rows, among them)")


def runs_of(ap, args, known) -> list[tuple[str, str, argparse.Namespace]]:
    """(run name, kind, args with its learning rate) for each of --kinds (fp32, the reference, among them) at each
    of --lr-scales."""
    kinds, scales = choose(ap, args.kinds, known, "--kinds"), [float(s) for s in args.lr_scales.split(",")]
    if "fp32" not in kinds or 1 not in scales:
        ap.error("--kinds needs fp32 and --lr-scales 1 (the reference)")
    runs = []
    for kind, scale in itertools.product(kinds, scales):
        run_args = copy.copy(args)
        run_args.lr = args.lr * scale
        runs.append((kind if scale == 1 else f"{kind}, lr x{scale:g}", kind, run_args))
    return runs


def report(curves: dict, steps: int, where: str, columns: dict | None = None) -> dict:
    """Prints each kind's final loss (mean of the last tenth of the steps) and its ratio to fp32's, then `columns`
    (header: a cell per kind); returns the final losses."""
    tail = max(1, steps // 10)
    final = {name: sum(c[-tail:]) / tail for name, c in curves.items()}
    columns = columns or {}
    print(f"\nfinal loss (mean of the last {tail} steps), {steps} steps{where}:")
    print(md_table(["storage", "final loss", "vs fp32", *columns], [
        [name, f"{loss:.4f}", f"{loss / final['fp32'] - 1:+.2%}", *(c[i] for c in columns.values())]
        for i, (name, loss) in enumerate(final.items())]))
    return final


def write_curves(out: pathlib.Path, curves: dict, title: str, svg_curves: dict | None = None, **data) -> None:
    """<out>.csv, <out>.svg (svg_curves, default the curves) and <out>.json (data)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_loss_csv(out.with_suffix(".csv"), curves)
    write_loss_svg(out.with_suffix(".svg"), title, svg_curves or curves)
    write_json(out.with_suffix(".json"), indent=2, **data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chars", type=int, default=2_000_000)
    add_kind_args(ap, ",".join(KINDS), (*KINDS, MUON))
    ap.add_argument("--out", type=pathlib.Path, help="write <out>.csv, <out>.svg and <out>.json")
    args = ap.parse_args()
    args.log_every = max(1, args.steps // 6)
    data, chars = encode(corpus(args.chars))
    curves = {}
    for name, kind, run_args in runs_of(ap, args, (*KINDS, MUON)):
        if kind == MUON:
            curves[name] = train(name, lambda model, a=run_args: shardadam.FusedMuon(
                muon_groups(model, 0.1), lr=a.lr, adjust_lr_fn="match_rms_adamw"), run_args, data, len(chars),
                torch.float32)
            continue
        dtype, options = KINDS[kind]
        curves[name] = train(name, lambda model, a=run_args, o=options: shardadam.FusedAdam(
            param_groups(model, 0.1), lr=a.lr, **o), run_args, data, len(chars), dtype)
    final = report(curves, args.steps, f" on {args.device}")
    if args.out:
        write_curves(args.out, curves, f"example GPT, {args.steps} steps, FusedAdam storage kinds and Muon",
                     meta=run_meta(args.device, steps=args.steps), final=final)


if __name__ == "__main__":
    main()
