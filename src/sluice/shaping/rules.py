"""Shaping rules as data: where a reply came from, what it said, what to do.

SUMMARY
    rule = Rule(name, where=Where(...), reply=ReplyMatch(...), trigger=Trigger(...),
                action=Action.BACKOFF, duration_s=..., backoff=Backoff(...))
    rule.matches(observation)          does this attempt's reply concern the rule?
    rule.group(observation)            the destination group it counts under

DESCRIPTION
    A rule has four parts (KumoMTA's traffic shaping automation, Halon's
    delivery hooks): *where* (recipient domain, MX host, remote IP, local
    IP, tenant, job; any combination, wildcards like ``*.google.com``),
    *what was said* (basic code, enhanced code, a regex on the text, the
    SMTP phase), a *trigger* (at once, or N matches within a window, per
    group) and an *action* (suspend the group, the tenant at the group or
    the job; back off; add a policy condition; bounce what is queued).

    An Observation is what one delivery attempt told us: the route's
    fields and the reply.  It is built by the runtime adapter from a
    delivery result; the engine (sluice.shaping.engine) only reads it.

STRATEGIES
    A group is what the rule names, as written.  A rule on
    ``mx: "*.google.com"`` counts every Gmail MX host as one group, so
    that five hosts each saying "slow down" once is five matches, not
    five groups with one each; a rule on a literal names one value; a
    rule with no *where* counts per recipient domain.  The action then
    names the group: a back-off condition matches ``*.google.com`` (the
    policy's conditions take patterns), and so does a suspension for a
    pattern on ``remotemx`` or ``recipientdomain`` (the scheduler's
    suspensions take host name patterns there): one Gmail host saying
    "stop" holds gmail.com and googlemail.com on every Gmail MX host.
    Other fields (a tenant, a job, a pattern on an IP) take the values
    the reply came with, as does a bounce.

    Host name patterns are checked (sluice.scheduler.policy.host_pattern):
    ``*``, ``*.``, or one with spaces or commas is refused when the file
    is read, not when the first suspension would be made.

    Unknown phase matches.  The delivery client marks each reply with
    its phase (sluice.model.Reply.phase); a reply without one (Sluice's
    own SIZE or SMTPUTF8 refusal, a hook's verdict) matches a rule with
    a phase list: a rule restricted to RCPT must not go silent because
    the source is vague.

    Pure: the standard library only (no clock, no I/O), like the
    scheduler it feeds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from sluice.scheduler.policy import PATTERN_SUSPENSION_FIELDS, Pattern, Rate, host_pattern

__all__ = [
    "WHERE_FIELDS",
    "Action",
    "Backoff",
    "Observation",
    "ReplyMatch",
    "Rule",
    "Trigger",
    "Where",
]

#: A rule's *where* keys and the policy field (sluice.scheduler.policy.FIELDS) each names.
WHERE_FIELDS: dict[str, str] = {
    "domain": "recipientdomain",
    "mx": "remotemx",
    "remoteip": "remoteip",
    "localip": "localip",
    "tenant": "tenantid",
    "job": "jobid",
}

#: SMTP phases a reply can come in (sluice.model.Reply.phase, set by the
#: delivery client): the greeting, EHLO/HELO/LHLO and STARTTLS, MAIL FROM,
#: RCPT TO, DATA (up to 354), and the final dot.
PHASES = ("connect", "helo", "mail", "rcpt", "data", "end-of-data")

_REPLY_RE = re.compile(r"^([2-5][0-9]{2})[ -]?(?:([2-5]\.[0-9]{1,3}\.[0-9]{1,3})\b)?(.*)$", re.S)


class Action(StrEnum):
    """What a rule does when it fires."""
    IGNORE = "ignore"  # the reply is this rule's, and nothing happens (greylisting)
    SUSPEND = "suspend"
    SUSPEND_TENANT = "suspend-tenant"
    SUSPEND_JOB = "suspend-job"
    BACKOFF = "backoff"
    CONDITION = "condition"
    BOUNCE = "bounce"

    @property
    def suspends(self) -> bool:
        """Whether the action is a suspension (of the group, its tenant or its job)."""
        return self in (Action.SUSPEND, Action.SUSPEND_TENANT, Action.SUSPEND_JOB)


@dataclass(frozen=True, slots=True)
class Observation:
    """One delivery attempt's reply and where it came from."""

    at: float
    code: int
    enhanced: str = ""
    text: str = ""
    phase: str = ""
    recipientdomain: str = ""
    remotemx: str = ""
    remoteip: str = ""
    localip: str = ""
    tenantid: str = ""
    jobid: str = ""

    @classmethod
    def from_line(cls, line: str, at: float = 0.0, **where: str) -> Observation:
        """An observation of a reply written as one line ("421-4.7.28 text")."""
        m = _REPLY_RE.match(line.strip())
        if m is None:
            raise ValueError(f"{line!r} is not an SMTP reply")
        return cls(at, int(m.group(1)), m.group(2) or "", m.group(3).strip(), **where)

    def value(self, policy_field: str) -> str:
        """The value of a policy field (``recipientdomain``, ``remotemx``, ...)."""
        value: str = getattr(self, policy_field)
        return value

    @property
    def reply_text(self) -> str:
        """The reply as one line, as an operator reads it."""
        return " ".join(p for p in (str(self.code), self.enhanced, self.text) if p)


