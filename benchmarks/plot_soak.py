#!/usr/bin/env python
"""Line charts of a soak.py result: memory against step, one line per rank.

One panel per metric the run recorded (host RSS, malloc'd bytes; GPU allocated
and reserved memory on CUDA). The warm-up that the flatness check leaves out is
shaded, checkpoint round trips are dotted vertical lines, and each rank's limit
is a dashed line in its colour: a rank passes if its line stays under it.

    python benchmarks/plot_soak.py benchmarks/results/soak_gloo.json --out soak_gloo.svg
"""
from __future__ import annotations

import argparse
import json
import pathlib

from svg import COLORS, Axes, Canvas

WIDTH, PANEL_H, TOP, LEFT, GAP = 760, 220, 40, 75, 70
MIB = 2**20
METRICS = (("rss", "host RSS"), ("malloc_in_use", "host malloc in use (not judged)"),
           ("gpu_allocated", "GPU allocated"), ("gpu_reserved", "GPU reserved"))


def panel(c: Canvas, y0: float, key: str, title: str, data: dict) -> None:
    ranks, verdicts = data["samples"], data["verdicts"]
    last_step = max(s["step"] for samples in ranks for s in samples)
    # a judged metric's limit line per rank (None: reported only, no line)
    limits = [None if v[key]["limit"] is None else (v[key]["base"] + v[key]["limit"]) / MIB for v in verdicts]
    values = [s[key] / MIB for samples in ranks for s in samples] + [m for m in limits if m is not None]
    c.text(LEFT, y0 - 10, f"{title} per rank (MiB)", font_weight="bold")
    ax = Axes(c, (LEFT, y0, WIDTH - LEFT - 20, PANEL_H), (0, last_step), values, xlabel="step")
    warm = verdicts[0][key]["base_step"]
    c.rect(LEFT, y0, ax.x(warm) - LEFT, PANEL_H, "#eeeeee", fill_opacity=0.6)
    c.text(LEFT + 4, y0 + 14, "warm-up", font_size=10, fill="#666")
    every = data["meta"]["config"]["checkpoint_every"]
    for step in range(every, last_step + 1, every):
        ax.vline(step, "#999", stroke_dasharray="1,3")
    for rank, (samples, limit) in enumerate(zip(ranks, limits)):
        color = COLORS[rank % len(COLORS)]
        ax.plot([s["step"] for s in samples], [s[key] / MIB for s in samples], color)
        if limit is not None:
            ax.hline(limit, color, x_from=warm, stroke_dasharray="6,4")


def write_svg(data: dict, path) -> None:
    meta, verdicts = data["meta"], data["verdicts"]
    keys = [(k, t) for k, t in METRICS if verdicts[0].get(k) is not None]
    legend_y = TOP + len(keys) * (PANEL_H + GAP)
    c = Canvas(WIDTH, legend_y + 20 * len(verdicts) + 50)
    for i, (key, title) in enumerate(keys):
        panel(c, TOP + i * (PANEL_H + GAP), key, title, data)
    caption_y = c.legend(LEFT, legend_y, [
        (COLORS[rank % len(COLORS)], f"rank {rank}: RSS {v['rss']['growth'] / MIB:+.2f} MiB after warm-up, slope "
         f"{v['rss']['slope']:+.1f} B/step, limit {v['rss']['limit'] / MIB:.1f} MiB (dashed); "
         f"{'flat' if v['ok'] else 'GROWS'}") for rank, v in enumerate(verdicts)]) + 15
    c.text(LEFT, caption_y, f"{meta['device']} x {meta['world_size']} ({meta['backend']}), torch {meta['torch']}, "
           f"{meta['params']:,} parameters in {meta['buckets']} buckets, {meta['config']['steps']} steps; dotted: "
           f"state_dict + load_state_dict; {meta['date'][:10]}", font_size=11)
    c.write(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", help="a soak.py --out file")
    ap.add_argument("--out", required=True, help="the SVG file to write")
    args = ap.parse_args()
    write_svg(json.loads(pathlib.Path(args.result).read_text()), args.out)


if __name__ == "__main__":
    main()
