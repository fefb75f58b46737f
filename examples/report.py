"""Progress and results of the example training run, with no dependencies
beyond the standard library: a one-line progress bar, the loss log as CSV and
the loss curves as a self-contained SVG file."""
from __future__ import annotations

import csv
import math
import pathlib
import sys
import time
from xml.sax.saxutils import escape


class ProgressBar:
    """One line on stderr, redrawn in place with a carriage return."""

    def __init__(self, label: str, total: int, width: int = 30):
        self.label, self.total, self.width = label, total, width
        self.start = self.last_draw = time.perf_counter()

    def update(self, done: int, note: str = "") -> None:
        now = time.perf_counter()
        # A redraw per step would flood logs when stderr is a file, not a terminal.
        if done < self.total and now - self.last_draw < 0.1:
            return
        self.last_draw = now
        filled = self.width * done // self.total
        elapsed = now - self.start
        eta = elapsed / done * (self.total - done) if done else 0.0
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} "
                         f"{note}  {elapsed:5.1f} s, {eta:4.0f} s left ")
        if done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def write_loss_csv(path: pathlib.Path, columns: dict[str, list[float]]) -> None:
    """One row per step: the step number, then every column's value."""
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["step", *columns])
        for i, row in enumerate(zip(*columns.values()), start=1):
            out.writerow([i, *(f"{v:.6g}" for v in row)])


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    raw = (hi - lo) / count if hi > lo else 1.0
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step)
    last = max(math.ceil(hi / step), first + 1)  # two ticks at least: a flat curve still has a scale
    return [k * step for k in range(first, last + 1)]


# Plot geometry, in SVG user units.
_WIDTH, _HEIGHT = 720, 420
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 20, 40, 48
# One colour per curve (the benchmarks overlay up to seven storage kinds); every
# other curve dashed, so that equal curves stay visible on top of each other.
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
_STYLES = [(color, ' stroke-dasharray="6 4"' if i % 2 else "") for i, color in enumerate(_COLORS)]


def write_loss_svg(path: pathlib.Path, title: str, curves: dict[str, list[float]]) -> None:
    """Loss against step, one polyline per curve, with axes, ticks and a legend."""
    steps = max(len(c) for c in curves.values())
    values = [v for c in curves.values() for v in c]
    yticks = nice_ticks(min(values), max(values))
    xticks = [x for x in nice_ticks(0, steps) if x <= steps]
    plot_w, plot_h = _WIDTH - _LEFT - _RIGHT, _HEIGHT - _TOP - _BOTTOM

    def x_of(step: float) -> float:
        return _LEFT + plot_w * step / steps

    def y_of(loss: float) -> float:
        return _TOP + plot_h * (yticks[-1] - loss) / (yticks[-1] - yticks[0])

    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
           f'viewBox="0 0 {_WIDTH} {_HEIGHT}" font-family="sans-serif" font-size="12">',
           f'<rect width="{_WIDTH}" height="{_HEIGHT}" fill="white"/>',
           f'<text x="{_WIDTH / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>']
    for y in yticks:
        svg.append(f'<line x1="{_LEFT}" x2="{_WIDTH - _RIGHT}" y1="{y_of(y):.1f}" y2="{y_of(y):.1f}" stroke="#ddd"/>')
        svg.append(f'<text x="{_LEFT - 6}" y="{y_of(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    for x in xticks:
        svg.append(f'<line x1="{x_of(x):.1f}" x2="{x_of(x):.1f}" y1="{_HEIGHT - _BOTTOM}" '
                   f'y2="{_HEIGHT - _BOTTOM + 5}" stroke="black"/>')
        svg.append(f'<text x="{x_of(x):.1f}" y="{_HEIGHT - _BOTTOM + 18}" text-anchor="middle">{x:g}</text>')
    svg.append(f'<path d="M{_LEFT},{_TOP} V{_HEIGHT - _BOTTOM} H{_WIDTH - _RIGHT}" fill="none" stroke="black"/>')
    svg.append(f'<text x="{_LEFT + plot_w / 2}" y="{_HEIGHT - 10}" text-anchor="middle">step</text>')
    svg.append(f'<text x="16" y="{_TOP + plot_h / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {_TOP + plot_h / 2})">loss</text>')
    for i, (name, losses) in enumerate(curves.items()):
        color, dash = _STYLES[i % len(_STYLES)]
        points = " ".join(f"{x_of(s):.1f},{y_of(v):.1f}" for s, v in enumerate(losses, start=1))
        svg.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.5"{dash}/>')
        y = _TOP + 16 + 18 * i
        svg.append(f'<line x1="{_WIDTH - _RIGHT - 260}" x2="{_WIDTH - _RIGHT - 230}" y1="{y - 4}" y2="{y - 4}" '
                   f'stroke="{color}" stroke-width="2"{dash}/>')
        svg.append(f'<text x="{_WIDTH - _RIGHT - 224}" y="{y}">{escape(name)}</text>')
    svg.append("</svg>")
    path.write_text("\n".join(svg) + "\n")
