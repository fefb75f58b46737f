#!/usr/bin/env python
"""Plots for the benchmarks as self-contained SVG files (standard library only: the benchmark machines need no
plotting package), a chart per result picked by what the JSON holds: bench_distributed.py's ms per iteration
(labelled with the ratio to DDP + fused AdamW) and peak memory; bench_kernels.py's GB/s; soak.py's memory against
step per rank; bench_host_state.py --timeline's lanes; bench_hf_llama.py's losses (as examples/report.py draws them).

    python benchmarks/svg.py results/run3.json --out plot.svg
    python benchmarks/svg.py benchmarks/results/bench_hf_llama_2xh200.json   # writes the .svg beside it
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from xml.sax.saxutils import escape

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from report import nice_ticks, write_loss_svg  # noqa: E402  (the example's loss curves, drawn the same way)

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _attrs(attrs: dict) -> str:
    return "".join(f' {k.rstrip("_").replace("_", "-")}="{v:.1f}"' if isinstance(v, float)
                   else f' {k.rstrip("_").replace("_", "-")}="{v}"' for k, v in attrs.items())


class Canvas:
    """An SVG document built element by element; attribute names take underscores for dashes (stroke_dasharray)."""

    def __init__(self, width: float, height: float, font_size: int = 12):
        self.width, self.height = width, height
        self.parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                      f'font-family="sans-serif" font-size="{font_size}">',
                      f'<rect width="{width}" height="{height}" fill="white"/>']

    def add(self, tag: str, **attrs) -> None:
        self.parts.append(f"<{tag}{_attrs(attrs)}/>")

    def text(self, x: float, y: float, s: str, **attrs) -> None:
        self.parts.append(f"<text{_attrs(dict(x=x, y=y, **attrs))}>{escape(str(s))}</text>")

    def line(self, x1, y1, x2, y2, stroke="black", **attrs) -> None:
        self.add("line", x1=x1, y1=y1, x2=x2, y2=y2, stroke=stroke, **attrs)

    def rect(self, x, y, width, height, fill, **attrs) -> None:
        self.add("rect", x=x, y=y, width=width, height=height, fill=fill, **attrs)

    def legend(self, x: float, y: float, entries: list[tuple[str, str]], dy: float = 20) -> float:
        """A colour swatch and a label per entry, one under the other; returns the y below them."""
        for i, (color, label) in enumerate(entries):
            self.rect(x, y + dy * i, 12, 12, color)
            self.text(x + 18, y + dy * i + 11, label)
        return y + dy * len(entries)

    def write(self, path) -> None:
        pathlib.Path(path).write_text("\n".join(self.parts + ["</svg>"]) + "\n")


MIB = 2**20


def machine(meta: dict) -> str:
    return f"{meta['device']} x {meta['world_size']} ({meta['backend']}), torch {meta['torch']}"


def bars(c: Canvas, box: tuple, title: str, key: str, unit: str, rows: dict, impls: list, groups: list,
         colors: tuple, ratio_to: str | None = None, label=lambda batch: f"batch {batch} per GPU") -> None:
    """A bar per (implementation, group) of rows[(impl, group)][key], grouped by group; labelled with the value, or
    with ratio_to its ratio to that implementation's bar of the same group."""
    x0, y0, w, h = box
    top = max(r[key] for r in rows.values()) * 1.15
    slot = w / len(groups)
    bar = slot * 0.8 / len(impls)
    y = lambda v: y0 + h * (1 - v / top)  # noqa: E731
    c.text(x0 + w / 2, y0 - 25, title, text_anchor="middle", font_weight="bold")
    c.add("path", d=f"M{x0},{y0} V{y0 + h} H{x0 + w}", fill="none", stroke="black")
    for i in range(6):
        c.text(x0 - 5, y(top * i / 5) + 4, f"{top * i / 5:.0f}", text_anchor="end", font_size=11)
    mid = y0 + h / 2
    c.text(x0 - 41, mid, unit, text_anchor="middle", transform=f"rotate(-90 {x0 - 41} {mid})")
    for b, group in enumerate(groups):
        left = x0 + b * slot + slot * 0.1
        c.text(left + slot * 0.4, y0 + h + 18, label(group), text_anchor="middle")
        base = rows.get((ratio_to, group))
        for i, impl in enumerate(impls):
            if (r := rows.get((impl, group))) is not None:
                c.rect(left + i * bar, y(r[key]), bar * 0.9, y0 + h - y(r[key]), colors[i % len(colors)])
                text = f"{r[key] / base[key]:.2f}" if base else f"{r[key]:.0f}"
                c.text(left + (i + 0.45) * bar, y(r[key]) - 3, text, text_anchor="middle", font_size=9)


