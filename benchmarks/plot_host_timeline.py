#!/usr/bin/env python
"""The timeline of one iteration with optimizer state in host memory, from
bench_host_state.py --timeline: a lane each for the GPU's forward and backward,
the gradient copies down, the CPU engine's steps and the parameter copies up.

    python benchmarks/plot_host_timeline.py results/host_timeline_distributed_h200.json --out timeline.svg
"""
from __future__ import annotations

import argparse
import json
import pathlib

from svg import Canvas

LANES = [("compute", "GPU forward + backward", "#1f77b4"), ("down", "gradients down (PCIe)", "#ff7f0e"),
         ("cpu", "CPU step", "#2ca02c"), ("up", "parameters up (PCIe)", "#d62728")]
WIDTH, LEFT, TOP, LANE_H, GAP = 900, 190, 50, 34, 12


def render(data: dict, path) -> None:
    end = max([data["total_ms"]] + [e for spans in data["spans"].values() for _, e in spans])
    scale = (WIDTH - LEFT - 20) / end
    axis_y = TOP + len(LANES) * (LANE_H + GAP)
    m = data["model"]
    c = Canvas(WIDTH, axis_y + 40)
    c.text(10, 22, f"One iteration, {data.get('optimizer', 'FusedAdam')}, state in host memory: GPT "
           f"{m['params'] / 1e9:.2f}B (d {m['d_model']}, {m['layers']} layers), batch {m['batch']} x {m['seq']}, "
           f"{data['kind']} states, {data['gpu']}, {data['date']}", font_size=13)
    for i, (key, label, color) in enumerate(LANES):
        y = TOP + i * (LANE_H + GAP)
        c.text(10, y + LANE_H / 2 + 4, label)
        c.text(10, y + LANE_H / 2 + 18, f"busy {sum(e - s for s, e in data['spans'][key]):.0f} ms", fill="#555",
               font_size=10)
        c.rect(LEFT, y, end * scale, LANE_H, "#f2f2f2")
        for s, e in data["spans"][key]:
            c.rect(LEFT + s * scale, y, max((e - s) * scale, 0.5), LANE_H, color, fill_opacity=0.85)
    step = next(s for s in (10, 20, 50, 100, 200, 500, 1000) if end / s <= 12)
    for t in range(0, int(end) + 1, step):
        c.line(LEFT + t * scale, TOP - 4, LEFT + t * scale, axis_y, stroke="#ccc")
        c.text(LEFT + t * scale, axis_y + 14, t, text_anchor="middle")
    c.text(LEFT + (WIDTH - LEFT) / 2, axis_y + 32, f"ms from the start of the iteration (total "
           f"{data['total_ms']:.0f} ms)", text_anchor="middle")
    c.write(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timeline")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    render(json.loads(pathlib.Path(args.timeline).read_text()), args.out)


if __name__ == "__main__":
    main()
