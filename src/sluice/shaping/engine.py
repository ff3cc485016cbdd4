"""The shaping engine: delivery replies and a clock in, actions out.

SUMMARY
    engine = Engine(rules, ceiling)
    commands = engine.observe(observation)   a reply came back
    commands = engine.tick(now)              time passed (expiry, recovery)
    engine.next_wakeup()                     when tick() has something to do
    commands = engine.lift(key, now)         an operator lifted an action
    engine.replace(rules)                    the rules file was reloaded
    engine.active()                          the actions in force

DESCRIPTION
    Sans-IO, like the scheduler: no clock, no sockets.  The runtime
    adapter (sluice.shaping.runtime) feeds it one Observation per reply a
    delivery attempt got and calls tick() at next_wakeup(); it turns the
    commands (Apply, Lift, Bounce) into scheduler events: a suspension
    with an expiry (SuspensionAdded), a policy condition with an expiry
    (ConditionAdded / ConditionRemoved), a bounce of the group's queue.

    The first rule that matches a reply counts it; later rules do not
    (the file is read top to bottom, as a firewall's is).

STRATEGIES
    Sliding window per group.  A trigger "N matches within W" keeps the
    times of the group's recent matches; it fires at the N-th within W
    and starts counting afresh, so that a steady stream of refusals fires
    once per N, not once per refusal after the N-th.

    One action per rule and group (Halon's one suspension per set of
    values).  A firing while the action is in force moves its end (a
    suspension), or lowers the limits once more (a back-off).

    AIMD back-off.  Each firing multiplies the group's concurrency and
    rate by ``factor`` (0.5: halve), never below the floor; after
    ``quiet`` seconds without a firing, each further ``quiet`` seconds
    adds one step (additive increase), and once both are back at the
    ceiling (the policy's own value) the condition is removed.  Halve
    rather than drop to the floor, so that one refusal in a busy hour
    does not stall a provider that takes thousands (TCP's congestion
    control, PowerMTA's backoff mode).

    Every action ends.  An action carries ``until_at``; a back-off's end
    moves with each step, so a forgotten group recovers even if the
    engine stops being ticked (the scheduler expires the condition).

SEE ALSO
    sluice.shaping.rules (the data), docs/shaping.md
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from sluice.scheduler.policy import Rate
from sluice.shaping.rules import Action, Observation, Rule

__all__ = ["Apply", "Bounce", "Ceiling", "Command", "Engine", "Fired", "Lift", "group_text"]

#: (concurrency, rate) the policy allows a group; None where it sets none.
Ceiling = Callable[[tuple[tuple[str, str], ...]], tuple[int | None, Rate | None]]

def group_text(fields: Iterable[tuple[str, str]]) -> str:
    """A group's fields as ``name=value`` pairs joined by commas."""
    return ",".join(f"{k}={v}" for k, v in fields)


@dataclass(frozen=True, slots=True)
class Fired:
    """An automatic action in force, as operators see it.

    ``fields`` is what the suspension or condition names; ``reply`` and
    ``host`` are what set it off; ``concurrency``/``rate`` are a back-off's
    or condition's current limits.
    """

    key: str
    rule: str
    action: Action
    group: tuple[tuple[str, str], ...]
    fields: tuple[tuple[str, str], ...]
    since_at: float
    until_at: float
    reply: str
    host: str
    concurrency: int | None = None
    rate: Rate | None = None
    note: str = ""


@dataclass(frozen=True, slots=True)
class Apply:
    """Put ``fired`` in force (or change the one with the same key)."""

    fired: Fired
    new: bool


@dataclass(frozen=True, slots=True)
class Lift:
    """End ``fired``: ``why`` is "expired", "recovered" or "lifted"."""

    fired: Fired
    why: str


@dataclass(frozen=True, slots=True)
class Bounce:
    """Bounce the queued mail of ``fired.fields`` with ``fired.reply``."""

    fired: Fired


Command = Apply | Lift | Bounce


@dataclass(slots=True)
class _Aimd:
    ceiling_c: int
    ceiling_r: float  # pickups a second
    per_s: float
    c: int
    r: float
    last_fire_at: float
    last_step_at: float


def _no_ceiling(_: tuple[tuple[str, str], ...]) -> tuple[int | None, Rate | None]:
    return None, None


def _rate(per_second: float) -> Rate:
    """A Rate near ``per_second`` over the shortest whole window: "5/1", not "300/60".

    A rate is a sliding window, and "300/60" lets 300 go in the first second.
    """
    if per_second >= 1:
        return Rate(round(per_second), 1.0)
    return Rate(1, float(round(1.0 / per_second)))


