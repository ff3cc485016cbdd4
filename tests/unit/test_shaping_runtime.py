"""The shaping adapter against a real (pure) Scheduler: its events hold and free mail,
and `why` tells the rule, the reply and the host."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.model import Delivered, QueueEntry, QueueState, Reply, TempFail
from sluice.queue import AttemptResult
from sluice.scheduler import (
    ConditionAdded,
    ConditionRemoved,
    DeliveryFinished,
    DeliveryJob,
    Event,
    JobsQueued,
    Policy,
    Route,
    Scheduler,
    Settings,
    StartDelivery,
    SuspensionAdded,
    SuspensionRemoved,
    parse_policy,
)
from sluice.scheduler.policy_parse import parse_suspension
from sluice.shaping.runtime import Shaper
from tests.conftest import make_config

pytestmark = pytest.mark.unit

MX = "alt1.gmail-smtp-in.l.google.com"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def entry(qid: str) -> QueueEntry:
    spid, idx = qid.split("-")
    return QueueEntry(spid, int(idx), "s@x.test", "u@gmail.com", QueueState.DELIVERING,
                      0.0, 0.0)


def result(line_code: int, enhanced: str, text: str) -> AttemptResult:
    outcome = TempFail(Reply(line_code, enhanced, text, remote_mta=MX))
    return AttemptResult(entry("0000000A-0"), outcome, attempted=True, remotemx=MX,
                         remoteip="127.0.0.1", localip="")


def setup(tmp: Path, rules: str | None = None) -> tuple[Shaper, Scheduler, list[Event], Clock]:
    sections: dict[str, dict[str, object]] = {}
    if rules is not None:
        path = tmp / "rules.yaml"
        path.write_text(rules)
        sections["delivery"] = {"shaping": str(path), "shaping_defaults": False}
    config = make_config(tmp, **sections)
    sched = Scheduler(Settings(max_deliveries=1000, initial_destination_concurrency=1000,
                               default_destination_concurrency_limit=1000),
                      Shaper.augment(parse_policy(None)))
    events: list[Event] = []
    clock = Clock()
    shaper = Shaper(config, events.append, lambda: sched.policy, clock)
    return shaper, sched, events, clock


def apply(sched: Scheduler, events: list[Event], now: float) -> None:
    for event in events:
        sched.check(event)
        sched.handle(event, now)
    events.clear()


def test_augment_adds_limitless_counters_once() -> None:
    policy = Shaper.augment(Policy())
    assert {c.id for c in policy.counters} == {"shaping-remotemx", "shaping-recipientdomain",
                                               "shaping-remoteip"}
    assert all(c.default.is_empty for c in policy.counters)
    assert Shaper.augment(policy) == policy


def test_gmail_421_backs_off_through_a_condition_and_why_names_rule_reply_and_host(
        tmp_path: Path) -> None:
    shaper, sched, events, clock = setup(tmp_path)
    route = Route("gmail.com", remotemx=MX, remoteip="127.0.0.1")
    shaper.observe(route, [result(421, "4.7.28", "Gmail has detected an unusual rate")] * 3)
    [added] = events
    assert isinstance(added, ConditionAdded) and added.counter_id == "shaping-remotemx"
    assert added.condition.match == (("remotemx", "*.google.com"),)
    assert added.condition.id == "shaping:test-node:gmail-rate:1"  # the node's, in a cluster
    assert added.condition.thresholds.concurrency == 5
    assert added.condition.expires_at == clock.now + 3600
    apply(sched, events, clock.now)
    # Six deliveries queued: five go, the sixth waits on the condition.
    jobs = tuple(DeliveryJob(f"j{i}", f"{i:08X}", (f"{i:08X}-0",), route) for i in range(6))
    started = [c for c in sched.handle(JobsQueued(jobs), clock.now)
               if isinstance(c, StartDelivery)]
    assert len(started) == 5
    text = "\n".join(sched.explain(f"{5:08X}-0", clock.now).lines(clock.now))
    assert "rule gmail-rate" in text and 'after reply "421 4.7.28 Gmail has' in text
    assert f"from host {MX}" in text
    # The condition is on the provider's pattern, and holds for the provider as a
    # whole: another Google MX host shares the same five, so none of its go while
    # the first host's five are in flight, and one goes when one of those ends
    # (a second later, when the rate of 5/1 has room again).
    other = Route("googlemail.com", remotemx="aspmx.l.google.com", remoteip="127.0.0.2")
    jobs = tuple(DeliveryJob(f"k{i}", f"{i + 16:08X}", (f"{i + 16:08X}-0",), other)
                 for i in range(6))
    assert not [c for c in sched.handle(JobsQueued(jobs), clock.now)
                if isinstance(c, StartDelivery)]
    ok = Delivered(Reply(250, "2.0.0", "ok"))
    done = started[0]
    clock.now += 1
    after = [c for c in sched.handle(DeliveryFinished(done.job.ref, ((done.qids[0], ok),)),
                                     clock.now) if isinstance(c, StartDelivery)]
    assert [c.job.route.remotemx for c in after] == ["aspmx.l.google.com"]
    # An operator lifts it: the condition goes.
    key = shaper.active()[0].key
    assert shaper.lift(key)
    [removed] = events
    assert isinstance(removed, ConditionRemoved)
    assert removed.condition_id == added.condition.id


def test_suspend_rule_suspends_the_host_and_expires(tmp_path: Path) -> None:
    shaper, sched, events, clock = setup(tmp_path, (
        "rules:\n  - name: stop\n    where: {mx: '*.google.com'}\n"
        "    reply: {code: 421, regex: 'go away'}\n    action: suspend\n    duration: 10m\n"))
    route = Route("gmail.com", remotemx=MX, remoteip="127.0.0.1")
    shaper.observe(route, [result(421, "4.7.0", "go away")])
    [added] = events
    assert isinstance(added, SuspensionAdded)
    assert added.suspension.fields == (("remotemx", "*.google.com"),)
    apply(sched, events, clock.now)
    # Every destination on a Google MX host waits, not only the host that said it.
    googlemail = Route("googlemail.com", remotemx="aspmx.l.google.com", remoteip="127.0.0.2")
    other = Route("example.com", remotemx="mx.example.com", remoteip="127.0.0.3")
    jobs = (DeliveryJob("j1", "00000001", ("00000001-0",), route),
            DeliveryJob("j2", "00000002", ("00000002-0",), googlemail),
            DeliveryJob("j3", "00000003", ("00000003-0",), other))
    started = [c for c in sched.handle(JobsQueued(jobs), clock.now)
               if isinstance(c, StartDelivery)]
    assert [c.job.ref for c in started] == ["j3"]
    text = "\n".join(sched.explain("00000002-0", clock.now).lines(clock.now))
    assert "suspended by rule stop" in text and "go away" in text
    clock.now += 600
    shaper.tick(clock.now)
    [removed] = events
    assert isinstance(removed, SuspensionRemoved)


def test_delivered_and_unattempted_results_are_not_observed(tmp_path: Path) -> None:
    shaper, _, events, _ = setup(tmp_path)
    route = Route("gmail.com", remotemx=MX)
    ok = AttemptResult(entry("0000000A-0"), Delivered(Reply(250, "2.0.0", "ok")))
    dead = AttemptResult(entry("0000000A-1"), TempFail(Reply(421, "4.7.28", "x")),
                         attempted=False)
    shaper.observe(route, [ok, dead])
    assert events == [] and shaper.engine.firings == {}


def test_a_broken_rules_file_on_reload_keeps_the_running_rules(tmp_path: Path) -> None:
    shaper, _, _, _ = setup(tmp_path, "rules: []\n")
    (tmp_path / "rules.yaml").write_text("rules:\n  - name: x\n")
    assert shaper.reload() is None
    assert shaper.engine.rules == ()
    (tmp_path / "rules.yaml").write_text(
        "rules:\n  - name: x\n    reply: {code: 421}\n    action: suspend\n")
    assert shaper.changed()
    rules = shaper.reload()
    assert rules is not None and [r.name for r in rules] == ["x"]
    assert shaper.loads == 2


def test_the_post_delivery_hook_returns_a_shaping_action(tmp_path: Path) -> None:
    import asyncio

    from sluice.hooks import Hooks, PostDelivery, Shape

    def post(ctx: PostDelivery) -> Shape | None:
        if ctx.outcome.reply.code == 421 and "custom throttle" in ctx.outcome.reply.text:
            return Shape("suspend", duration_s=120, where=("domain", "tenant"),
                         name="custom", note="our own rule")
        return None

    hooks = Hooks(post_delivery=post)
    shaper, _sched, events, clock = setup(tmp_path, "rules: []\n")
    e = QueueEntry("0000000B", 0, "s@x.test", "u@corp.test", QueueState.DELIVERING, 0.0, 0.0,
                   tenantid="acme", domain="corp.test")
    outcome = TempFail(Reply(421, "4.7.0", "custom throttle", remote_mta="mx.corp.test"))
    final = asyncio.run(hooks.run_post_delivery(PostDelivery(e, outcome, remotemx="mx.corp.test")))
    assert final == outcome  # the outcome stays
    shaper.take(hooks)
    [added] = events
    assert isinstance(added, SuspensionAdded)
    assert added.suspension.fields == (("recipientdomain", "corp.test"), ("tenantid", "acme"))
    assert added.suspension.expires_at == clock.now + 120
    assert "rule hook:custom" in added.suspension.reason
    assert hooks.shaping == []
    shaper.take(hooks)
    assert len(events) == 1


def test_ids_name_the_node_and_skip_one_still_in_force(tmp_path: Path) -> None:
    # In a cluster every node's actions reach the others: the id says whose
    # it is, and one this node's last run left in force (given back by the
    # cluster after a restart, while N starts again at 1) is not reused.
    shaper, sched, events, clock = setup(tmp_path, (
        "rules:\n  - name: stop\n    where: {mx: '*.google.com'}\n"
        "    reply: {code: 421, regex: 'go away'}\n    action: suspend\n    duration: 10m\n"))
    shaper.taken = sched.uses_id
    left = SuspensionAdded(parse_suspension({"id": "shaping:test-node:stop:1",
                                             "recipientdomain": "old.test"}))
    apply(sched, [left], clock.now)
    shaper.observe(Route("gmail.com", remotemx=MX, remoteip="127.0.0.1"),
                   [result(421, "4.7.0", "go away")])
    [added] = events
    assert isinstance(added, SuspensionAdded)
    assert added.suspension.id == "shaping:test-node:stop:2"
    assert shaper.id_of(shaper.active()[0]) == "shaping:test-node:stop:2"
    apply(sched, events, clock.now)
    assert sched.uses_id("shaping:test-node:stop:1") and sched.uses_id("shaping:test-node:stop:2")
    assert not sched.uses_id("shaping:test-node:stop:3")


def test_a_condition_rule_on_a_pattern_holds_the_provider_as_a_whole(tmp_path: Path) -> None:
    shaper, sched, events, clock = setup(tmp_path, (
        "rules:\n  - name: gentle\n    where: {mx: '*.google.com'}\n"
        "    reply: {code: 421}\n    action: condition\n"
        "    thresholds: {concurrency: 1}\n    duration: 10m\n"))
    shaper.observe(Route("gmail.com", remotemx=MX), [result(421, "4.7.0", "slow down")])
    [added] = events
    assert isinstance(added, ConditionAdded)
    apply(sched, events, clock.now)
    routes = [Route("gmail.com", remotemx=MX),
              Route("googlemail.com", remotemx="aspmx.l.google.com")]
    jobs = tuple(DeliveryJob(f"c{i}", f"{i + 32:08X}", (f"{i + 32:08X}-0",), routes[i % 2])
                 for i in range(4))
    started = [c for c in sched.handle(JobsQueued(jobs), clock.now)
               if isinstance(c, StartDelivery)]
    assert len(started) == 1  # one for both Google hosts
    # It expires: each host has no limit of its own (shaping-remotemx limits nothing).
    clock.now += 601
    shaper.tick(clock.now)
    more = [c for e in events for c in sched.handle(e, clock.now)
            if isinstance(c, StartDelivery)]
    assert len(more) == 3
