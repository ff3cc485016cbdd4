"""Bounded label values for the metrics: a limiter and the recipient-domain labels.

SUMMARY
    labels = DomainLabels(groups, limit, min_count); labels.label(domain)
    tenants = LabelLimiter(limit, min_count); tenants.label(tenant)

STRATEGY
    ``domain`` is a configured group (api.metrics_domain_groups, wildcards
    or /regex/), else the domain itself if it is one of the first ``limit``
    domains to reach ``min_count`` events, else "other"; tenants likewise
    without groups.  A value once given a label keeps it for the life of
    the process, so every series stays monotonic.  Candidates are counted
    in a table of at most CANDIDATES values whose counts halve when it
    fills (old noise fades, steady traffic gets through).

SEE ALSO
    sluice.api.metrics (the counters these label), docs/api.md
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sluice.scheduler import Pattern

__all__ = ["CANDIDATES", "NONE", "OTHER", "DomainLabels", "LabelLimiter"]

#: Candidate values counted at most (per label) before counts halve.
CANDIDATES = 4096

OTHER = "other"
NONE = "none"


class LabelLimiter:
    """Gives at most ``limit`` values a label of their own; the rest are "other"."""

    def __init__(self, limit: int, min_count: int) -> None:
        self.limit = limit
        self.min_count = max(1, min_count)
        self.admitted: set[str] = set()
        self._candidates: dict[str, int] = {}

    def label(self, value: str) -> str:
        """The value's label: itself if admitted (now or before), else other/none."""
        if not value:
            return NONE
        if value in self.admitted:
            return value
        if len(self.admitted) >= self.limit:
            return OTHER
        n = self._candidates.get(value, 0) + 1
        if n >= self.min_count:
            self.admitted.add(value)
            self._candidates.pop(value, None)
            if len(self.admitted) >= self.limit:
                self._candidates.clear()  # no room left: stop counting
            return value
        if len(self._candidates) >= CANDIDATES and value not in self._candidates:
            # Full: halve every count and forget what falls to zero.
            self._candidates = {k: v // 2 for k, v in self._candidates.items() if v > 1}
        self._candidates[value] = n
        return OTHER


class DomainLabels:
    """Recipient domain -> label: a configured group, an admitted domain, or "other"."""

    def __init__(self, groups: Mapping[str, Sequence[str]], limit: int, min_count: int) -> None:
        self.groups = [(name, [Pattern.compile(p) for p in patterns])
                       for name, patterns in groups.items()]
        self.limiter = LabelLimiter(limit, min_count)
        self._cache: dict[str, str] = {}

    def label(self, domain: str) -> str:
        """The domain's label: its group, itself if admitted, else other/none."""
        cached = self._cache.get(domain)
        if cached is not None:
            return cached
        for name, patterns in self.groups:
            if any(p.matches(domain) for p in patterns):
                if len(self._cache) < CANDIDATES:
                    self._cache[domain] = name
                return name
        label = self.limiter.label(domain)
        if label != OTHER and label != NONE and len(self._cache) < CANDIDATES:
            self._cache[domain] = label  # admitted for good
        return label
