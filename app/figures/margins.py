"""Margins a figure will need, set before the browser draws it, so plotly.js draws it once.

The template turns `automargin` on (rotated token labels, colour bars and legends get room). plotly.js
meets that by drawing the figure, measuring what sticks out, growing the margins and drawing it all
again: on this project's figures (token-labelled axes, a colour bar) that second draw tripled the
time to paint a figure in a new tab (the trace explorer's logit lens: 1.7 s -> 0.6 s at load 14 with
its final margins given up front). `settle_margins` estimates those final margins from the labels'
text (Helvetica's advance widths, the template's font; Arial and Liberation Sans share them) and sets
them as the base margins, a few pixels generous. `automargin` stays on: a figure the estimate misses
(an auto-rotated category axis, a very long number) is drawn twice, as before, never cut.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import plotly.graph_objects as go

# Helvetica's advance widths (AFM, 1/1000 em) for printable ASCII; anything else counts a full em.
_WIDTHS = dict(zip(
    " !\"#$%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqrstuvwxyz{|}~",
    (278, 278, 355, 556, 556, 889, 667, 191, 333, 333, 389, 584, 278, 333, 278, 278, *[556] * 10, 278, 278, 584,
     584, 584, 556, 1015, 667, 667, 722, 722, 667, 611, 778, 722, 278, 500, 667, 556, 833, 722, 778, 667, 778, 722,
     667, 611, 722, 667, 944, 667, 667, 611, 278, 278, 278, 469, 556, 333, 556, 556, 500, 556, 556, 278, 556, 556,
     222, 222, 500, 222, 833, 556, 556, 556, 556, 333, 500, 278, 556, 500, 722, 500, 500, 500, 334, 260, 334, 584)))
WIDE = 1000
MONO = 620  # a monospace font's advance (DejaVu Sans Mono 602, rounded up)
TEXT_SCALE = 1.04  # rendered text came out up to 4% wider than the advance widths add up to

# plotly.js' own constants for the parts around the text (ticks "outside", the template's title standoff)
TICK_LEN, TICK_PAD = 5, 3
LINE = 1.3  # a line of text is this many font sizes tall in plotly's label boxes
PAPER_GAP = 0.02  # colour bars and legends sit at x = 1.02 of the plot width...
PLOT_WIDTH = 1200  # ...of a plot about this wide (the page's wide layout; an export at most ~1,500)
COLORBAR_PAD, COLORBAR_THICKNESS = 10, 30
LEGEND_SYMBOL = 40  # the legend's symbol and the gap before its text
AUTO_ANGLE_WIDTH = 240  # the narrowest plot area labels are laid out on (a half column less its legend)
LEGEND_ROW_WIDTH = 700  # horizontal legends wrap their entries at about this width
SLACK = 10  # pixels added to every estimate: a few too many cost a sliver of white, one too few a second draw


def text_width(text: str, size: float, mono: bool = False) -> float:
    """Pixels `text` takes in the template's font (or a monospace one) at `size` px (its widest line, for
    "<br>" lines)."""
    lines = str(text).split("<br>")
    em = max((len(line) * MONO if mono else sum(_WIDTHS.get(c, WIDE) for c in line)) for line in lines)
    return em * size / 1000 * TEXT_SCALE


def _is_mono(font: Any) -> bool:
    family = str(getattr(font, "family", None) or "").lower()
    return "mono" in family or "courier" in family


def _lines(text: str) -> int:
    return str(text).count("<br>") + 1


def _font_size(*fonts: Any, default: float = 13.0) -> float:
    for font in fonts:
        size = getattr(font, "size", None) if font is not None else None
        if size:
            return float(size)
    return default


def _axis_labels(fig: go.Figure, name: str, axis: Any) -> list[str]:
    """The tick labels an axis will show, or the widest it may show: its `ticktext`, the categories its
    traces put on it, or for numbers the two ends of plotly's own ticks over the data."""
    if axis.ticktext is not None:
        return [str(t) for t in axis.ticktext]
    letter, ref = name[0], name.replace("axis", "")  # "xaxis2" -> "x", "x2"
    labels: list[str] = []
    numbers: list[float] = []
    for trace in fig.data:
        if (getattr(trace, f"{letter}axis", None) or letter) != ref or letter not in trace:
            continue
        values = getattr(trace, letter, None)
        if values is None or not len(values):
            continue
        if all(isinstance(v, str) for v in values):
            labels += [v for v in values if v not in labels]
        else:
            numbers += _value_range(values)
    if labels or not numbers:
        return labels
    lo, hi = min(numbers), max(numbers)
    if axis.type == "log":  # plotly's log ticks: powers of ten, "0.001"
        lo = 10 ** math.floor(math.log10(lo)) if lo > 0 else 1.0
        return [f"{v:g}" for v in (lo, hi)]
    if axis.type not in (None, "-", "linear"):
        return labels
    if "%" in str(axis.tickformat or ""):
        return [f"{100 * v:.0f}%".replace("-", "\u2212") for v in (lo, hi)]
    return _number_labels(lo, hi)  # plotly's own ticks: their two ends stand in


