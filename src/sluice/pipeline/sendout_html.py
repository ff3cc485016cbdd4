"""The sendout's summary as one self-contained HTML page.

SUMMARY
    render_sendout(job=, tenant=, inputs=, summary=, statuses=, domains=, reasons=,
                   generated_at=, dry_run=) -> str

DESCRIPTION
    What became of a campaign list: rows read, and how many were queued,
    refused, invalid, duplicate or suppressed, with a bar of the mix; the
    largest domains with their outcomes; the most frequent reasons for
    refused and invalid rows.  No JavaScript, no network, every text
    escaped -- as sluice.pipeline.html's delivery report.

SEE ALSO
    sluice.pipeline.sendout_job, sluice.pipeline.html
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["render_sendout"]

_COLOURS = {"queued": "#228833", "ready": "#66ccee", "refused": "#ee6677",
            "invalid": "#aa3377", "duplicate": "#bbbbbb", "suppressed": "#ccbb44"}


def _e(value: object) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _n(value: object) -> str:
    return f"{value:,}" if isinstance(value, int) else _e(value)


def render_sendout(*, job: str, tenant: str, inputs: Sequence[str],
                   summary: Mapping[str, Any], statuses: Sequence[str],
                   domains: Sequence[Mapping[str, Any]], reasons: Sequence[Mapping[str, Any]],
                   generated_at: str, dry_run: bool = False) -> str:
    """The sendout's summary page (see the module header), every text escaped."""
    total = int(summary.get("rows_read") or 0)
    bar = []
    for status in statuses:
        n = int(summary.get(status) or 0)
        if n and total:
            bar.append(f'<span class=seg style="width:{100 * n / total:.2f}%;'
                       f'background:{_COLOURS.get(status, "#999")}" '
                       f'title="{_e(status)}: {n:,}"></span>')
    counts = "".join(f"<tr><th>{_e(k.replace('_', ' '))}</th><td class=num>{_n(v)}</td></tr>"
                     for k, v in summary.items())
    head = "".join(f"<th>{_e(s)}</th>" for s in statuses)
    rows = "".join(
        f"<tr><td>{_e(d.get('domain'))}</td><td class=num>{_n(d.get('rows'))}</td>"
        + "".join(f"<td class=num>{_n(d.get(s, 0))}</td>" for s in statuses) + "</tr>"
        for d in domains)
    why = "".join(f"<tr><td>{_e(r.get('status'))}</td><td>{_e(r.get('reason'))}</td>"
                  f"<td class=num>{_n(r.get('n'))}</td></tr>" for r in reasons)
    mode = " (dry run: nothing was sent)" if dry_run else ""
    return f"""<!doctype html>
<html lang=en><head><meta charset=utf-8>
<title>Sluice sendout {_e(job)}</title>
<style>
body{{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}}
table{{border-collapse:collapse;margin:1em 0}}
th,td{{padding:.2em .7em;border-bottom:1px solid #ddd;text-align:left}}
td.num{{text-align:right;font-variant-numeric:tabular-nums}}
.bar{{display:flex;height:1.4em;width:100%;max-width:900px;border:1px solid #ccc}}
.seg{{display:block;height:100%}}
</style></head><body>
<h1>Sendout {_e(job)}{_e(mode)}</h1>
<p>Tenant {_e(tenant or "–")}; input {_e(", ".join(inputs))}; made {_e(generated_at)}.</p>
<div class=bar>{"".join(bar)}</div>
<h2>Summary</h2><table>{counts}</table>
<h2>Largest domains</h2>
<table><tr><th>domain</th><th>rows</th>{head}</tr>{rows}</table>
<h2>Why rows were not sent</h2>
<table><tr><th>status</th><th>reason</th><th>rows</th></tr>{why}</table>
</body></html>
"""
