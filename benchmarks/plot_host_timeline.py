#!/usr/bin/env python
"""The timeline of one iteration with optimizer state in host memory (SVG,
standard library only), from bench_host_state.py --timeline: a lane each for
the GPU's forward and backward, the gradient copies down, the CPU engine's
steps and the parameter copies up.

    python benchmarks/plot_host_timeline.py results/host_timeline_h200.json --out timeline.svg
"""
from __future__ import annotations

import argparse
import json
import pathlib
from xml.sax.saxutils import escape

LANES = [("compute", "GPU forward + backward", "#1f77b4"), ("down", "gradients down (PCIe)", "#ff7f0e"),
         ("cpu", "CPU step", "#2ca02c"), ("up", "parameters up (PCIe)", "#d62728")]
WIDTH, LEFT, TOP, LANE_H, GAP = 900, 190, 50, 34, 12


def render(data: dict) -> str:
    end = max([data["total_ms"]] + [e for spans in data["spans"].values() for _, e in spans])
    scale = (WIDTH - LEFT - 20) / end
    height = TOP + len(LANES) * (LANE_H + GAP) + 40
    m = data["model"]
    title = (f"One iteration, {data.get('optimizer', 'FusedAdam')}, state in host memory: GPT "
             f"{m['params'] / 1e9:.2f}B (d {m['d_model']}, {m['layers']} layers), batch {m['batch']} x {m['seq']}, "
             f"{data['kind']} states, {data['gpu']}, {data['date']}")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" '
           'font-size="12">', f'<text x="10" y="22" font-size="13">{escape(title)}</text>']
    for i, (key, label, color) in enumerate(LANES):
        y = TOP + i * (LANE_H + GAP)
        busy = sum(e - s for s, e in data["spans"][key])
        out.append(f'<text x="10" y="{y + LANE_H / 2 + 4}">{escape(label)}</text>')
        out.append(f'<text x="10" y="{y + LANE_H / 2 + 18}" fill="#555" font-size="10">busy {busy:.0f} ms</text>')
        out.append(f'<rect x="{LEFT}" y="{y}" width="{end * scale:.1f}" height="{LANE_H}" fill="#f2f2f2"/>')
        for s, e in data["spans"][key]:
            out.append(f'<rect x="{LEFT + s * scale:.2f}" y="{y}" width="{max((e - s) * scale, 0.5):.2f}" '
                       f'height="{LANE_H}" fill="{color}" fill-opacity="0.85"/>')
    axis_y = TOP + len(LANES) * (LANE_H + GAP)
    step = next(s for s in (10, 20, 50, 100, 200, 500, 1000) if end / s <= 12)
    for t in range(0, int(end) + 1, step):
        x = LEFT + t * scale
        out.append(f'<line x1="{x:.1f}" y1="{TOP - 4}" x2="{x:.1f}" y2="{axis_y}" stroke="#ccc"/>')
        out.append(f'<text x="{x:.1f}" y="{axis_y + 14}" text-anchor="middle">{t}</text>')
    out.append(f'<text x="{LEFT + (WIDTH - LEFT) / 2}" y="{axis_y + 32}" text-anchor="middle">ms from the start of '
               f'the iteration (total {data["total_ms"]:.0f} ms)</text>')
    out.append("</svg>")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("timeline")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    pathlib.Path(args.out).write_text(render(json.loads(pathlib.Path(args.timeline).read_text())))


if __name__ == "__main__":
    main()