def _axis_margin(fig: go.Figure, name: str, base_font: float) -> tuple[str, float] | None:
    """(side, pixels) an axis pushes out of the plot: its tick labels, ticks and title."""
    axis = fig.layout[name]
    if axis.visible is False:
        return None
    labels = _axis_labels(fig, name, axis) if axis.showticklabels is not False else []
    size = _font_size(axis.tickfont, default=base_font)
    angle = math.radians(float(axis.tickangle)) if isinstance(axis.tickangle, (int, float)) else 0.0
    widest = max((text_width(t, size, _is_mono(axis.tickfont)) for t in labels), default=0.0)
    tall = max((_lines(t) for t in labels), default=1) * size * LINE if labels else 0.0
    horizontal = name.startswith("x")
    if horizontal and axis.tickangle in (None, "auto") and labels:
        # plotly turns crowded labels by 30 degrees, or 90 when even that crowds them
        room = AUTO_ANGLE_WIDTH * (axis.domain[1] - axis.domain[0] if axis.domain else 1.0)
        crowded = sum(text_width(t, size) for t in labels) + 10 * len(labels) > room
        angle = math.radians(90 if crowded and len(labels) * 2 * tall > room else 30) if crowded else 0.0
    across = (widest * abs(math.sin(angle)) + tall * abs(math.cos(angle)) if horizontal
              else widest * abs(math.cos(angle)) + tall * abs(math.sin(angle)))
    out = TICK_LEN + TICK_PAD + across if labels else 0.0
    title = axis.title.text if axis.title is not None else None
    if title:
        standoff = axis.title.standoff if axis.title.standoff is not None else 8
        out += standoff + _lines(title) * _font_size(axis.title.font, default=base_font) * LINE
    side = axis.side or ("bottom" if horizontal else "left")
    return side, out


def _colorbars(fig: go.Figure) -> Iterable[tuple[Any, Sequence[float]]]:
    """(colorbar, value range) of every colour bar the figure shows."""
    shared = {}
    for key in fig.layout:
        if key.startswith("coloraxis") and fig.layout[key].showscale is not False:
            axis = fig.layout[key]
            shared[key] = (axis.colorbar, (axis.cmin, axis.cmax))
    used = set()
    for trace in fig.data:
        holder = trace if "showscale" in trace else getattr(trace, "marker", None)
        if holder is None or "showscale" not in holder:
            continue
        coloraxis = getattr(holder, "coloraxis", None) or getattr(trace, "coloraxis", None)
        if coloraxis:
            used.add(coloraxis)
            continue
        scaled = holder.showscale if holder.showscale is not None else trace.type in ("heatmap", "contour", "histogram2d")
        if scaled:
            lo = getattr(holder, "zmin", None) if "zmin" in holder else getattr(holder, "cmin", None)
            hi = getattr(holder, "zmax", None) if "zmax" in holder else getattr(holder, "cmax", None)
            if lo is None or hi is None:
                lo, hi = _value_range(getattr(trace, "z", None) if "z" in trace else getattr(holder, "color", None))
            yield holder.colorbar, (lo, hi)
    for key in used:
        if key in shared:
            yield shared[key]


def _value_range(values: Any) -> tuple[float, float]:
    flat = []

    def walk(v: Any) -> None:
        if isinstance(v, (list, tuple)) or (hasattr(v, "tolist") and not isinstance(v, (int, float))):
            for x in (v.tolist() if hasattr(v, "tolist") else v):
                walk(x)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            flat.append(float(v))

    walk(values)
    return (min(flat), max(flat)) if flat else (0.0, 1.0)


