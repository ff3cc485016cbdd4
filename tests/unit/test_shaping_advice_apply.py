"""Advice as conditions, and the queue simulated without and with them (pure, simulated clock)."""

from __future__ import annotations

import pytest

from sluice.scheduler import DeliveryJob, JobsQueued, Route, Scheduler, StartDelivery
from sluice.scheduler.policy import Policy, Rate
from sluice.scheduler.policy_parse import parse_policy
from sluice.scheduler.settings import Settings
from sluice.scheduler.simulation import Simulation
from sluice.shaping.advice_apply import AdviceError, Queued, compare, plan_advice, scenarios
from sluice.shaping.rules import Action, Rule, Where
from sluice.shaping.runtime import Shaper

pytestmark = pytest.mark.unit


def _advice(name: str = "advice-gsuite", mx: str = "*.google.com", **kw: object) -> Rule:
    return Rule(name, Action.CONDITION, Where((("remotemx", mx),)), duration_s=7200.0,
                concurrency=kw.get("concurrency", 2), rate=kw.get("rate", Rate(9, 60.0)),
                note="advised")


def test_a_rule_becomes_a_condition_on_the_remotemx_counter() -> None:
    policy = Shaper.augment(Policy())
    (p,) = plan_advice([_advice()], policy, now=1000.0)
    assert p.counter == "shaping-remotemx"
    assert p.condition.match == (("remotemx", "*.google.com"),)
    assert (p.condition.thresholds.concurrency, str(p.condition.thresholds.rate)) == (2, "9/60")
    assert p.condition.expires_at == 1000.0 + 7200.0
    # the policy's own counter over remotemx wins over the shaping one
    own = Shaper.augment(parse_policy([{"id": "mx", "fields": ["remotemx"], "concurrency": 20}]))
    assert plan_advice([_advice()], own, 0.0)[0].counter == "mx"


@pytest.mark.parametrize(("rule", "said"), [
    (Rule("pause", Action.SUSPEND, Where((("remotemx", "*.x"),))), "action suspend"),
    (Rule("dom", Action.CONDITION, Where((("recipientdomain", "x.example"),)), concurrency=1),
     "by mx only"),
])
def test_advice_that_is_not_a_condition_on_mx_is_refused(rule: Rule, said: str) -> None:
    with pytest.raises(AdviceError, match=said):
        plan_advice([rule], Shaper.augment(Policy()), 0.0)


def test_the_simulated_queue_drains_with_fewer_refusals_under_the_advice() -> None:
    policy = Shaper.augment(Policy())
    plan = plan_advice([_advice(concurrency=2, rate=Rate(9, 60.0))], policy, 0.0)
    queued = [Queued("gmail.com", 60, "alt1.gmail-smtp-in.l.google.com"),
              Queued("other.example", 500, "mx.other.example")]
    without, with_advice, simulated = scenarios(queued, plan, policy,
                                                Settings(max_deliveries=50), limit=40)
    assert simulated == {"gmail.com": 40}  # other.example is not the advice's; capped at 40
    before, after = Simulation(without).run(), Simulation(with_advice).run()
    (change,) = compare(plan, queued, simulated, before, after)
    assert (change.domain, change.queued, change.simulated) == ("gmail.com", 60, 40)
    # Unlimited, the destination (10 a minute, 3 at once) refuses much; under
    # the advice (9 a minute, 2 at once) it refuses nothing, and all of it goes.
    assert change.refused_before > 10
    assert change.refused_after == 0
    assert change.drain_after_s is not None
    assert after.delivered == 40


def test_installed_advice_holds_the_providers_hosts_together() -> None:
    # The installed condition names the pattern, so every Google MX host shares its
    # concurrency of 2 (issue 17): 2 go at once for both hosts, not 2 for each.
    policy = Shaper.augment(Policy())
    (p,) = plan_advice([_advice(concurrency=2, rate=None)], policy, 0.0)
    with_plan, _ = policy.with_condition(p.counter, p.condition)
    sched = Scheduler(Settings(max_deliveries=100, initial_destination_concurrency=100,
                               default_destination_concurrency_limit=100), with_plan)
    routes = [Route("gmail.com", remotemx="alt1.gmail-smtp-in.l.google.com"),
              Route("googlemail.com", remotemx="aspmx.l.google.com"),
              Route("other.example", remotemx="mx.other.example")]
    jobs = tuple(DeliveryJob(f"j{i}", f"{i:08X}", (f"{i:08X}-0",), routes[i % 3])
                 for i in range(12))
    sent = [c for c in sched.handle(JobsQueued(jobs), 0.0) if isinstance(c, StartDelivery)]
    google = [c for c in sent if c.job.route.remotemx.endswith(".google.com")]
    assert len(google) == 2
    assert len(sent) - len(google) == 4  # the other MX is not the advice's