def kernels_svg(data: dict, path) -> None:
    """bench_kernels.py's effective GB/s per case and implementation, the copy's beside them."""
    cases, meta = data["cases"], data["meta"]
    rows = {(r["impl"], c["case"]): r for c in cases for r in c["rows"]}
    rows.update({("copy", c["case"]): {"gbs": c["copy_gbs"]} for c in cases})
    impls = list(dict.fromkeys(impl for impl, _ in rows))
    c = Canvas(120 + 230 * len(cases), 400 + 20 * len(impls))
    bars(c, (70, 50, c.width - 90, 300), f"shardadam {meta['shardadam']} vs torch {meta['torch']} AdamW", "gbs",
         "GB/s (28 B/element; copy: read + write)", rows, impls, [c["case"] for c in cases], COLORS, label=str)
    c.legend(70, 390, [(COLORS[i % len(COLORS)], impl) for i, impl in enumerate(impls)])
    c.write(path)


def distributed_svg(data: dict, path) -> None:
    """bench_distributed.py's results: ms per iteration and peak GPU memory."""
    rows = {(r["impl"], r["batch"]): r for r in data["results"] if r.get("error") is None}
    impls, batches = list(dict.fromkeys(impl for impl, _ in rows)), sorted({batch for _, batch in rows})
    panel_w, panel_h, top, left = 430, 300, 50, 55
    legend_y = top + panel_h + 40
    c = Canvas(2 * panel_w + 50, legend_y + 20 * len(impls) + 18 * 2 + 10)
    colors = ("#7f7f7f",) + COLORS
    bars(c, (left, top, panel_w - left, panel_h), "ms per iteration (label: ratio to ddp_fused)", "ms", "ms", rows,
         impls, batches, colors, ratio_to="ddp_fused")
    bars(c, (panel_w + 30 + left, top, panel_w - left, panel_h), "peak GPU memory", "peak_gib", "GiB", rows, impls,
         batches, colors)
    caption_y = c.legend(left, legend_y, [(colors[i % len(colors)], impl) for i, impl in enumerate(impls)]) + 15
    meta, config = data["meta"], data["meta"]["config"]
    c.text(left, caption_y, f"{machine(meta)}, GPT of {meta['params']:,} parameters (d_model {config['d_model']}, "
           f"{config['layers']} layers, seq {config['seq']}); {pathlib.Path(data['path']).name}", font_size=11)
    c.write(path)


SOAK_METRICS = (("rss", "host RSS"), ("malloc_in_use", "host malloc in use (not judged)"),
                ("gpu_allocated", "GPU allocated"), ("gpu_reserved", "GPU reserved"))


def soak_svg(data: dict, path) -> None:
    """soak.py's samples: memory against step, one line per rank, a panel per metric the run recorded."""
    meta, ranks, verdicts = data["meta"], data["samples"], data["verdicts"]
    width, panel_h, top, left, gap = 760, 220, 40, 75, 70
    keys = [(k, t) for k, t in SOAK_METRICS if verdicts[0].get(k) is not None]
    last_step = max(s["step"] for samples in ranks for s in samples)
    legend_y = top + len(keys) * (panel_h + gap)
    c, w = Canvas(width, legend_y + 20 * len(verdicts) + 50), width - left - 20

    def x(step: float) -> float:
        return left + w * step / (last_step or 1)
    for i, (key, title) in enumerate(keys):
        y0 = top + i * (panel_h + gap)
        # a judged metric's limit line per rank (None: reported only, no line)
        limits = [None if v[key]["limit"] is None else (v[key]["base"] + v[key]["limit"]) / MIB for v in verdicts]
        values = [s[key] / MIB for samples in ranks for s in samples] + [m for m in limits if m is not None]
        c.text(left, y0 - 10, f"{title} per rank (MiB)", font_weight="bold")
        yticks = nice_ticks(min(values), max(values))  # the y range rounded out to ticks

        def y(v: float) -> float:
            return y0 + panel_h * (1 - (v - yticks[0]) / ((yticks[-1] - yticks[0]) or 1))
        for v in yticks:
            c.line(left, y(v), left + w, y(v), stroke="#ddd")
            c.text(left - 5, y(v) + 4, f"{v:g}", text_anchor="end", font_size=11)
        for v in (v for v in nice_ticks(0, last_step, 8) if v <= last_step):
            c.text(x(v), y0 + panel_h + 15, f"{v:g}", text_anchor="middle", font_size=11)
        c.add("path", d=f"M{left},{y0} V{y0 + panel_h} H{left + w}", fill="none", stroke="black")
        c.text(left + w / 2, y0 + panel_h + 32, "step", text_anchor="middle")
        warm = verdicts[0][key]["base_step"]
        c.rect(left, y0, x(warm) - left, panel_h, "#eeeeee", fill_opacity=0.6)
        c.text(left + 4, y0 + 14, "warm-up", font_size=10, fill="#666")
        every = meta["config"]["checkpoint_every"]
        for step in range(every, last_step + 1, every):
            c.line(x(step), y0, x(step), y0 + panel_h, stroke="#999", stroke_dasharray="1,3")
        for rank, (samples, limit) in enumerate(zip(ranks, limits)):
            c.add("polyline", points=" ".join(f"{x(s['step']):.1f},{y(s[key] / MIB):.1f}" for s in samples),
                  fill="none", stroke=COLORS[rank % len(COLORS)], stroke_width=1.5)
            if limit is not None:
                c.line(x(warm), y(limit), left + w, y(limit), stroke=COLORS[rank % len(COLORS)], stroke_dasharray="6,4")
    caption_y = c.legend(left, legend_y, [
        (COLORS[rank % len(COLORS)], f"rank {rank}: RSS {v['rss']['growth'] / MIB:+.2f} MiB after warm-up, slope "
         f"{v['rss']['slope']:+.1f} B/step, limit {v['rss']['limit'] / MIB:.1f} MiB (dashed); "
         f"{'flat' if v['ok'] else 'GROWS'}") for rank, v in enumerate(verdicts)]) + 15
    c.text(left, caption_y, f"{machine(meta)}, {meta['params']:,} parameters in {meta['buckets']} buckets, "
           f"{meta['config']['steps']} steps; dotted: state_dict + load_state_dict; {meta['date'][:10]}", font_size=11)
    c.write(path)


