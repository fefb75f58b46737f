#!/usr/bin/env python
"""Line charts (SVG, standard library only) of a soak.py result: memory against step, one line per rank.

One panel per metric the run recorded (host RSS; GPU allocated and reserved
memory on CUDA). The warm-up that the flatness check leaves out is shaded,
checkpoint round trips are dotted vertical lines, and each rank's limit
(its level after the warm-up plus the allowed growth) is a dashed line in
its colour: a rank passes if its line stays under its dashed line. malloc'd
bytes (glibc) are drawn where recorded, to tell a leak from allocator layout.

    python benchmarks/plot_soak.py benchmarks/results/soak_gloo.json --out soak_gloo.svg
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
from xml.sax.saxutils import escape

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
PANEL_W, PANEL_H, TOP, LEFT, RIGHT, GAP = 760, 220, 40, 75, 20, 70
MIB = 2**20
METRICS = (("rss", "host RSS"), ("malloc_in_use", "host malloc in use (not judged)"),
           ("gpu_allocated", "GPU allocated"), ("gpu_reserved", "GPU reserved"))


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round values (1, 2 or 5 times a power of ten apart) from below lo to above hi."""
    raw = (hi - lo) / count or 1.0
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first, last = math.floor(lo / step), max(math.ceil(hi / step), math.floor(lo / step) + 1)
    return [i * step for i in range(first, last + 1)]


def panel(y0: float, key: str, title: str, data: dict) -> list[str]:
    """One metric, every rank, in MiB; the panel's top edge at y0."""
    ranks, verdicts, meta = data["samples"], data["verdicts"], data["meta"]
    last_step = max(s["step"] for samples in ranks for s in samples)
    values = [s[key] / MIB for samples in ranks for s in samples]
    # a judged metric's limit line per rank (None: reported only, no line)
    limits = [None if v[key]["limit"] is None else (v[key]["base"] + v[key]["limit"]) / MIB for v in verdicts]
    ticks = nice_ticks(min(values), max(values + [m for m in limits if m is not None]))
    lo, hi = ticks[0], ticks[-1]
    x = lambda step: LEFT + (PANEL_W - LEFT - RIGHT) * step / last_step  # noqa: E731
    y = lambda mib: y0 + PANEL_H * (1 - (mib - lo) / (hi - lo))  # noqa: E731
    warm = verdicts[0][key]["base_step"]
    out = [f'<text x="{LEFT}" y="{y0 - 10}" font-weight="bold">{escape(title)} per rank (MiB)</text>',
           f'<rect x="{LEFT}" y="{y0}" width="{x(warm) - LEFT:.1f}" height="{PANEL_H}" fill="#eeeeee"/>',
           f'<text x="{LEFT + 4}" y="{y0 + 14}" font-size="10" fill="#666">warm-up</text>']
    every = meta["config"]["checkpoint_every"]
    for step in range(every, last_step + 1, every):
        out.append(f'<line x1="{x(step):.1f}" y1="{y0}" x2="{x(step):.1f}" y2="{y0 + PANEL_H}" stroke="#999" '
                   f'stroke-dasharray="1,3"/>')
    for v in ticks:
        out.append(f'<line x1="{LEFT}" y1="{y(v):.1f}" x2="{PANEL_W - RIGHT}" y2="{y(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 5}" y="{y(v) + 4:.1f}" text-anchor="end" font-size="11">{v:g}</text>')
    for step in nice_ticks(0, last_step, 8):
        if step <= last_step:  # the last round value may lie past the end
            out.append(f'<text x="{x(step):.1f}" y="{y0 + PANEL_H + 15}" text-anchor="middle" '
                       f'font-size="11">{step:g}</text>')
    out += [f'<line x1="{LEFT}" y1="{y0 + PANEL_H}" x2="{PANEL_W - RIGHT}" y2="{y0 + PANEL_H}" stroke="black"/>',
            f'<line x1="{LEFT}" y1="{y0}" x2="{LEFT}" y2="{y0 + PANEL_H}" stroke="black"/>',
            f'<text x="{(LEFT + PANEL_W) / 2}" y="{y0 + PANEL_H + 32}" text-anchor="middle" font-size="12">step</text>']
    for rank, (samples, limit) in enumerate(zip(ranks, limits)):
        color = COLORS[rank % len(COLORS)]
        points = " ".join(f"{x(s['step']):.1f},{y(s[key] / MIB):.1f}" for s in samples)
        out.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        if limit is not None:
            out.append(f'<line x1="{x(warm):.1f}" y1="{y(limit):.1f}" x2="{PANEL_W - RIGHT}" '
                       f'y2="{y(limit):.1f}" stroke="{color}" stroke-dasharray="6,4"/>')
    return out


def render(data: dict) -> str:
    meta, verdicts = data["meta"], data["verdicts"]
    keys = [(k, t) for k, t in METRICS if verdicts[0].get(k) is not None]
    legend_y = TOP + len(keys) * (PANEL_H + GAP)
    height = legend_y + 20 * len(verdicts) + 50
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{PANEL_W}" height="{height}" font-family="sans-serif">',
           f'<rect width="{PANEL_W}" height="{height}" fill="white"/>']
    for i, (key, title) in enumerate(keys):
        svg += panel(TOP + i * (PANEL_H + GAP), key, title, data)
    for rank, v in enumerate(verdicts):
        r = v["rss"]
        svg.append(f'<rect x="{LEFT}" y="{legend_y + 20 * rank}" width="12" height="12" '
                   f'fill="{COLORS[rank % len(COLORS)]}"/>')
        svg.append(f'<text x="{LEFT + 18}" y="{legend_y + 20 * rank + 11}" font-size="12">rank {rank}: RSS '
                   f'{r["growth"] / MIB:+.2f} MiB after warm-up, slope {r["slope"]:+.1f} B/step, '
                   f'limit {r["limit"] / MIB:.1f} MiB (dashed); {"flat" if v["ok"] else "GROWS"}</text>')
    caption_y = legend_y + 20 * len(verdicts) + 15
    svg.append(f'<text x="{LEFT}" y="{caption_y}" font-size="11">{escape(meta["device"])} x {meta["world_size"]} '
               f'({escape(meta["backend"])}), torch {escape(meta["torch"])}, {meta["params"]:,} parameters in '
               f'{meta["buckets"]} buckets, {meta["config"]["steps"]} steps; dotted: state_dict + load_state_dict; '
               f'{escape(meta["date"][:10])}</text>')
    svg.append("</svg>")
    return "\n".join(svg) + "\n"


def write_svg(data: dict, path) -> None:
    pathlib.Path(path).write_text(render(data))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", help="a soak.py --out file")
    ap.add_argument("--out", required=True, help="the SVG file to write")
    args = ap.parse_args()
    write_svg(json.loads(pathlib.Path(args.result).read_text()), args.out)


if __name__ == "__main__":
    main()
