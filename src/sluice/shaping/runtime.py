"""The shaping adapter: delivery results in, scheduler events and audit records out.

SUMMARY
    shaper = Shaper(config, share, policy, clock)
    policy = shaper.augment(policy)          add the counters back-offs need
    shaper.observe(route, results)           after every delivery attempt
    shaper.tick(now); shaper.next_wakeup()   from the queue manager's loop
    shaper.reload(raise_errors=False)        SIGHUP, file change, API
    shaper.lift(key, who)                    an operator ends an action early
    shaper.active(); shaper.explain(fired)   what is in force, in words

DESCRIPTION
    The thin, impure half of sluice.shaping: it reads the rules file,
    turns each delivery result into an Observation for the Engine, and
    turns the engine's commands into the scheduler's own events -- a
    suspension with an expiry (SuspensionAdded / SuspensionRemoved), a
    condition with an expiry on a counter over the group's fields
    (ConditionAdded / ConditionRemoved), a bounce of the group's queued
    mail -- handed to the queue manager like an operator's change
    (QueueManager.share: in a cluster the other nodes get them too).
    Every firing, end and reload is written to the audit history when an
    AuditLog is attached (the API server attaches its own); only here, on
    the node whose rule fired: the other nodes apply the change unaudited.

STRATEGIES
    Counters for back-off are added, not required.  A condition needs a
    counter over its fields; a policy with none over ``remotemx`` (or
    ``recipientdomain``) gets one named ``shaping-remotemx`` with no limit
    of its own (augment()), so the shipped rules work with no policy at
    all.  augment() runs on every policy load, so a reload keeps them.

    The phase comes with the reply.  The delivery client marks each reply
    with the SMTP phase it answered (Reply.phase); the observation carries
    it, so a rule with ``phase: [rcpt]`` sees only RCPT refusals.  A reply
    Sluice made itself without a phase (a SIZE refusal, a hook's verdict)
    has none, and matches any phase list (sluice.shaping.rules).

    Ids name the node.  An action's suspension or condition is
    ``shaping:NODE:RULE:N`` (NODE is node.id, N counts this process's
    actions), so that two nodes' actions never share an id: a change
    from another node with the same id would replace ours.  An id still
    in force is skipped: after a restart the cluster gives this node back
    the actions its last run left, and N starts again from 1.

    One observation per reply per attempt.  A 421 at connect is the same
    reply for every recipient of the transaction: it is counted once,
    not once per recipient.

    Outcomes of attempts that made no connection (a dead destination's
    deferral, a hook's decision) are not replies from the destination
    and are not observed.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sluice.api.audit import AuditAction
from sluice.model import Delivered
from sluice.scheduler.events import (
    ConditionAdded,
    ConditionRemoved,
    Event,
    Route,
    SuspensionAdded,
    SuspensionRemoved,
)
from sluice.scheduler.policy import (
    Condition,
    Counter,
    FieldSpec,
    Policy,
    Rate,
    Suspension,
    Thresholds,
)
from sluice.shaping.advice_apply import counter_for
from sluice.shaping.engine import Apply, Bounce, Command, Engine, Fired, Lift
from sluice.shaping.rulefile import ShapingError, load_rules
from sluice.shaping.rules import WHERE_FIELDS, Action, Observation, Rule, Where

if TYPE_CHECKING:
    from sluice.api.audit import AuditLog
    from sluice.config import Config
    from sluice.hooks import Hooks, PostDelivery, Shape
    from sluice.queue import AttemptResult

__all__ = ["Shaper", "describe"]

log = logging.getLogger("sluice.shaping")

#: The counters augment() adds when the policy has none over these fields.
SHAPING_COUNTERS = ("remotemx", "recipientdomain", "remoteip")


def _at(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def describe(fired: Fired) -> str:
    """One line: "suspended by rule R until T after reply "Y" from host H"."""
    verb = {Action.BACKOFF: "backed off", Action.CONDITION: "limited",
            Action.BOUNCE: "bounced"}.get(fired.action, "suspended")
    parts = []
    if fired.concurrency is not None:
        parts.append(f"concurrency {fired.concurrency}")
    if fired.rate is not None:
        parts.append(f"rate {fired.rate}")
    limits = f" to {', '.join(parts)}" if parts else ""
    host = f" from host {fired.host}" if fired.host else ""
    return (f"{verb}{limits} by rule {fired.rule} until {_at(fired.until_at)} after reply "
            f"\"{fired.reply}\"{host}")


def fired_data(fired: Fired) -> dict[str, Any]:
    """An action in force as plain data (API, audit, `sluice shaping status`)."""
    return {"key": fired.key, "rule": fired.rule, "action": str(fired.action),
            "group": dict(fired.group), "fields": dict(fired.fields),
            "since_at": fired.since_at, "until_at": fired.until_at, "reply": fired.reply,
            "host": fired.host, "concurrency": fired.concurrency,
            "rate": str(fired.rate) if fired.rate is not None else None,
            "note": fired.note, "text": describe(fired)}


def hook_rule(shape: Shape, ctx: PostDelivery) -> Rule:
    """The rule a post-delivery hook's Shape stands for.

    Its group is the attempt's own values of the fields it names.
    """
    entry = ctx.entry
    values = {"domain": entry.domain, "mx": ctx.remotemx, "remoteip": ctx.remoteip,
              "localip": ctx.localip, "tenant": entry.tenantid, "job": entry.jobid}
    where = Where(tuple(sorted((WHERE_FIELDS[k], values[k]) for k in shape.where)))
    rate = None
    if shape.rate:
        count, _, per = shape.rate.partition("/")
        rate = Rate(int(count), float(per) if per else 1.0)
    return Rule(f"hook:{shape.name or shape.action}", Action(shape.action), where,
                duration_s=shape.duration_s, concurrency=shape.concurrency, rate=rate,
                note=shape.note)


class Shaper:
    """The engine, wired to a queue manager."""

    def __init__(self, config: Config, share: Callable[[Event], None],
                 policy: Callable[[], Policy], clock: Callable[[], float]) -> None:
        self.path = config.delivery.shaping
        self.defaults = config.delivery.shaping_defaults
        #: Applies a change here and gives it to the other nodes (QueueManager.share).
        self.share = share
        self.node = config.node.id
        self.policy = policy
        self.clock = clock
        self.audit: AuditLog | None = None
        #: Bounce the queued mail of a group: set by the queue manager.
        self.bounce: Callable[[Fired], None] | None = None
        #: Whether an id is in force already (set by the queue manager): one
        #: this node's earlier run made still holds, read back from the cluster.
        self.taken: Callable[[str], bool] = lambda sid: False
        self._mtime = self._stat()
        self._ids: dict[str, str] = {}
        self._seq = itertools.count(1)
        self.engine = Engine(load_rules(self.path, defaults=self.defaults), self._ceiling)
        self.loads = 1

    # -- rules ----------------------------------------------------------------------------

    def _stat(self) -> float | None:
        if not self.path:
            return None
        try:
            return os.stat(self.path).st_mtime
        except OSError:
            return None

    def changed(self) -> bool:
        """Whether the rules file changed on disk since it was read."""
        mtime = self._stat()
        if mtime == self._mtime:
            return False
        self._mtime = mtime
        return True

    def reload(self, *, who: str = "sluice", raise_errors: bool = False
               ) -> tuple[Rule, ...] | None:
        """Read the rules again; on error keep the running ones."""
        try:
            rules = load_rules(self.path, defaults=self.defaults)
        except ShapingError as exc:
            log.error("shaping rules not reloaded, keeping the running ones:\n%s", exc)
            self._audit(who, "shaping.reload", self.path or "(defaults)", "refused",
                        None, {"error": str(exc)})
            if raise_errors:
                raise
            return None
        before = [r.name for r in self.engine.rules]
        changed = rules != self.engine.rules
        self.engine.replace(rules)
        self.loads += 1
        if self.path or changed:
            # Without an own file, a policy reload (which reloads these too)
            # that changes nothing here leaves no shaping record.
            self._audit(who, "shaping.reload", self.path or "(defaults)", "reloaded", before,
                        [r.name for r in rules])
        log.info("shaping rules reloaded: %d rules", len(rules))
        return rules

    # -- policy ---------------------------------------------------------------------------

    @staticmethod
    def augment(policy: Policy) -> Policy:
        """``policy`` with a limitless counter over each field a back-off may name."""
        have = {c.field_names for c in policy.counters}
        extra = tuple(Counter((FieldSpec(name),), id=f"shaping-{name}")
                      for name in SHAPING_COUNTERS if (name,) not in have)
        if not extra:
            return policy
        return Policy(policy.counters + extra, policy.suspensions, policy.source)

    def _counter(self, fields: Iterable[tuple[str, str]]) -> Counter | None:
        return counter_for(self.policy(), (n for n, _ in fields))

    def _ceiling(self, group: tuple[tuple[str, str], ...]) -> tuple[Any, Any]:
        counter = self._counter(group)
        if counter is None:
            return None, None
        th = counter.default
        want = dict(group)
        for cond in counter.conditions:
            if cond.id.startswith("shaping:"):
                continue
            if all(want.get(k) == v for k, v in cond.match):
                th = cond.thresholds
                break
        return th.concurrency, th.rate

    # -- input ----------------------------------------------------------------------------

    def observe(self, route: Route, results: Iterable[AttemptResult]) -> None:
        """Feed the engine the failed attempts of one route, each distinct reply once."""
        seen: set[tuple[int, str, str, str, str]] = set()
        now = self.clock()
        for res in results:
            if not res.attempted or isinstance(res.outcome, Delivered):
                continue
            reply = res.outcome.reply
            mx = res.remotemx or route.remotemx
            key = (reply.code, reply.enhanced, reply.text, reply.phase, mx)
            if key in seen:
                continue
            seen.add(key)
            obs = Observation(now, reply.code, reply.enhanced, reply.text, reply.phase,
                              route.recipientdomain, mx or reply.remote_mta,
                              res.remoteip or route.remoteip, res.localip or "",
                              route.tenantid, route.jobid)
            self._run(self.engine.observe(obs))

    def take(self, hooks: Hooks) -> None:
        """Take the actions the post-delivery hook returned (Shape) since the last call."""
        requests, hooks.shaping[:] = list(hooks.shaping), []
        for shape, ctx in requests:
            try:
                rule = hook_rule(shape, ctx)
            except (ValueError, KeyError) as exc:
                log.error("post-delivery hook: bad Shape %r: %s", shape, exc)
                continue
            reply = ctx.outcome.reply
            entry = ctx.entry
            obs = Observation(self.clock(), reply.code, reply.enhanced, reply.text, reply.phase,
                              entry.domain, ctx.remotemx or reply.remote_mta, ctx.remoteip,
                              ctx.localip, entry.tenantid, entry.jobid)
            self._run(self.engine.fire(rule, obs), who="hook")

    def tick(self, now: float) -> None:
        """End the actions due to end at ``now`` and step back-offs, if any is due."""
        wake = self.engine.next_wakeup()
        if wake is not None and wake <= now:
            self._run(self.engine.tick(now))

    def next_wakeup(self) -> float | None:
        """When tick() next has something to do; None if never."""
        return self.engine.next_wakeup()

    def lift(self, key: str, who: str = "sluice") -> bool:
        """End the action ``key`` now; whether there was one."""
        commands = self.engine.lift(key, self.clock())
        self._run(commands, who=who)
        return bool(commands)

    # -- output ---------------------------------------------------------------------------

    def _id(self, fired: Fired) -> str:
        sid = self._ids.get(fired.key)
        if sid is None:
            node = f"{self.node}:" if self.node else ""
            sid = f"shaping:{node}{fired.rule}:{next(self._seq)}"
            while self.taken(sid):
                sid = f"shaping:{node}{fired.rule}:{next(self._seq)}"
            self._ids[fired.key] = sid
        return sid

    def _run(self, commands: list[Command], who: str = "shaping") -> None:
        for cmd in commands:
            match cmd:
                case Apply(fired=fired, new=new):
                    self._apply(fired)
                    if new:
                        log.warning("shaping: %s (%s)", describe(fired),
                                    ",".join(f"{k}={v}" for k, v in fired.fields))
                        self._audit(who, "shaping.fire", self._id(fired), fired.note,
                                    None, fired_data(fired))
                case Lift(fired=fired, why=why):
                    self._remove(fired)
                    log.info("shaping: %s ended (%s)", self._ids.get(fired.key, fired.key), why)
                    self._audit(who, "shaping.end", self._id(fired), why, fired_data(fired),
                                None)
                    self._ids.pop(fired.key, None)
                case Bounce(fired=fired):
                    log.warning("shaping: bouncing the queue of %s: %s",
                                dict(fired.fields), describe(fired))
                    self._audit(who, "shaping.bounce", ",".join(f"{k}={v}" for k, v
                                                               in fired.fields),
                                fired.note, None, fired_data(fired))
                    if self.bounce is not None:
                        self.bounce(fired)

    def _apply(self, fired: Fired) -> None:
        sid = self._id(fired)
        reason = describe(fired)
        if fired.action.suspends:
            self.share(SuspensionAdded(Suspension(fired.fields, sid, fired.until_at,
                                                 "shaping", reason)))
            return
        counter = self._counter(fired.fields)
        if counter is None:
            log.error("shaping rule %s: no counter over %s in the policy; back-off not "
                      "applied", fired.rule, ",".join(n for n, _ in fired.fields))
            return
        thresholds = Thresholds(concurrency=fired.concurrency, rate=fired.rate)
        self.share(ConditionAdded(counter.id, Condition(fired.fields, thresholds, sid,
                                                       fired.until_at, "shaping", reason)))

    def _remove(self, fired: Fired) -> None:
        sid = self._ids.get(fired.key)
        if sid is None:
            return
        if fired.action.suspends:
            self.share(SuspensionRemoved(sid))
            return
        counter = self._counter(fired.fields)
        if counter is not None:
            self.share(ConditionRemoved(counter.id, sid))

    def _audit(self, who: str, action: str, target: str, reason: str, before: Any,
               after: Any) -> None:
        if self.audit is None:
            return
        try:
            self.audit.append(who, AuditAction(action), target, reason, before, after,
                              reversible=False, now=self.clock())
        except OSError as exc:
            log.error("shaping: audit record not written: %s", exc)

    # -- views ----------------------------------------------------------------------------

    def active(self) -> list[Fired]:
        """The actions in force, oldest first."""
        return self.engine.active()

    def id_of(self, fired: Fired) -> str:
        """The id the audit history and `why` give the action (``shaping:NODE:RULE:N``)."""
        return self._ids.get(fired.key, fired.key)
