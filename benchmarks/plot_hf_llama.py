#!/usr/bin/env python
"""The loss curves of bench_hf_llama.py's runs, with their tokens/s and peak
memory, as one SVG next to the JSON.

    python benchmarks/plot_hf_llama.py benchmarks/results/bench_hf_llama_2xh200.json
"""
from __future__ import annotations

import json
import pathlib
import sys

from svg import Axes, Canvas

COLORS = {"shardadam": "#d62728", "ddp": "#1f77b4", "fsdp2": "#2ca02c"}
LEFT, TOP, PLOT_W, PLOT_H = 80, 50, 640, 300


def render(data: dict, path) -> None:
    runs, meta = data["runs"], data["meta"]
    steps = max(len(r["losses"]) for r in runs.values())
    size = f"{meta['parameters'] / 1e9:.2f}B" if meta["parameters"] >= 1e8 else f"{meta['parameters'] / 1e6:.2f}M"
    c = Canvas(760, TOP + PLOT_H + 60 + 20 * len(runs))
    c.text(LEFT, 24, f"LlamaForCausalLM {size}, {meta['world']} x {meta['device']}, "
           f"{'bf16 autocast, ' if meta['bf16'] else ''}{meta['global_batch']} x {meta['seq']} tokens/step",
           font_size=14)
    ax = Axes(c, (LEFT, TOP, PLOT_W, PLOT_H), (0, steps - 1), [v for r in runs.values() for v in r["losses"]],
              xlabel="step", ylabel="loss")
    for k, (name, r) in enumerate(runs.items()):
        color = COLORS.get(name, "black")
        ax.plot(range(len(r["losses"])), r["losses"], color, opacity=0.8)
        memory = f", peak {r['peak_memory_gib']:.1f} GiB" if r.get("peak_memory_gib") is not None else ""
        c.text(LEFT, TOP + PLOT_H + 54 + 20 * k, f"{name}: {r['tokens_per_s']:,.0f} tokens/s ({r['step_ms']:.1f} "
               f"ms/step){memory}, final loss {r['losses'][-1]:.4f}", fill=color)
    c.write(path)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    path = pathlib.Path(sys.argv[1])
    render(json.loads(path.read_text()), path.with_suffix(".svg"))
    print(f"wrote {path.with_suffix('.svg')}")


if __name__ == "__main__":
    main()