@dataclass(frozen=True, slots=True)
class Where:
    """Policy field -> literal or pattern, as written in the rule."""

    fields: tuple[tuple[str, str], ...] = ()
    _matchers: tuple[tuple[str, str | Pattern], ...] = field(default=(), compare=False,
                                                             repr=False)

    def __post_init__(self) -> None:
        matchers: list[tuple[str, str | Pattern]] = []
        for name, value in self.fields:
            if name not in WHERE_FIELDS.values():
                raise ValueError(f"unknown field {name!r}")
            if Pattern.is_pattern(value):
                matchers.append((name, host_pattern(value) if name in PATTERN_SUSPENSION_FIELDS
                                 else Pattern.compile(value)))
            else:
                matchers.append((name, value.lower().rstrip(".")
                                 if name in ("recipientdomain", "remotemx") else value))
        object.__setattr__(self, "_matchers", tuple(matchers))

    def matches(self, obs: Observation) -> bool:
        """Whether every field of ``obs`` the rule names has the value or fits the pattern.

        Domain names compare without case or a trailing dot.
        """
        for name, want in self._matchers:
            have = obs.value(name)
            if isinstance(want, Pattern):
                if not want.matches(have):
                    return False
            elif (have.lower().rstrip(".") if name in ("recipientdomain", "remotemx")
                  else have) != want:
                return False
        return True


@dataclass(frozen=True, slots=True)
class ReplyMatch:
    """Code (``421``, ``4xx``), enhanced code (``4.7.28``, ``4.7.x``), regex, phases."""

    code: str = ""
    enhanced: str = ""
    regex: str = ""
    phases: tuple[str, ...] = ()
    _rx: re.Pattern[str] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for phase in self.phases:
            if phase not in PHASES:
                raise ValueError(f"unknown phase {phase!r}")
        if self.regex:
            try:
                rx = re.compile(self.regex, re.IGNORECASE)
            except re.error as exc:
                raise ValueError(f"bad regular expression {self.regex!r}: {exc}") from None
            object.__setattr__(self, "_rx", rx)

    @staticmethod
    def _code_matches(want: str, have: str) -> bool:
        if not want:
            return True
        want_parts, have_parts = want.split("."), have.split(".")
        if len(want_parts) != len(have_parts):
            return False
        for w, h in zip(want_parts, have_parts, strict=True):
            if w.lower() == "x":
                continue
            if "x" in w.lower():
                if len(w) != len(h) or any(c not in ("x", "X", d) for c, d in zip(w, h,
                                                                                   strict=True)):
                    return False
            elif w != h:
                return False
        return True

    def matches(self, obs: Observation) -> bool:
        """Whether the reply of ``obs`` has the code, enhanced code, phase and text asked for."""
        if not self._code_matches(self.code, str(obs.code)):
            return False
        if self.enhanced and not self._code_matches(self.enhanced, obs.enhanced):
            return False
        if self.phases and obs.phase and obs.phase not in self.phases:
            return False
        return self._rx is None or self._rx.search(
            " ".join(p for p in (obs.enhanced, obs.text) if p)) is not None


