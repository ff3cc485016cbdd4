"""Policy: shaping advice written as a Halon-format pickup policy.

SUMMARY
    limits_from_findings(rows) -> list[DestinationLimit]
    build_policy(limits) -> list[dict]      the YAML document as data
    policy_yaml(policy, comment="") -> str

DESCRIPTION
    The policy has the shape of Halon's pickup policies (and so of
    ``scheduler.policy``): a list of counters, each naming its ``fields``;
    a field may roll values up into named groups of wild-card patterns,
    which conditions then match as ``#groupid``; ``if`` is a list of
    conditions, first match wins, each with thresholds ``concurrency``,
    ``rate`` ("X/Y": X per Y seconds) and ``connectinterval`` (seconds).

    One counter is written, over ``localip`` and ``remotemx``, because the
    findings are per source IP and destination and providers throttle per
    source IP::

        - fields:
          - localip
          - remotemx:
              gsuite: ['*.google.com', '*.googlemail.com', '*.smtp.goog']
          if:
          - remotemx: '#gsuite'
            rate: 540/60
            concurrency: 4

    The counter has no thresholds of its own: destinations that did not
    throttle are not limited by it.

STRATEGIES
    One limit per destination: when several source IPs were throttled by
    the same destination, the lowest advice of each kind wins -- the
    counter applies it to every IP.

    Pure Python, no Spark: the CLI collects the few finding rows and
    writes the file on the driver.

SEE ALSO
    sluice.pipeline.shape (the findings), schemas/policy.schema.json,
    `sluice policy validate FILE`
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from sluice.pipeline.rules import mx_group

__all__ = ["DestinationLimit", "build_policy", "limits_from_findings", "policy_yaml"]


@dataclass(frozen=True, slots=True)
class DestinationLimit:
    """The limits found for one destination group, with what evidence there was."""
    destination: str  # group id, e.g. "gsuite"
    patterns: tuple[str, ...]  # Halon wild-cards of the group
    rate_per_min: int | None = None
    concurrency: int | None = None
    connectinterval_s: float | None = None
    throttled: int = 0
    example: str | None = None  # a throttling reply it gave

    def __post_init__(self) -> None:
        if not self.patterns:
            raise ValueError(f"destination {self.destination!r} needs at least one pattern")
        for value, name in ((self.rate_per_min, "rate_per_min"), (self.concurrency, "concurrency")):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, not {value}")


def _lowest(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def limits_from_findings(rows: Iterable[Mapping[str, Any]]) -> list[DestinationLimit]:
    """Combine throttle_findings() rows (as dicts) into one limit per destination."""
    merged: dict[str, DestinationLimit] = {}
    for row in rows:
        gid = row["destination"]
        if gid is None:
            continue
        sample = row.get("sample_mx")
        found_gid, patterns = mx_group(sample) if sample else (gid, (f"*.{gid}",))
        if found_gid != gid:  # the sample disagrees: trust the group id
            patterns = (f"*.{gid}",)
        rate = row.get("rate_per_min")
        conc = row.get("concurrency")
        interval = row.get("connectinterval_s")
        if rate is None and conc is None and interval is None:
            continue  # too little evidence (sluice.pipeline.shape): no advice
        limit = DestinationLimit(
            destination=gid,
            patterns=patterns,
            rate_per_min=int(rate) if rate is not None else None,
            concurrency=int(conc) if conc is not None else None,
            connectinterval_s=float(interval) if interval is not None else None,
            throttled=int(row.get("throttled") or 0),
            example=row.get("example"),
        )
        before = merged.get(gid)
        if before is not None:
            limit = DestinationLimit(
                destination=gid,
                patterns=before.patterns,
                rate_per_min=_lowest(before.rate_per_min, limit.rate_per_min),
                concurrency=_lowest(before.concurrency, limit.concurrency),
                # A longer interval is the more careful one.
                connectinterval_s=(
                    max(before.connectinterval_s, limit.connectinterval_s)
                    if before.connectinterval_s is not None
                    and limit.connectinterval_s is not None
                    else before.connectinterval_s or limit.connectinterval_s
                ),
                throttled=before.throttled + limit.throttled,
                example=before.example or limit.example,
            )
        merged[gid] = limit
    return [merged[k] for k in sorted(merged)]


def build_policy(limits: Iterable[DestinationLimit]) -> list[dict[str, Any]]:
    """The pickup policy document (a list of counters) for ``limits``."""
    items = list(limits)
    if not items:
        return []
    groups: dict[str, list[str]] = {}
    conditions: list[dict[str, Any]] = []
    for limit in items:
        groups[limit.destination] = list(limit.patterns)
        cond: dict[str, Any] = {"remotemx": f"#{limit.destination}"}
        if limit.concurrency is not None:
            cond["concurrency"] = limit.concurrency
        if limit.rate_per_min is not None:
            cond["rate"] = f"{limit.rate_per_min}/60"
        if limit.connectinterval_s is not None:
            cond["connectinterval"] = limit.connectinterval_s
        if len(cond) > 1:
            conditions.append(cond)
    counter: dict[str, Any] = {"fields": ["localip", {"remotemx": groups}]}
    if conditions:
        counter["if"] = conditions
    return [counter]


def policy_yaml(policy: list[dict[str, Any]] | dict[str, Any], comment: str = "") -> str:
    """The policy (or another advice document) as YAML, with ``comment`` lines on top."""
    head = "".join(f"# {line}\n" if line else "#\n" for line in comment.splitlines())
    body = yaml.safe_dump(policy, sort_keys=False, default_flow_style=False,
                          allow_unicode=True, width=100)
    return head + body
