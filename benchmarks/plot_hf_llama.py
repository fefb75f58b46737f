#!/usr/bin/env python
"""The loss curves of bench_hf_llama.py's runs, with their tokens/s and peak
memory, as one SVG next to the JSON (no plotting library needed).

    python benchmarks/plot_hf_llama.py benchmarks/results/bench_hf_llama_2xh200.json
"""
from __future__ import annotations

import json
import pathlib
import sys

COLORS = {"shardadam": "#d62728", "ddp": "#1f77b4", "fsdp2": "#2ca02c"}
W, H, LEFT, TOP, PLOT_W, PLOT_H = 760, 470, 70, 50, 640, 300


def render(data: dict) -> str:
    runs, meta = data["runs"], data["meta"]
    losses = [v for r in runs.values() for v in r["losses"]]
    lo, hi = min(losses), max(losses)
    steps = max(len(r["losses"]) for r in runs.values())

    def point(i: int, v: float) -> str:
        x = LEFT + PLOT_W * i / max(1, steps - 1)
        y = TOP + PLOT_H * (hi - v) / max(hi - lo, 1e-9)
        return f"{x:.1f},{y:.1f}"

    size = f"{meta['parameters'] / 1e9:.2f}B" if meta["parameters"] >= 1e8 else f"{meta['parameters'] / 1e6:.2f}M"
    title = (f"LlamaForCausalLM {size}, {meta['world']} x {meta['device']}, "
             f"{'bf16 autocast, ' if meta['bf16'] else ''}{meta['global_batch']} x {meta['seq']} tokens/step")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="12"><rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{LEFT}" y="24" font-size="14">{title}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{PLOT_W}" height="{PLOT_H}" fill="none" stroke="#999"/>',
           f'<text x="{LEFT - 8}" y="{TOP + 4}" text-anchor="end">{hi:.2f}</text>',
           f'<text x="{LEFT - 8}" y="{TOP + PLOT_H}" text-anchor="end">{lo:.2f}</text>',
           f'<text x="{LEFT}" y="{TOP + PLOT_H + 16}">step 0</text>',
           f'<text x="{LEFT + PLOT_W}" y="{TOP + PLOT_H + 16}" text-anchor="end">step {steps - 1}</text>',
           f'<text x="16" y="{TOP + PLOT_H / 2}" transform="rotate(-90 16 {TOP + PLOT_H / 2})">loss</text>']
    for k, (name, r) in enumerate(runs.items()):
        color = COLORS.get(name, "black")
        points = " ".join(point(i, v) for i, v in enumerate(r["losses"]))
        out.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.5" opacity="0.8"/>')
        memory = f", peak {r['peak_memory_gib']:.1f} GiB" if r.get("peak_memory_gib") is not None else ""
        out.append(f'<text x="{LEFT}" y="{TOP + PLOT_H + 44 + 20 * k}" fill="{color}">{name}: '
                   f'{r["tokens_per_s"]:,.0f} tokens/s ({r["step_ms"]:.1f} ms/step){memory}, final loss '
                   f'{r["losses"][-1]:.4f}</text>')
    out.append("</svg>")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    path = pathlib.Path(sys.argv[1])
    svg = path.with_suffix(".svg")
    svg.write_text(render(json.loads(path.read_text())))
    print(f"wrote {svg}")


if __name__ == "__main__":
    main()