@dataclass(frozen=True, slots=True)
class Trigger:
    """Fire at the ``matches``-th match within ``within_s`` seconds, per group."""

    matches: int = 1
    within_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.matches < 1 or self.within_s <= 0:
            raise ValueError("a trigger needs matches >= 1 and a positive window")


_FLOOR_RATE = Rate(1, 60.0)
_START_RATE = Rate(600, 60.0)


@dataclass(frozen=True, slots=True)
class Backoff:
    """AIMD: multiply by ``factor`` on a firing, add a step after a quiet period.

    Decrease at most once per ``hold_s``: the refusals of deliveries that
    were already in flight when the first came back say nothing new
    (TCP halves its window once per round trip, not once per lost packet).

    The ceiling is the policy's value for the group (the runtime says it);
    ``start_*`` stands in where the policy sets none.
    """

    factor: float = 0.5
    floor_concurrency: int = 1
    floor_rate: Rate = _FLOOR_RATE
    start_concurrency: int = 10
    start_rate: Rate = _START_RATE
    step_concurrency: int = 1
    step_rate: int = 10
    quiet_s: float = 300.0
    hold_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.factor < 1:
            raise ValueError("factor must be between 0 and 1")
        if self.floor_concurrency < 1 or self.step_concurrency < 1 or self.step_rate < 1:
            raise ValueError("floors and steps must be at least 1")


@dataclass(frozen=True, slots=True)
class Rule:
    """One shaping rule: which replies from where, when it fires, and what it does."""
    name: str
    action: Action
    where: Where = Where()
    reply: ReplyMatch = ReplyMatch()
    trigger: Trigger = Trigger()
    duration_s: float = 3600.0
    backoff: Backoff = Backoff()
    concurrency: int | None = None
    rate: Rate | None = None
    note: str = ""
    test: str = ""

    def matches(self, obs: Observation) -> bool:
        """Whether ``obs`` comes from where the rule looks and has a reply it matches."""
        return self.where.matches(obs) and self.reply.matches(obs)

    def group(self, obs: Observation) -> tuple[tuple[str, str], ...]:
        """The group ``obs`` counts under.

        The *where* fields as written (a pattern stays a pattern), or the
        recipient domain.
        """
        if not self.where.fields:
            return (("recipientdomain", obs.recipientdomain.lower().rstrip(".")),)
        return tuple(sorted(self.where.fields))

    def concrete(self, obs: Observation) -> tuple[tuple[str, str], ...]:
        """The fields a suspension or bounce names, with values.

        The values ``obs`` came with, except that a suspension keeps a
        host name pattern the rule's *where* gives for ``remotemx`` or
        ``recipientdomain`` (``*.google.com``): it holds the provider's
        every MX host, not the one that answered.
        """
        names = [n for n, _ in self.group(obs)]
        if self.action is Action.SUSPEND_TENANT and "tenantid" not in names:
            names.append("tenantid")
        if self.action is Action.SUSPEND_JOB:
            names = ["jobid"]
        written = dict(self.where.fields)

        def value(name: str) -> str:
            want = written.get(name, "")
            if (self.action.suspends and name in PATTERN_SUSPENSION_FIELDS
                    and Pattern.is_pattern(want)):
                return want
            return obs.value(name)

        return tuple(sorted((n, value(n)) for n in names))
