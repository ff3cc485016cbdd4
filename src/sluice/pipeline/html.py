"""HTML: the delivery report as one self-contained page with SVG charts.

SUMMARY
    ReportData(...)            the few aggregated rows the page shows
    render_report(data) -> str

DESCRIPTION
    A page a person opens in a browser: totals, volume over time (one line
    per outcome and hour), outcome mix per domain (stacked bars, largest
    domains first), queue time to delivery per domain (p50/p95/p99 bars)
    and the top deferral and bounce reasons.

STRATEGIES
    No JavaScript, no network: the charts are inline SVG drawn here, so
    the file works from a mail attachment or an air-gapped host, and this
    module is plain Python that tests can call without Spark.  Every text
    from the data is escaped.

SEE ALSO
    sluice.pipeline.report (where the rows come from)
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["OUTCOMES", "ReportData", "render_report"]

#: Outcome columns and their colours (colour-blind safe palette).
OUTCOMES: tuple[tuple[str, str], ...] = (
    ("received", "#4477aa"),
    ("delivered", "#228833"),
    ("deferred", "#ccbb44"),
    ("bounced", "#ee6677"),
    ("expired", "#aa3377"),
)
_PERCENTILES = (("queue_p50_s", "p50", "#66ccee"), ("queue_p95_s", "p95", "#4477aa"),
                ("queue_p99_s", "p99", "#222255"))
_MAX_BARS = 15


@dataclass(frozen=True, slots=True)
class ReportData:
    """What the HTML delivery report shows: totals, hours, domains, reasons."""
    generated_at: str
    totals: Mapping[str, Any]
    by_hour: Sequence[Mapping[str, Any]] = ()
    by_domain: Sequence[Mapping[str, Any]] = ()
    reasons: Sequence[Mapping[str, Any]] = ()
    inputs: Sequence[str] = ()
    period: tuple[str, str] | None = None
    title: str = "Sluice delivery report"
    notes: Sequence[str] = field(default_factory=tuple)


def _e(value: object) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _num(value: object) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return 0.0


def _fmt_count(value: object) -> str:
    return f"{int(_num(value)):,}"


def _fmt_s(value: object) -> str:
    if value is None:
        return "–"
    s = _num(value)
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _fmt_rate(value: object) -> str:
    return "–" if value is None else f"{100 * _num(value):.1f} %"


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    magnitude = 10 ** (len(str(int(value))) - 1)
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * magnitude:
            return float(step * magnitude)
    return float(10 * magnitude)


def _volume_chart(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "<p class=empty>No events in the period.</p>"
    w, h, left, bottom, top, right = 900, 280, 60, 40, 10, 10
    pw, ph = w - left - right, h - top - bottom
    peak = _nice_max(max(_num(r.get(k)) for r in rows for k, _ in OUTCOMES))
    n = len(rows)

    def x(i: int) -> float:
        return left + (pw * i / (n - 1) if n > 1 else pw / 2)

    def y(v: float) -> float:
        return top + ph - ph * v / peak

    parts = [f'<svg class=chart viewBox="0 0 {w} {h}" role="img" '
             'aria-label="Volume over time">']
    for k in range(5):
        v = peak * k / 4
        parts.append(f'<line x1={left} x2={w - right} y1="{y(v):.1f}" y2="{y(v):.1f}" '
                     'class=grid />')
        parts.append(f'<text x={left - 6} y="{y(v) + 4:.1f}" class=ylab>{_fmt_count(v)}</text>')
    step = max(1, n // 8)
    for i in range(0, n, step):
        label = str(rows[i].get("hour", ""))[:16].replace("T", " ")
        parts.append(f'<text x="{x(i):.1f}" y={h - 12} class=xlab>{_e(label)}</text>')
    for key, colour in OUTCOMES:
        points = " ".join(f"{x(i):.1f},{y(_num(r.get(key))):.1f}" for i, r in enumerate(rows))
        parts.append(f'<polyline class="series {key}" fill=none stroke="{colour}" '
                     f'stroke-width=2 points="{points}"><title>{key}</title></polyline>')
        if n <= 48:  # few points: mark them, a single hour has no line at all
            parts.extend(
                f'<circle cx="{x(i):.1f}" cy="{y(_num(r.get(key))):.1f}" r=3 fill="{colour}">'
                f'<title>{_e(r.get("hour"))} {key}: {_fmt_count(r.get(key))}</title></circle>'
                for i, r in enumerate(rows)
            )
    parts.append("</svg>")
    return "".join(parts)


def _mix_chart(rows: Sequence[Mapping[str, Any]]) -> str:
    keys = [k for k, _ in OUTCOMES if k != "received"]
    ranked = sorted(rows, key=lambda r: -sum(_num(r.get(k)) for k in keys))[:_MAX_BARS]
    ranked = [r for r in ranked if sum(_num(r.get(k)) for k in keys) > 0]
    if not ranked:
        return "<p class=empty>No delivery attempts in the period.</p>"
    bar, gap, left, width = 22, 6, 190, 640
    h = len(ranked) * (bar + gap) + 10
    parts = [f'<svg class=chart viewBox="0 0 900 {h}" role="img" '
             'aria-label="Outcome mix per domain">']
    colours = dict(OUTCOMES)
    for i, row in enumerate(ranked):
        yy = 5 + i * (bar + gap)
        total = sum(_num(row.get(k)) for k in keys)
        parts.append(f'<text x={left - 8} y={yy + 16} class=ylab>{_e(row.get("domain"))}</text>')
        xx = float(left)
        for k in keys:
            part = width * _num(row.get(k)) / total
            if part > 0:
                parts.append(
                    f'<rect class="seg {k}" x="{xx:.1f}" y={yy} width="{part:.1f}" '
                    f'height={bar} fill="{colours[k]}"><title>{_e(row.get("domain"))} {k}: '
                    f'{_fmt_count(row.get(k))}</title></rect>'
                )
            xx += part
        parts.append(f'<text x={left + width + 6} y={yy + 16} class=val>'
                     f'{_fmt_rate(row.get("delivery_rate"))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _latency_chart(rows: Sequence[Mapping[str, Any]]) -> str:
    ranked = [r for r in rows if r.get("queue_p99_s") is not None]
    ranked = sorted(ranked, key=lambda r: -_num(r.get("delivered")))[:_MAX_BARS]
    if not ranked:
        return "<p class=empty>No deliveries in the period.</p>"
    peak = _nice_max(max(_num(r.get("queue_p99_s")) for r in ranked))
    bar, group, left, width = 7, 30, 190, 620
    h = len(ranked) * group + 10
    parts = [f'<svg class=chart viewBox="0 0 900 {h}" role="img" '
             'aria-label="Queue time percentiles per domain">']
    for i, row in enumerate(ranked):
        yy = 5 + i * group
        parts.append(f'<text x={left - 8} y={yy + 14} class=ylab>{_e(row.get("domain"))}</text>')
        for j, (key, label, colour) in enumerate(_PERCENTILES):
            value = _num(row.get(key))
            wd = max(1.0, width * value / peak)
            parts.append(
                f'<rect class="pct {label}" x={left} y={yy + j * (bar + 1)} width="{wd:.1f}" '
                f'height={bar} fill="{colour}"><title>{_e(row.get("domain"))} {label}: '
                f'{_fmt_s(value)}</title></rect>'
            )
        parts.append(f'<text x={left + width + 6} y={yy + 14} class=val>'
                     f'p99 {_fmt_s(row.get("queue_p99_s"))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _reasons_table(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "<p class=empty>No deferrals or bounces in the period.</p>"
    out = []
    for event in ("deferred", "bounced", "expired"):
        mine = [r for r in rows if r.get("event") == event]
        if not mine:
            continue
        peak = max(_num(r.get("count")) for r in mine) or 1.0
        out.append(f"<h3>{_e(event)}</h3><table class=reasons><tr><th>#</th><th>reason</th>"
                   "<th>count</th><th></th></tr>")
        for r in mine:
            pct = 100 * _num(r.get("count")) / peak
            out.append(
                f'<tr><td>{_e(r.get("rank"))}</td><td title="{_e(r.get("example"))}">'
                f'<code>{_e(r.get("reason"))}</code></td><td class=num>'
                f'{_fmt_count(r.get("count"))}</td><td class=barcell><span class=bar '
                f'style="width:{pct:.0f}%"></span></td></tr>'
            )
        out.append("</table>")
    return "".join(out)


def _legend(keys: Sequence[tuple[str, str]]) -> str:
    return "<p class=legend>" + " ".join(
        f'<span><i style="background:{c}"></i>{_e(k)}</span>' for k, c in keys
    ) + "</p>"


_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:960px;color:#222}
h1{font-size:1.6em}h2{margin-top:1.8em;border-bottom:1px solid #ddd}
.totals{display:flex;gap:1em;flex-wrap:wrap}.totals div{background:#f4f6f8;padding:.6em 1em;
border-radius:6px}.totals b{display:block;font-size:1.4em}
.chart{width:100%;height:auto}.grid{stroke:#e4e4e4}.ylab{font-size:11px;text-anchor:end}
.xlab{font-size:11px;text-anchor:middle}.val{font-size:11px}
.legend span{margin-right:1em}.legend i{display:inline-block;width:.9em;height:.9em;
margin-right:.3em;vertical-align:-1px}
table.reasons{border-collapse:collapse;width:100%}.reasons td,.reasons th{padding:2px 6px;
text-align:left;border-bottom:1px solid #eee}.num{text-align:right}
.barcell{width:25%}.bar{display:block;height:10px;background:#ee6677}
.empty{color:#777}.meta{color:#666;font-size:12px}
"""


