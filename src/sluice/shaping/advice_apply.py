"""Shaping advice applied now: conditions planned, the queue simulated with and without.

SUMMARY
    plan = plan_advice(rules, policy, now)         -> list[Planned]  (or AdviceError)
    pair = scenarios(queued, plan, policy, settings, limit)   -> (without, with) Scenarios
    rows = compare(plan, queued, run(without), run(with))    -> list[Change]

DESCRIPTION
    ``sluice analytics shape`` writes its advice as shaping rules with the
    ``condition`` action (sluice.pipeline.advice).  ``sluice shaping apply
    FILE`` installs those thresholds at once, as policy conditions with an
    expiry, through the running server's API -- each an audited change
    that ``sluice policy-audit rollback ID`` undoes -- after showing what
    they would do to the mail queued now.

    What they would do is asked of the policy simulator
    (sluice.scheduler.simulation): the queued recipients of every domain
    whose next hop an advice rule names, delivered from now, once under the
    policy as it is and once with the conditions added.  The simulated
    destination behaves as the advice's evidence says the real one did: it
    answers 421 above the rate it accepted while throttling (the advised
    rate is 90 % of that) and above the connections it had open when it
    throttled (the advised concurrency is one less).  The report is the
    drain time and the refused attempts per domain, without and with.

STRATEGIES
    A condition is what the shaping runtime would add when the rule fires
    (the same counter look-up, counter_for, and the same augmented policy),
    so applying advice now and letting the rule fire later are one thing.

    Simulate a sample.  A destination's recipients beyond ``limit`` are
    left out of the simulation (the drain time of a rate-limited queue
    grows in proportion); the report says how many were simulated.

SEE ALSO
    sluice.pipeline.advice, sluice.shaping.runtime, sluice.cli.shaping_cmds,
    docs/shaping.md
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from sluice.scheduler.policy import Condition, Counter, Pattern, Policy, Thresholds
from sluice.scheduler.scenario import DestinationSpec, FlowSpec, Scenario
from sluice.scheduler.settings import Settings
from sluice.scheduler.simulation import SimulationReport
from sluice.shaping.rules import Action, Rule

__all__ = [
    "RATE_MARGIN",
    "AdviceError",
    "Change",
    "Planned",
    "Queued",
    "compare",
    "counter_for",
    "plan_advice",
    "scenarios",
]

#: The advised rate is this part of what the destination accepted while it
#: throttled (sluice.pipeline.shape advises it; here it is undone to simulate).
RATE_MARGIN = 0.9


class AdviceError(ValueError):
    """The advice cannot be applied (said in one line)."""


@dataclass(frozen=True, slots=True)
class Planned:
    """One advice rule as the condition it installs."""

    rule: str
    counter: str
    condition: Condition
    pattern: Pattern
    ttl_s: float


@dataclass(frozen=True, slots=True)
class Queued:
    """Recipients queued for a domain, and the host its mail goes to (remotemx)."""

    domain: str
    recipients: int
    remotemx: str


@dataclass(frozen=True, slots=True)
class Change:
    """A domain's drain time and refused attempts, without and with the advice."""

    domain: str
    remotemx: str
    rule: str
    simulated: int
    queued: int
    drain_before_s: float | None
    drain_after_s: float | None
    refused_before: int
    refused_after: int


def counter_for(policy: Policy, names: Iterable[str]) -> Counter | None:
    """The counter a condition over fields ``names`` goes on.

    One over exactly those fields, else the first that has them all.
    """
    want = set(names)
    best: Counter | None = None
    for counter in policy.counters:
        if set(counter.field_names) == want:
            return counter
        if best is None and want <= set(counter.field_names):
            best = counter
    return best


def plan_advice(rules: Sequence[Rule], policy: Policy, now: float) -> list[Planned]:
    """The conditions ``rules`` install now (``policy`` already augmented)."""
    out: list[Planned] = []
    for rule in rules:
        if rule.action is not Action.CONDITION:
            raise AdviceError(f"rule {rule.name}: action {rule.action}; advice rules set "
                              "thresholds (action: condition)")
        fields = dict(rule.where.fields)
        if set(fields) != {"remotemx"}:
            raise AdviceError(f"rule {rule.name}: advice names its destination by mx only")
        counter = counter_for(policy, ("remotemx",))
        if counter is None:
            raise AdviceError("the policy has no counter over remotemx")
        thresholds = Thresholds(concurrency=rule.concurrency, rate=rule.rate)
        cond = Condition((("remotemx", fields["remotemx"]),), thresholds, f"advice-{rule.name}",
                         now + rule.duration_s, "advice", rule.note or rule.name)
        out.append(Planned(rule.name, counter.id, cond, Pattern.compile(fields["remotemx"]),
                           rule.duration_s))
    return out


def _rule_of(plan: Sequence[Planned], remotemx: str) -> Planned | None:
    return next((p for p in plan if p.pattern.matches(remotemx)), None)


def _behaviour(planned: Planned) -> tuple[int | None, int | None]:
    """What the evidence says the destination took: per minute, at once."""
    th = planned.condition.thresholds
    per_min = None
    if th.rate is not None:
        per_min = max(1, math.ceil(th.rate.count * 60.0 / th.rate.per_s / RATE_MARGIN))
    at_once = None if th.concurrency is None else th.concurrency + 1
    return per_min, at_once


def scenarios(queued: Iterable[Queued], plan: Sequence[Planned], policy: Policy,
              settings: Settings, limit: int) -> tuple[Scenario, Scenario, dict[str, int]]:
    """The queue's advised domains under ``policy`` without and with ``plan``.

    Also how many recipients of each domain are simulated.
    """
    dests: list[DestinationSpec] = []
    flows: list[FlowSpec] = []
    simulated: dict[str, int] = {}
    for q in queued:
        planned = _rule_of(plan, q.remotemx)
        if planned is None or q.recipients <= 0:
            continue
        per_min, at_once = _behaviour(planned)
        n = min(q.recipients, limit)
        simulated[q.domain] = n
        dests.append(DestinationSpec(q.domain, mx=q.remotemx, latency_s=0.5, jitter=0.2,
                                     max_per_minute=per_min, max_concurrency=at_once))
        flows.append(FlowSpec("queue", n, rate_per_s=n * 10.0, destinations=(q.domain,)))
    with_plan = policy
    for p in plan:
        with_plan, _ = with_plan.with_condition(p.counter, p.condition)
    base = Scenario("without the advice", tuple(dests), tuple(flows), policy, settings,
                    max_time_s=2 * 86400.0)
    return base, Scenario("with the advice", base.destinations, base.flows, with_plan,
                          settings, max_time_s=base.max_time_s), simulated


def compare(plan: Sequence[Planned], queued: Iterable[Queued], simulated: Mapping[str, int],
            before: SimulationReport, after: SimulationReport) -> list[Change]:
    """One row per simulated domain, largest queue first."""
    b = {d.name: d for d in before.destinations}
    a = {d.name: d for d in after.destinations}
    out = []
    for q in queued:
        if q.domain not in simulated:
            continue
        planned = _rule_of(plan, q.remotemx)
        assert planned is not None
        out.append(Change(q.domain, q.remotemx, planned.rule, simulated[q.domain], q.recipients,
                          b[q.domain].drain_s, a[q.domain].drain_s, b[q.domain].deferrals,
                          a[q.domain].deferrals))
    return sorted(out, key=lambda c: -c.queued)