class Engine:
    """Rules, their match windows, and the actions in force."""

    def __init__(self, rules: Sequence[Rule], ceiling: Ceiling | None = None) -> None:
        self.rules: tuple[Rule, ...] = tuple(rules)
        self.ceiling: Ceiling = ceiling or _no_ceiling
        self._windows: dict[tuple[str, str], deque[float]] = {}
        self._active: dict[str, Fired] = {}
        self._aimd: dict[str, _Aimd] = {}
        #: Firings per rule name since start (for /metrics).
        self.firings: dict[str, int] = {}

    # -- input ---------------------------------------------------------------------------

    def replace(self, rules: Sequence[Rule]) -> None:
        """New rules; match windows start afresh, actions in force run to their end."""
        self.rules = tuple(rules)
        self._windows.clear()

    def observe(self, obs: Observation) -> list[Command]:
        """Count ``obs`` under the first rule it matches; fire if the trigger says so."""
        for rule in self.rules:
            if not rule.matches(obs):
                continue
            if rule.action is Action.IGNORE:
                return []
            group = rule.group(obs)
            wkey = (rule.name, group_text(group))
            window = self._windows.setdefault(wkey, deque())
            window.append(obs.at)
            while window and window[0] <= obs.at - rule.trigger.within_s:
                window.popleft()
            if len(window) < rule.trigger.matches:
                return []
            window.clear()
            return self.fire(rule, obs)
        return []

    def fire(self, rule: Rule, obs: Observation) -> list[Command]:
        """Take ``rule``'s action for ``obs`` now (a trigger fired, or a hook said so)."""
        self.firings[rule.name] = self.firings.get(rule.name, 0) + 1
        group = rule.group(obs)
        key = f"{rule.name}:{group_text(group)}"
        if rule.action.suspends:
            key = f"{rule.name}:{group_text(rule.concrete(obs))}"
        old = self._active.get(key)
        host = obs.remotemx or obs.remoteip
        base = Fired(key, rule.name, rule.action, group, group, obs.at,
                     obs.at + rule.duration_s, obs.reply_text, host, note=rule.note)
        match rule.action:
            case Action.IGNORE:
                return []
            case Action.SUSPEND | Action.SUSPEND_TENANT | Action.SUSPEND_JOB:
                fired = replace(base, fields=rule.concrete(obs))
            case Action.BOUNCE:
                fired = replace(base, fields=rule.concrete(obs))
                return [Bounce(fired)]
            case Action.CONDITION:
                fired = replace(base, concurrency=rule.concurrency, rate=rule.rate)
            case Action.BACKOFF:
                fired = self._decrease(rule, base)
        if old is not None:
            fired = replace(fired, since_at=old.since_at)
        self._active[key] = fired
        return [Apply(fired, new=old is None)]

    def _decrease(self, rule: Rule, base: Fired) -> Fired:
        b = rule.backoff
        state = self._aimd.get(base.key)
        if state is None:
            conc, rate = self.ceiling(base.group)
            rate = rate or b.start_rate
            ceiling_c = conc if conc is not None else b.start_concurrency
            ceiling_r = rate.count / rate.per_s
            state = _Aimd(ceiling_c, ceiling_r, rate.per_s, ceiling_c, ceiling_r,
                          -math.inf, -math.inf)
            self._aimd[base.key] = state
        else:
            if base.since_at < state.last_fire_at + b.hold_s:
                # Refusals of deliveries already under way: no new news.
                state.last_step_at = base.since_at
                return replace(base, concurrency=state.c, rate=_rate(state.r))
        floor_r = b.floor_rate.count / b.floor_rate.per_s
        state.c = max(b.floor_concurrency, min(state.c, int(state.c * b.factor)))
        state.r = max(floor_r, state.r * b.factor)
        state.last_fire_at = state.last_step_at = base.since_at
        return replace(base, concurrency=state.c, rate=_rate(state.r))

    def lift(self, key: str, now: float) -> list[Command]:
        """An operator ends an action before its time."""
        fired = self._active.pop(key, None)
        self._aimd.pop(key, None)
        return [] if fired is None else [Lift(fired, "lifted")]

    # -- time ----------------------------------------------------------------------------

    def tick(self, now: float) -> list[Command]:
        """End what expired; step back-offs up after a quiet period."""
        out: list[Command] = []
        for key, fired in list(self._active.items()):
            state = self._aimd.get(key)
            if state is not None and fired.action is Action.BACKOFF:
                rule = self._rule(fired.rule)
                quiet = rule.backoff.quiet_s if rule else 300.0
                if now >= state.last_fire_at + quiet and now >= state.last_step_at + quiet:
                    out.extend(self._increase(key, fired, state, rule, now))
                    continue
            if fired.until_at <= now:
                del self._active[key]
                self._aimd.pop(key, None)
                out.append(Lift(fired, "expired"))
        return out

    def _increase(self, key: str, fired: Fired, state: _Aimd, rule: Rule | None,
                  now: float) -> list[Command]:
        step_c = rule.backoff.step_concurrency if rule else 1
        step_r = (rule.backoff.step_rate if rule else 10) / state.per_s
        state.c = min(state.ceiling_c, state.c + step_c)
        state.r = min(state.ceiling_r, state.r + step_r)
        state.last_step_at = now
        if state.c >= state.ceiling_c and state.r >= state.ceiling_r:
            del self._active[key]
            del self._aimd[key]
            return [Lift(fired, "recovered")]
        duration = rule.duration_s if rule else fired.until_at - fired.since_at
        changed = replace(fired, concurrency=state.c, rate=_rate(state.r),
                          until_at=now + duration)
        self._active[key] = changed
        return [Apply(changed, new=False)]

    def next_wakeup(self) -> float | None:
        """When tick() next has something to do (an action ends, a back-off steps); None: never."""
        times: list[float] = []
        for key, fired in self._active.items():
            times.append(fired.until_at)
            state = self._aimd.get(key)
            rule = self._rule(fired.rule)
            if state is not None:
                quiet = rule.backoff.quiet_s if rule else 300.0
                times.append(max(state.last_fire_at, state.last_step_at) + quiet)
        return min(times) if times else None

    # -- views ---------------------------------------------------------------------------

    def active(self) -> list[Fired]:
        """The actions in force, oldest first."""
        return sorted(self._active.values(), key=lambda f: (f.since_at, f.key))

    def backing_off(self) -> int:
        """How many groups a back-off action holds."""
        return sum(1 for f in self._active.values() if f.action is Action.BACKOFF)

    def _rule(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.name == name), None)
