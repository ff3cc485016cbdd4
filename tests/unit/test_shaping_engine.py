"""The shaping engine, driven with observations and a fake clock (no I/O)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sluice.scheduler.policy import Rate
from sluice.shaping.engine import Apply, Bounce, Engine, Lift
from sluice.shaping.rules import Action, Backoff, Observation, ReplyMatch, Rule, Trigger, Where

pytestmark = pytest.mark.unit

GMAIL = Where((("remotemx", "*.google.com"),))
RATE = ReplyMatch(code="421", enhanced="4.7.28")


def refused(at: float, mx: str = "alt1.gmail-smtp-in.l.google.com",
            line: str = "421-4.7.28 slow down", **extra: str) -> Observation:
    return Observation.from_line(line, at, recipientdomain="gmail.com", remotemx=mx,
                                 remoteip="127.0.0.1", **extra)


def test_a_reply_line_parses_into_code_enhanced_and_text() -> None:
    obs = Observation.from_line("421-4.7.28 [1.2.3.4] Gmail has detected")
    assert (obs.code, obs.enhanced, obs.text) == (421, "4.7.28", "[1.2.3.4] Gmail has detected")
    assert Observation.from_line("550 no such user").enhanced == ""
    with pytest.raises(ValueError):
        Observation.from_line("hello")


def test_codes_with_x_wildcards_and_phases_match() -> None:
    m = ReplyMatch(code="4xx", enhanced="4.7.x", phases=("rcpt",))
    assert m.matches(Observation(0, 451, "4.7.650", phase="rcpt"))
    assert not m.matches(Observation(0, 451, "4.7.650", phase="data"))
    assert m.matches(Observation(0, 451, "4.7.650"))  # unknown phase matches
    assert not m.matches(Observation(0, 550, "5.7.1"))
    assert not m.matches(Observation(0, 421, "4.2.0"))


def test_immediate_suspend_names_the_provider_pattern_and_expires() -> None:
    rule = Rule("r", Action.SUSPEND, GMAIL, RATE, duration_s=600)
    engine = Engine([rule])
    out = engine.observe(refused(100))
    assert len(out) == 1 and isinstance(out[0], Apply) and out[0].new
    fired = out[0].fired
    assert fired.fields == (("remotemx", "*.google.com"),)
    assert fired.until_at == 700 and fired.reply == "421 4.7.28 slow down"
    assert fired.host == "alt1.gmail-smtp-in.l.google.com"
    assert engine.next_wakeup() == 700
    assert engine.tick(699) == []
    ended = engine.tick(700)
    assert ended == [Lift(fired, "expired")] and engine.active() == []


def test_suspend_tenant_and_job_add_their_field() -> None:
    tenant = Rule("t", Action.SUSPEND_TENANT, GMAIL, RATE)
    job = Rule("j", Action.SUSPEND_JOB, GMAIL, RATE)
    obs = refused(0, tenantid="acme", jobid="camp-7")
    [a] = Engine([tenant]).observe(obs)
    [b] = Engine([job]).observe(obs)
    assert isinstance(a, Apply) and isinstance(b, Apply)
    assert a.fired.fields == (("remotemx", "*.google.com"), ("tenantid", "acme"))
    assert b.fired.fields == (("jobid", "camp-7"),)


def test_a_suspension_on_a_provider_is_one_action_for_all_its_hosts() -> None:
    rule = Rule("r", Action.SUSPEND, GMAIL, RATE, duration_s=600)
    engine = Engine([rule])
    [first] = engine.observe(refused(100, mx="alt1.gmail-smtp-in.l.google.com"))
    [again] = engine.observe(refused(200, mx="aspmx.l.google.com"))
    assert isinstance(first, Apply) and isinstance(again, Apply)
    assert first.new and not again.new  # the same suspension, its end moved
    assert again.fired.key == first.fired.key
    assert again.fired.until_at == 800 and again.fired.host == "aspmx.l.google.com"
    assert [f.fields for f in engine.active()] == [(("remotemx", "*.google.com"),)]


def test_a_literal_where_and_non_host_patterns_suspend_the_values_the_reply_came_with() -> None:
    literal = Rule("l", Action.SUSPEND, Where((("remotemx", "aspmx.l.google.com"),)), RATE)
    [a] = Engine([literal]).observe(refused(0, mx="aspmx.l.google.com"))
    assert isinstance(a, Apply) and a.fired.fields == (("remotemx", "aspmx.l.google.com"),)
    by_ip = Rule("i", Action.SUSPEND, Where((("remoteip", "127.0.0.*"),)), RATE)
    [b] = Engine([by_ip]).observe(refused(0))
    assert isinstance(b, Apply) and b.fired.fields == (("remoteip", "127.0.0.1"),)
    bounce = Rule("b", Action.BOUNCE, GMAIL, RATE)
    [c] = Engine([bounce]).observe(refused(0))
    assert c.fired.fields == (("remotemx", "alt1.gmail-smtp-in.l.google.com"),)


def test_n_matches_within_a_window_per_group() -> None:
    rule = Rule("r", Action.SUSPEND, Where(), ReplyMatch(code="421"),
                Trigger(matches=3, within_s=60))
    engine = Engine([rule])
    assert engine.observe(refused(0)) == []
    assert engine.observe(refused(10)) == []
    # another domain is another group: it does not add to gmail.com's count
    other = Observation(20, 421, "", "x", recipientdomain="yahoo.com")
    assert engine.observe(other) == []
    # the first match slid out of the window: still two
    assert engine.observe(refused(61)) == []
    out = engine.observe(refused(62))
    assert len(out) == 1 and out[0].fired.group == (("recipientdomain", "gmail.com"),)
    # and counting starts afresh
    assert engine.observe(refused(63)) == []
    assert engine.firings == {"r": 1}


def test_a_pattern_group_counts_every_host_of_the_provider_together() -> None:
    rule = Rule("r", Action.BACKOFF, GMAIL, RATE, Trigger(matches=2, within_s=60))
    engine = Engine([rule])
    assert engine.observe(refused(0, mx="alt1.gmail-smtp-in.l.google.com")) == []
    [out] = engine.observe(refused(1, mx="alt2.gmail-smtp-in.l.google.com"))
    assert isinstance(out, Apply) and out.fired.fields == (("remotemx", "*.google.com"),)


def test_backoff_halves_to_the_floor_and_recovers_step_by_step_to_the_ceiling() -> None:
    b = Backoff(factor=0.5, floor_concurrency=2, floor_rate=Rate(1, 1), step_concurrency=2,
                step_rate=4, quiet_s=100, hold_s=0)
    rule = Rule("gm", Action.BACKOFF, GMAIL, RATE, duration_s=1000, backoff=b)
    engine = Engine([rule], ceiling=lambda group: (8, Rate(16, 1)))
    [first] = engine.observe(refused(0))
    assert isinstance(first, Apply)
    assert (first.fired.concurrency, first.fired.rate) == (4, Rate(8, 1))
    [second] = engine.observe(refused(10))
    assert isinstance(second, Apply) and not second.new
    assert (second.fired.concurrency, second.fired.rate) == (2, Rate(4, 1))
    [third] = engine.observe(refused(20))
    assert (third.fired.concurrency, third.fired.rate) == (2, Rate(2, 1))
    engine.observe(refused(30))
    engine.observe(refused(31))
    assert engine.active()[0].rate == Rate(1, 1)  # the floor
    assert engine.backing_off() == 1
    # quiet for 100 s after the last firing: one step up each 100 s
    assert engine.next_wakeup() == 131
    assert engine.tick(130) == []
    [up] = engine.tick(131)
    assert isinstance(up, Apply)
    assert (up.fired.concurrency, up.fired.rate) == (4, Rate(5, 1))
    assert up.fired.until_at == 1131
    [up] = engine.tick(231)
    assert (up.fired.concurrency, up.fired.rate) == (6, Rate(9, 1))
    [up] = engine.tick(331)
    assert (up.fired.concurrency, up.fired.rate) == (8, Rate(13, 1))  # concurrency at ceiling
    [done] = engine.tick(431)
    assert isinstance(done, Lift) and done.why == "recovered"
    assert engine.active() == [] and engine.backing_off() == 0


def test_refusals_within_the_hold_time_decrease_only_once() -> None:
    rule = Rule("gm", Action.BACKOFF, GMAIL, RATE, backoff=Backoff(hold_s=30))
    engine = Engine([rule], ceiling=lambda group: (8, Rate(10, 1)))
    for t in range(0, 29, 2):
        engine.observe(refused(t))
    assert (engine.active()[0].concurrency, engine.active()[0].rate) == (4, Rate(5, 1))
    engine.observe(refused(31))
    assert (engine.active()[0].concurrency, engine.active()[0].rate) == (2, Rate(2, 1))
    assert engine.firings == {"gm": 16}


def test_slow_rates_are_written_as_one_per_interval() -> None:
    rule = Rule("gm", Action.BACKOFF, GMAIL, RATE, backoff=Backoff(floor_rate=Rate(1, 60)))
    engine = Engine([rule], ceiling=lambda group: (1, Rate(1, 4)))
    [out] = engine.observe(refused(0))
    assert out.fired.rate == Rate(1, 8)


def test_a_firing_during_recovery_decreases_again() -> None:
    rule = Rule("gm", Action.BACKOFF, GMAIL, RATE,
                backoff=Backoff(quiet_s=100, step_concurrency=1, hold_s=0))
    engine = Engine([rule], ceiling=lambda group: (8, None))
    engine.observe(refused(0))          # 4
    [up] = engine.tick(100)              # 5
    assert up.fired.concurrency == 5
    [down] = engine.observe(refused(150))
    assert down.fired.concurrency == 2
    assert engine.next_wakeup() == 250


def test_condition_and_bounce_actions() -> None:
    cond = Rule("c", Action.CONDITION, GMAIL, RATE, concurrency=1, rate=Rate(1, 10))
    [a] = Engine([cond]).observe(refused(5))
    assert isinstance(a, Apply) and (a.fired.concurrency, a.fired.rate) == (1, Rate(1, 10))
    gone = Rule("b", Action.BOUNCE, Where(), ReplyMatch(code="5xx", enhanced="5.1.10"))
    engine = Engine([gone])
    [b] = engine.observe(Observation.from_line("556 5.1.10 null MX", 0,
                                               recipientdomain="nomail.example"))
    assert isinstance(b, Bounce) and b.fired.fields == (("recipientdomain", "nomail.example"),)
    assert engine.active() == []


def test_first_matching_rule_wins_and_ignore_consumes_the_reply() -> None:
    grey = Rule("grey", Action.IGNORE, Where(), ReplyMatch(code="4xx", regex="greylist"))
    any4 = Rule("any", Action.SUSPEND, Where(), ReplyMatch(code="4xx"))
    engine = Engine([grey, any4])
    assert engine.observe(Observation.from_line("451 4.7.1 greylisted", 0,
                                                recipientdomain="a.example")) == []
    assert engine.observe(Observation.from_line("451 4.3.0 busy", 0,
                                                recipientdomain="a.example")) != []
    assert engine.firings == {"any": 1}


def test_a_repeated_suspension_moves_its_end_and_keeps_its_start() -> None:
    engine = Engine([Rule("r", Action.SUSPEND, GMAIL, RATE, duration_s=100)])
    engine.observe(refused(0))
    [again] = engine.observe(refused(50))
    assert isinstance(again, Apply) and not again.new
    assert (again.fired.since_at, again.fired.until_at) == (0, 150)
    assert len(engine.active()) == 1


def test_an_operator_lift_ends_the_action() -> None:
    engine = Engine([Rule("r", Action.BACKOFF, GMAIL, RATE)])
    engine.observe(refused(0))
    key = engine.active()[0].key
    [lift] = engine.lift(key, 10)
    assert isinstance(lift, Lift) and lift.why == "lifted"
    assert engine.lift(key, 10) == [] and engine.next_wakeup() is None


def test_replace_keeps_actions_in_force_and_forgets_windows() -> None:
    rule = Rule("r", Action.SUSPEND, GMAIL, RATE, Trigger(matches=2))
    engine = Engine([rule])
    engine.observe(refused(0))
    engine.replace([rule])
    assert engine.observe(refused(1)) == []  # the window started afresh


def test_the_engine_and_rules_are_pure() -> None:
    src = Path(__file__).resolve().parents[2] / "src" / "sluice" / "shaping"
    allowed = {"__future__", "math", "collections", "collections.abc", "dataclasses", "enum", "re",
               "typing"}
    for name in ("engine.py", "rules.py"):
        tree = ast.parse((src / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            for mod in mods:
                assert mod.startswith("sluice.scheduler") or mod.startswith("sluice.shaping") \
                    or mod in allowed, f"{name} imports {mod}"
