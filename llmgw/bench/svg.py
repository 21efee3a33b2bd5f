"""A bench run's plot as SVG, drawn with nothing but the standard library.

The single file carries no matplotlib, and a plot is text anyway: two panels
over the concurrency (log scale, as the ladder doubles), throughput above and
TTFT and ITL p95 below, with the SLO's limits dashed and the capacity dotted.
Any browser shows it.
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

from llmgw.bench.results import Run, slo_limits

WIDTH, HEIGHT = 720, 560
LEFT, RIGHT, TOP = 80, 24, 48
PANEL, GAP = 200, 64
TITLE = "throughput and latency against concurrency"
COLOURS = {"output tok/s": "#1f77b4", "TTFT p95": "#1f77b4", "ITL p95": "#ff7f0e"}


def _nice_top(value: float) -> float:
    """The axis' top: 1, 2 or 5 times a power of ten, at or above ``value``."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    return next(m * power for m in (1.0, 2.0, 5.0, 10.0) if m * power >= value)


def _text(x: float, y: float, text: str, anchor: str = "middle", size: int = 12) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}">'
        f"{escape(text)}</text>"
    )


def svg(run: Run) -> str:
    """The run's plot as an SVG document."""
    levels = run.levels
    xs = [lv.concurrency for lv in levels]
    lo, hi = math.log2(min(xs, default=1)), math.log2(max(xs, default=1))
    span = (hi - lo) or 1.0
    inner = WIDTH - LEFT - RIGHT

    def x_of(c: float) -> float:
        return LEFT + (math.log2(c) - lo) / span * inner if hi > lo else LEFT + inner / 2

    limits = slo_limits(run.slo)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}"'
        f' viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        _text(WIDTH / 2, 24, f"{run.model} ({run.profile or '?'}): {TITLE}", size=14),
    ]
    Series = list[tuple[str, list[float | None]]]
    panels: list[tuple[str, Series, dict[str, float]]] = [
        ("output tokens/s", [("output tok/s", [lv.output_tps for lv in levels])], {}),
        (
            "seconds",
            [
                ("TTFT p95", [lv.ttft_p95 for lv in levels]),
                ("ITL p95", [lv.itl_p95 for lv in levels]),
            ],
            {k: v for k, v in limits.items() if k in ("ttft_p95", "itl_p95")},
        ),
    ]
    for i, (unit, series, lines) in enumerate(panels):
        top_y = TOP + i * (PANEL + GAP)
        bottom_y = top_y + PANEL
        values = [v for _, vs in series for v in vs if v is not None]
        top = _nice_top(max([*values, *lines.values()], default=0.0))

        def y_of(v: float, top: float = top, bottom_y: float = bottom_y) -> float:
            return bottom_y - v / top * PANEL

        out.append(
            f'<rect x="{LEFT}" y="{top_y}" width="{inner}" height="{PANEL}"'
            ' fill="none" stroke="#444"/>'
        )
        for k in range(5):
            v = top * k / 4
            y = y_of(v)
            out.append(
                f'<line x1="{LEFT - 4}" y1="{y:.1f}" x2="{LEFT}" y2="{y:.1f}" stroke="#444"/>'
            )
            out.append(_text(LEFT - 8, y + 4, f"{v:.3g}", anchor="end", size=11))
        out.append(
            f'<text x="18" y="{top_y + PANEL / 2:.1f}" font-size="12" text-anchor="middle"'
            f' transform="rotate(-90 18 {top_y + PANEL / 2:.1f})">{escape(unit)}</text>'
        )
        for c in xs:
            out.append(_text(x_of(c), bottom_y + 16, str(c), size=11))
        for key, limit in lines.items():
            y = y_of(limit)
            out.append(
                f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + inner}" y2="{y:.1f}"'
                ' stroke="red" stroke-dasharray="6 4"/>'
            )
            out.append(_text(LEFT + inner - 4, y - 4, f"SLO {key}", anchor="end", size=11))
        if run.capacity is not None:
            x = x_of(run.capacity)
            out.append(
                f'<line x1="{x:.1f}" y1="{top_y}" x2="{x:.1f}" y2="{bottom_y}"'
                ' stroke="green" stroke-dasharray="2 3"/>'
            )
        for n, (name, vs) in enumerate(series):
            colour = COLOURS[name]
            points = [(x_of(c), y_of(v)) for c, v in zip(xs, vs, strict=True) if v is not None]
            if points:
                path = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
                out.append(
                    f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>'
                )
            out += [
                f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{colour}"/>' for px, py in points
            ]
            legend = _text(LEFT + 8, top_y + 16 + 14 * n, name, anchor="start", size=11)
            out.append(legend.replace("<text ", f'<text fill="{colour}" ', 1))
    out.append(_text(LEFT + inner / 2, HEIGHT - 8, "concurrency"))
    out.append("</svg>")
    return "\n".join(out) + "\n"
