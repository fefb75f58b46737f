#!/usr/bin/env python
"""Bar charts of bench_distributed.py results: ms per iteration (labelled with
the ratio to DDP + fused AdamW, the ratio the benchmark is judged by) and peak
GPU memory, one bar per implementation, grouped by batch size per GPU.

Given several JSON files, an (implementation, batch) pair takes its figures
from the last file that has it; the caption names the file of every pair taken
from a later file than the first.

    python benchmarks/plot_distributed.py results/run3.json results/run4.json --out plot.svg
"""
from __future__ import annotations

import argparse
import json
import pathlib

from svg import COLORS, Canvas

COLORS = ("#7f7f7f",) + COLORS
PANEL_W, PANEL_H, TOP, BOTTOM, LEFT, GAP = 430, 300, 50, 40, 55, 30


def load(paths: list[str]) -> tuple[dict, dict, dict]:
    """(figures by (impl, batch), the file each came from, the first file's meta)."""
    rows, source, meta = {}, {}, None
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        meta = meta or data["meta"]
        for r in data["results"]:
            if r.get("error") is None:
                rows[(r["impl"], r["batch"])] = r
                source[(r["impl"], r["batch"])] = pathlib.Path(path).name
    return rows, source, meta


def panel(c: Canvas, x0: float, title: str, key: str, unit: str, rows: dict, impls: list, batches: list,
          ratio: bool) -> None:
    top = max(r[key] for r in rows.values()) * 1.15
    slot = (PANEL_W - LEFT) / len(batches)
    bar = slot * 0.8 / len(impls)
    y = lambda v: TOP + PANEL_H * (1 - v / top)  # noqa: E731
    c.text(x0 + LEFT + (PANEL_W - LEFT) / 2, TOP - 25, title, text_anchor="middle", font_weight="bold")
    c.line(x0 + LEFT, TOP + PANEL_H, x0 + PANEL_W, TOP + PANEL_H)
    c.line(x0 + LEFT, TOP, x0 + LEFT, TOP + PANEL_H)
    for i in range(6):
        c.text(x0 + LEFT - 5, y(top * i / 5) + 4, f"{top * i / 5:.0f}", text_anchor="end", font_size=11)
    mid = TOP + PANEL_H / 2
    c.text(x0 + 14, mid, unit, text_anchor="middle", transform=f"rotate(-90 {x0 + 14} {mid})")
    for b, batch in enumerate(batches):
        left = x0 + LEFT + b * slot + slot * 0.1
        c.text(left + slot * 0.4, TOP + PANEL_H + 18, f"batch {batch} per GPU", text_anchor="middle")
        base = rows.get(("ddp_fused", batch))
        for i, impl in enumerate(impls):
            r = rows.get((impl, batch))
            if r is None:
                continue
            x = left + i * bar
            c.rect(x, y(r[key]), bar * 0.9, TOP + PANEL_H - y(r[key]), COLORS[i % len(COLORS)])
            label = f"{r[key] / base[key]:.2f}" if ratio and base else f"{r[key]:.0f}"
            c.text(x + bar * 0.45, y(r[key]) - 3, label, text_anchor="middle", font_size=9)


def render(rows: dict, source: dict, meta: dict, first: str, path) -> None:
    impls = list(dict.fromkeys(impl for impl, _ in rows))
    batches = sorted({batch for _, batch in rows})
    legend_y = TOP + PANEL_H + BOTTOM
    later = sorted({f"{impl} (batch {batch}): {name}" for (impl, batch), name in source.items() if name != first})
    c = Canvas(2 * PANEL_W + GAP + 20, legend_y + 20 * len(impls) + 18 * (len(later) + 2) + 10)
    panel(c, 0, "ms per iteration (label: ratio to ddp_fused)", "ms", "ms", rows, impls, batches, True)
    panel(c, PANEL_W + GAP, "peak GPU memory", "peak_gib", "GiB", rows, impls, batches, False)
    caption_y = c.legend(LEFT, legend_y, [(COLORS[i % len(COLORS)], impl) for i, impl in enumerate(impls)]) + 15
    config = meta["config"]
    c.text(LEFT, caption_y, f"{meta['device']} x {meta['world_size']} ({meta['backend']}), torch {meta['torch']}, "
           f"GPT of {meta['params']:,} parameters (d_model {config['d_model']}, {config['layers']} layers, seq "
           f"{config['seq']}); {first}", font_size=11)
    for i, line in enumerate(later):
        c.text(LEFT, caption_y + 18 * (i + 1), f"from {line} (its ratio compares two runs)", font_size=11)
    c.write(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="bench_distributed.py --out files, earliest first")
    ap.add_argument("--out", required=True, help="the SVG file to write")
    args = ap.parse_args()
    rows, source, meta = load(args.results)
    render(rows, source, meta, pathlib.Path(args.results[0]).name, args.out)


if __name__ == "__main__":
    main()
