"""Shaping advice as shaping rules: what the shape job found, in the rules file's format.

SUMMARY
    advice_rules(limits, made_at) -> dict     the rules document (``rules: [...]``)
    advice_yaml(doc, comment="") -> str
    throttle_regex() -> str                   a rule's regex for a throttling reply

DESCRIPTION
    ``sluice analytics shape`` writes, beside its pickup policy, the same
    advice as shaping rules (docs/shaping.md), one per destination that
    throttled us often enough to measure::

        rules:
          - name: advice-gsuite
            where: {mx: "*.google.com"}
            reply: {code: 4xx, regex: "..."}
            trigger: {matches: 1}
            action: condition
            thresholds: {concurrency: 4, rate: 18/60}
            duration: 24h
            note: "advised by sluice analytics shape ...: 10 throttling replies, ..."
            test: "421 4.7.0 Try again later, closing connection."

    Read it as: "when this destination throttles us again, go at once to
    what it took the last time" -- the adaptive rules then need no halving
    steps to find it.  Put the file in ``delivery.shaping`` to use it that
    way, or give it to ``sluice shaping apply`` to install the thresholds
    now (after a simulation of the queue with and without them).

STRATEGIES
    One rule per wild-card: a rule's ``mx`` is one pattern, so a group of
    several (Gmail's three domains) becomes several rules with the same
    advice (``advice-gsuite``, ``advice-gsuite-2``, ...), each one a
    reader and ``sluice shaping check`` can follow.  The reply regex is
    the pipeline's own idea of a throttle (sluice.pipeline.rules: a 4.7.x
    status or throttle wording) without greylisting, so an advice rule
    never takes a greylisting reply that the shipped ``greylisting`` rule
    should ignore.  A connect interval is
    not a rule threshold: it stays in the note and in the policy file.

SEE ALSO
    sluice.pipeline.shape, sluice.pipeline.policy, sluice.shaping.rulefile,
    sluice.cli.shaping_cmds (``apply``)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sluice.pipeline import rules
from sluice.pipeline.policy import DestinationLimit, policy_yaml

__all__ = ["ADVICE_DURATION", "advice_rules", "advice_yaml", "throttle_regex"]

#: How long an advice rule's condition lasts once a throttle fires it.
ADVICE_DURATION = "24h"


def throttle_regex() -> str:
    """A reply regex (searched in "enhanced text") for a throttle, not greylisting."""
    words = rules.THROTTLE_TEXT.removeprefix("(?i)")
    grey = rules.GREYLIST_TEXT.removeprefix("(?i)")
    return rf"^(?!4\.2\.)(?!.*(?:{grey}))(?:4\.7\.\d{{1,3}}\b|.*(?:{words}))"


def _note(limit: DestinationLimit, made_at: str) -> str:
    parts = [f"advised by sluice analytics shape at {made_at}",
             f"{limit.throttled} throttling replies"]
    if limit.connectinterval_s is not None:
        parts.append(f"connect interval {limit.connectinterval_s:g} s (in the policy file)")
    return "; ".join(parts)


def advice_rules(limits: Iterable[DestinationLimit], made_at: str) -> dict[str, Any]:
    """The rules document for ``limits`` (those with a rate or a concurrency)."""
    out: list[dict[str, Any]] = []
    regex = throttle_regex()
    for limit in limits:
        thresholds: dict[str, Any] = {}
        if limit.concurrency is not None:
            thresholds["concurrency"] = limit.concurrency
        if limit.rate_per_min is not None:
            thresholds["rate"] = f"{limit.rate_per_min}/60"
        if not thresholds:
            continue
        # One rule per wild-card of the group (a rule's mx is one pattern):
        # Gmail's three domains are three rules with the same advice.
        for n, pattern in enumerate(limit.patterns):
            rule: dict[str, Any] = {
                "name": f"advice-{limit.destination}" + (f"-{n + 1}" if n else ""),
                "where": {"mx": pattern},
                "reply": {"code": "4xx", "regex": regex},
                "trigger": {"matches": 1},
                "action": "condition",
                "thresholds": thresholds,
                "duration": ADVICE_DURATION,
                "note": _note(limit, made_at),
            }
            if limit.example:
                rule["test"] = limit.example
            out.append(rule)
    return {"rules": out}


def advice_yaml(doc: dict[str, Any], comment: str = "") -> str:
    """The rules document as YAML, with ``comment`` lines on top."""
    return policy_yaml(doc, comment)