def _number_labels(lo: float | None, hi: float | None) -> list[str]:
    """The widest labels plotly's own ticks over [lo, hi] can have: both ends rounded to a 1/2/2.5/5 step."""
    lo, hi = float(lo if lo is not None else 0.0), float(hi if hi is not None else 1.0)
    raw = (hi - lo or abs(hi) or 1.0) / 10  # a tall axis gets ten ticks
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    decimals = max(0, -math.floor(math.log10(step) + 1e-9) + (1 if round(step / mag, 1) == 2.5 else 0))
    ends = (math.floor(lo / step) * step, math.ceil(hi / step) * step)
    return [f"{v:.{decimals}f}".replace("-", "\u2212") for v in ends]


def _colorbar_margin(colorbar: Any, value_range: Sequence[float], base_font: float) -> float:
    size = _font_size(colorbar.tickfont, default=base_font)
    labels = list(colorbar.ticktext) if colorbar.ticktext is not None else _number_labels(*value_range)
    thickness = colorbar.thickness if colorbar.thickness is not None else COLORBAR_THICKNESS
    body = thickness + TICK_PAD + max((text_width(t, size) for t in labels), default=0.0)
    title = colorbar.title.text if colorbar.title is not None else None
    if title:  # above the bar: as wide as its text (measured a fifth wider than Helvetica's widths say)
        body = max(body, 1.2 * text_width(title, _font_size(colorbar.title.font, default=base_font)))
    x = colorbar.x if colorbar.x is not None else 1 + PAPER_GAP
    return max(0.0, (x - 1) * PLOT_WIDTH) + 2 * COLORBAR_PAD + body


def _legend_margin(fig: go.Figure, base_font: float, top: float) -> tuple[str, float]:
    """(side, pixels) a legend outside the plot takes: a vertical one on the right, a horizontal one below."""
    legend = fig.layout.legend
    names = [t.name for t in fig.data if getattr(t, "showlegend", False) is not False and t.name]  # go.Image: no legend
    shown = fig.layout.showlegend if fig.layout.showlegend is not None else len(names) > 1
    if not shown or not names:
        return "r", 0.0
    size = _font_size(legend.font, default=base_font)
    if legend.orientation == "h":
        if legend.y is None or legend.y >= 0:
            return "b", 0.0
        rows, used = 1, 0.0
        for n in names:
            item = LEGEND_SYMBOL + text_width(n, size)
            if used and used + item > LEGEND_ROW_WIDTH:
                rows, used = rows + 1, 0.0
            used += item
        below = rows * (size * LINE + 6) + COLORBAR_PAD
        height = fig.layout.height or 450
        # the legend's top sits -y plot heights below the plot, and the plot is what the margins leave
        return "b", (-legend.y * (height - top) + below) / (1 - legend.y)
    if legend.x is not None and legend.x < 1:
        return "r", 0.0
    x = legend.x if legend.x is not None else 1 + PAPER_GAP
    return "r", (x - 1) * PLOT_WIDTH + LEGEND_SYMBOL + max(text_width(n, size) for n in names) + COLORBAR_PAD


def estimated_margins(fig: go.Figure) -> dict[str, int]:
    """The margins (l, r, t, b) plotly.js' automargin would end at for `fig`, from what is known here."""
    template = fig.layout.template.layout if fig.layout.template is not None else go.Layout()
    base = {side: getattr(fig.layout.margin, side) if getattr(fig.layout.margin, side) is not None
            else getattr(template.margin, side) for side in "lrtb"}
    base = {side: 80 if value is None else value for side, value in base.items()}  # plotly's own default
    font = _font_size(fig.layout.font, template.font)
    need = dict(base)
    for key in fig.layout:
        if key.startswith(("xaxis", "yaxis")):
            pushed = _axis_margin(fig, key, font)
            if pushed is not None:
                side, pixels = pushed
                letter = {"bottom": "b", "top": "t", "left": "l", "right": "r"}[side]
                need[letter] = max(need[letter], pixels + SLACK)
    side, legend = _legend_margin(fig, font, need["t"])
    right = max([legend if side == "r" else 0.0, *(_colorbar_margin(cb, rng, font) for cb, rng in _colorbars(fig))])
    if right:
        need["r"] = max(need["r"], right + SLACK)
    if side == "b" and legend:
        need["b"] = max(need["b"], legend + SLACK)
    return {side: int(math.ceil(value)) for side, value in need.items()}


def settle_margins(fig: go.Figure) -> go.Figure:
    """Set `fig`'s margins to `estimated_margins(fig)` (automargin stays on); returns the same figure."""
    fig.update_layout(margin=estimated_margins(fig))
    return fig
