#!/usr/bin/env python
"""Bar charts (SVG, standard library only) of bench_distributed.py results.

Two panels, grouped by batch size per GPU: milliseconds per iteration and
peak GPU memory, one bar per implementation, with the ratio to DDP + fused
AdamW over each time bar. Given several JSON files, an (implementation,
batch) pair takes its figures from the last file that has it; the caption
names the file of every pair taken from a later file than the first.

    python benchmarks/plot_distributed.py results/run3.json results/run4.json --out plot.svg
"""
from __future__ import annotations

import argparse
import json
import pathlib
from xml.sax.saxutils import escape

COLORS = ["#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
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


def panel(x0: float, title: str, key: str, unit: str, rows: dict, impls: list, batches: list,
          ratio: bool) -> list[str]:
    top = max(rows[k][key] for k in rows) * 1.15
    slot = (PANEL_W - LEFT) / len(batches)
    bar = slot * 0.8 / len(impls)
    y = lambda v: TOP + PANEL_H * (1 - v / top)  # noqa: E731
    out = [f'<text x="{x0 + LEFT + (PANEL_W - LEFT) / 2}" y="{TOP - 25}" text-anchor="middle" '
           f'font-weight="bold">{escape(title)}</text>',
           f'<line x1="{x0 + LEFT}" y1="{TOP + PANEL_H}" x2="{x0 + PANEL_W}" y2="{TOP + PANEL_H}" stroke="black"/>',
           f'<line x1="{x0 + LEFT}" y1="{TOP}" x2="{x0 + LEFT}" y2="{TOP + PANEL_H}" stroke="black"/>']
    for i in range(6):
        v = top * i / 5
        out.append(f'<text x="{x0 + LEFT - 5}" y="{y(v) + 4}" text-anchor="end" font-size="11">{v:.0f}</text>')
    out.append(f'<text x="{x0 + 14}" y="{TOP + PANEL_H / 2}" text-anchor="middle" font-size="12" '
               f'transform="rotate(-90 {x0 + 14} {TOP + PANEL_H / 2})">{escape(unit)}</text>')
    for b, batch in enumerate(batches):
        left = x0 + LEFT + b * slot + slot * 0.1
        out.append(f'<text x="{left + slot * 0.4}" y="{TOP + PANEL_H + 18}" text-anchor="middle" '
                   f'font-size="12">batch {batch} per GPU</text>')
        base = rows.get(("ddp_fused", batch))
        for i, impl in enumerate(impls):
            r = rows.get((impl, batch))
            if r is None:
                continue
            x = left + i * bar
            out.append(f'<rect x="{x:.1f}" y="{y(r[key]):.1f}" width="{bar * 0.9:.1f}" '
                       f'height="{TOP + PANEL_H - y(r[key]):.1f}" fill="{COLORS[i % len(COLORS)]}"/>')
            label = f"{r[key] / base[key]:.2f}" if ratio and base else f"{r[key]:.0f}"
            out.append(f'<text x="{x + bar * 0.45:.1f}" y="{y(r[key]) - 3:.1f}" text-anchor="middle" '
                       f'font-size="9">{label}</text>')
    return out


def render(rows: dict, source: dict, meta: dict, first: str) -> str:
    impls = list(dict.fromkeys(impl for impl, _ in rows))
    batches = sorted({batch for _, batch in rows})
    width = 2 * PANEL_W + GAP + 20
    legend_y = TOP + PANEL_H + BOTTOM
    later = sorted({f"{impl} (batch {batch}): {name}" for (impl, batch), name in source.items() if name != first})
    height = legend_y + 20 * len(impls) + 18 * (len(later) + 2) + 10
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    svg += panel(0, "ms per iteration (label: ratio to ddp_fused)", "ms", "ms", rows, impls, batches, True)
    svg += panel(PANEL_W + GAP, "peak GPU memory", "peak_gib", "GiB", rows, impls, batches, False)
    for i, impl in enumerate(impls):
        svg.append(f'<rect x="{LEFT}" y="{legend_y + 20 * i}" width="12" height="12" '
                   f'fill="{COLORS[i % len(COLORS)]}"/>')
        svg.append(f'<text x="{LEFT + 18}" y="{legend_y + 20 * i + 11}" font-size="12">{escape(impl)}</text>')
    caption_y = legend_y + 20 * len(impls) + 15
    config = meta["config"]
    svg.append(f'<text x="{LEFT}" y="{caption_y}" font-size="11">{escape(meta["device"])} x {meta["world_size"]} '
               f'({escape(meta["backend"])}), torch {escape(meta["torch"])}, GPT of {meta["params"]:,} parameters '
               f'(d_model {config["d_model"]}, {config["layers"]} layers, seq {config["seq"]}); '
               f'{escape(first)}</text>')
    for i, line in enumerate(later):
        svg.append(f'<text x="{LEFT}" y="{caption_y + 18 * (i + 1)}" font-size="11">from {escape(line)} '
                   f'(its ratio compares two runs)</text>')
    svg.append("</svg>")
    return "\n".join(svg) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="bench_distributed.py --out files, earliest first")
    ap.add_argument("--out", required=True, help="the SVG file to write")
    args = ap.parse_args()
    rows, source, meta = load(args.results)
    pathlib.Path(args.out).write_text(render(rows, source, meta, pathlib.Path(args.results[0]).name))


if __name__ == "__main__":
    main()