LANES = [("compute", "GPU forward + backward", "#1f77b4"), ("down", "gradients down (PCIe)", "#ff7f0e"),
         ("cpu", "CPU step", "#2ca02c"), ("up", "parameters up (PCIe)", "#d62728")]


def timeline_svg(data: dict, path) -> None:
    """bench_host_state.py --timeline: one iteration with state in host memory, a lane per engine."""
    width, left, top, lane_h, gap = 900, 190, 50, 34, 12
    end = max([data["total_ms"]] + [e for spans in data["spans"].values() for _, e in spans])
    scale = (width - left - 20) / end
    axis_y = top + len(LANES) * (lane_h + gap)
    m = data["model"]
    c = Canvas(width, axis_y + 40)
    c.text(10, 22, f"One iteration, {data.get('optimizer', 'FusedAdam')}, state in host memory: GPT "
           f"{m['params'] / 1e9:.2f}B (d {m['d_model']}, {m['layers']} layers), batch {m['batch']} x {m['seq']}, "
           f"{data['kind']} states, {data['gpu']}, {data['date']}", font_size=13)
    for i, (key, label, color) in enumerate(LANES):
        y = top + i * (lane_h + gap)
        c.text(10, y + lane_h / 2 + 4, label)
        c.text(10, y + lane_h / 2 + 18, f"busy {sum(e - s for s, e in data['spans'][key]):.0f} ms", fill="#555",
               font_size=10)
        c.rect(left, y, end * scale, lane_h, "#f2f2f2")
        for s, e in data["spans"][key]:
            c.rect(left + s * scale, y, max((e - s) * scale, 0.5), lane_h, color, fill_opacity=0.85)
    step = next(s for s in (10, 20, 50, 100, 200, 500, 1000) if end / s <= 12)
    for t in range(0, int(end) + 1, step):
        c.line(left + t * scale, top - 4, left + t * scale, axis_y, stroke="#ccc")
        c.text(left + t * scale, axis_y + 14, t, text_anchor="middle")
    c.text(left + (width - left) / 2, axis_y + 32, f"ms from the start of the iteration (total "
           f"{data['total_ms']:.0f} ms)", text_anchor="middle")
    c.write(path)


def hf_llama_svg(data: dict, path) -> None:
    """bench_hf_llama.py's loss curves, labelled with their tokens/s and peak memory."""
    meta, n = data["meta"], data["meta"]["parameters"]
    title = (f"LlamaForCausalLM {f'{n / 1e9:.2f}B' if n >= 1e8 else f'{n / 1e6:.2f}M'}, {meta['world']} x "
             f"{meta['device']}, {'bf16 autocast, ' if meta['bf16'] else ''}{meta['global_batch']} x {meta['seq']} "
             "tokens/step")
    write_loss_svg(pathlib.Path(path), title, {f"{name}: {r['tokens_per_s']:,.0f} tokens/s" + (
        "" if r.get("peak_memory_gib") is None else f", peak {r['peak_memory_gib']:.1f} GiB"): r["losses"]
        for name, r in data["runs"].items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", help="the JSON file a benchmark wrote")
    ap.add_argument("--out", help="the SVG file to write (default: the JSON file's name, .svg)")
    args = ap.parse_args()
    out = args.out or pathlib.Path(args.result).with_suffix(".svg")
    data = dict(json.loads(pathlib.Path(args.result).read_text()), path=args.result)
    chart = distributed_svg if "results" in data else timeline_svg if "spans" in data else hf_llama_svg if "runs" in \
        data else kernels_svg if "cases" in data else soak_svg
    chart(data, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