def render_report(data: ReportData) -> str:
    """The whole HTML document."""
    t = data.totals
    cards = "".join(
        f"<div>{label}<b class=total-{key}>{value}</b></div>"
        for key, label, value in (
            ("received", "received", _fmt_count(t.get("received"))),
            ("delivered", "delivered", _fmt_count(t.get("delivered"))),
            ("deferred", "deferred attempts", _fmt_count(t.get("deferred"))),
            ("bounced", "bounced", _fmt_count(t.get("bounced"))),
            ("expired", "expired", _fmt_count(t.get("expired"))),
            ("rate", "delivery rate", _fmt_rate(t.get("delivery_rate"))),
            ("p95", "queue time p95", _fmt_s(t.get("queue_p95_s"))),
        )
    )
    period = ""
    if data.period:
        period = f"{_e(data.period[0])} – {_e(data.period[1])}"
    notes = "".join(f"<p class=meta>{_e(n)}</p>" for n in data.notes)
    inputs = ", ".join(_e(i) for i in data.inputs[:5])
    if len(data.inputs) > 5:
        inputs += f" and {len(data.inputs) - 5} more"
    mix_keys = [(k, c) for k, c in OUTCOMES if k != "received"]
    pct_keys = [(label, c) for _, label, c in _PERCENTILES]
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{_e(data.title)}</title><meta name=viewport "
        f'content="width=device-width,initial-scale=1"><style>{_CSS}</style></head><body>'
        f"<h1>{_e(data.title)}</h1><p class=meta>Period: {period or 'all events'} · "
        f"generated {_e(data.generated_at)} · inputs: {inputs}</p>{notes}"
        f"<section id=totals><div class=totals>{cards}</div></section>"
        f"<section id=volume><h2>Volume over time (per hour)</h2>{_legend(OUTCOMES)}"
        f"{_volume_chart(data.by_hour)}</section>"
        f"<section id=mix><h2>Outcome mix per domain</h2>{_legend(mix_keys)}"
        f"{_mix_chart(data.by_domain)}</section>"
        f"<section id=latency><h2>Queue time to delivery per domain</h2>{_legend(pct_keys)}"
        f"{_latency_chart(data.by_domain)}</section>"
        f"<section id=reasons><h2>Top reasons</h2>{_reasons_table(data.reasons)}</section>"
        "</body></html>\n"
    )
