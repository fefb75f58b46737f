"""Plots for the benchmarks as self-contained SVG files (standard library
only: the benchmark machines need no plotting package)."""
from __future__ import annotations

import math
import pathlib
from xml.sax.saxutils import escape

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round values (1, 2 or 5 times a power of ten apart) from below lo to above hi."""
    raw = (hi - lo) / count or 1.0
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step)
    last = max(math.ceil(hi / step), first + 1)  # two ticks at least: a flat line still has a scale
    return [i * step for i in range(first, last + 1)]


def _attrs(attrs: dict) -> str:
    return "".join(f' {k.rstrip("_").replace("_", "-")}="{v:.1f}"' if isinstance(v, float)
                   else f' {k.rstrip("_").replace("_", "-")}="{v}"' for k, v in attrs.items())


class Canvas:
    """An SVG document built element by element; attribute names take
    underscores for dashes (stroke_dasharray)."""

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

    def polyline(self, points, stroke, **attrs) -> None:
        self.add("polyline", points=" ".join(f"{x:.1f},{y:.1f}" for x, y in points), fill="none", stroke=stroke,
                 stroke_width=1.5, **attrs)

    def legend(self, x: float, y: float, entries: list[tuple[str, str]], dy: float = 20) -> float:
        """A colour swatch and a label per entry, one under the other; returns the y below them."""
        for i, (color, label) in enumerate(entries):
            self.rect(x, y + dy * i, 12, 12, color)
            self.text(x + 18, y + dy * i + 11, label)
        return y + dy * len(entries)

    def write(self, path) -> None:
        pathlib.Path(path).write_text("\n".join(self.parts + ["</svg>"]) + "\n")


class Axes:
    """A plot area on a canvas with data coordinates: ticks and grid on both
    axes, lines through data points. The y range is rounded out to ticks."""

    def __init__(self, canvas: Canvas, box: tuple, x_range: tuple, y_values: list[float], xlabel: str = "",
                 ylabel: str = ""):
        self.c, (self.x0, self.y0, self.w, self.h) = canvas, box
        self.xlo, self.xhi = x_range
        self.yticks = nice_ticks(min(y_values), max(y_values))
        self.ylo, self.yhi = self.yticks[0], self.yticks[-1]
        for v in self.yticks:
            canvas.line(self.x0, self.y(v), self.x0 + self.w, self.y(v), stroke="#ddd")
            canvas.text(self.x0 - 5, self.y(v) + 4, f"{v:g}", text_anchor="end", font_size=11)
        for v in nice_ticks(self.xlo, self.xhi, 8):
            if self.xlo <= v <= self.xhi:
                canvas.text(self.x(v), self.y0 + self.h + 15, f"{v:g}", text_anchor="middle", font_size=11)
        canvas.add("path", d=f"M{self.x0},{self.y0} V{self.y0 + self.h} H{self.x0 + self.w}", fill="none",
                   stroke="black")
        canvas.text(self.x0 + self.w / 2, self.y0 + self.h + 32, xlabel, text_anchor="middle")
        mid = self.y0 + self.h / 2
        canvas.text(self.x0 - 50, mid, ylabel, text_anchor="middle", transform=f"rotate(-90 {self.x0 - 50} {mid})")

    def x(self, v: float) -> float:
        return self.x0 + self.w * (v - self.xlo) / ((self.xhi - self.xlo) or 1)

    def y(self, v: float) -> float:
        return self.y0 + self.h * (1 - (v - self.ylo) / ((self.yhi - self.ylo) or 1))

    def plot(self, xs, ys, color: str, **attrs) -> None:
        self.c.polyline([(self.x(a), self.y(b)) for a, b in zip(xs, ys)], color, **attrs)

    def hline(self, v: float, color: str, x_from: float | None = None, **attrs) -> None:
        self.c.line(self.x(self.xlo if x_from is None else x_from), self.y(v), self.x0 + self.w, self.y(v),
                    stroke=color, **attrs)

    def vline(self, v: float, color: str, **attrs) -> None:
        self.c.line(self.x(v), self.y0, self.x(v), self.y0 + self.h, stroke=color, **attrs)
