r"""Pickup policies: counters over fields, conditions, groups and thresholds.

SUMMARY
    Policy, Counter, FieldSpec, Group, Pattern, Condition, Thresholds,
    Rate, Suspension: a pickup policy as frozen data.  Policy.with_condition
    and .without_condition for the conditions added and removed at run
    time.  sluice.scheduler.policy_parse turns plain data into these.

DESCRIPTION
    A policy is a list of *counters*.  A counter names *fields* of a
    delivery (FIELDS below); every distinct combination of their values is
    one counter *entry*, and each entry has thresholds:

    concurrency      deliveries of the entry in flight at once;
    rate             "X/Y": at most X pickups in any Y seconds (Y = 1 when
                     omitted);
    connectinterval  seconds between two pickups (each may open a new
                     connection).

    The thresholds of an entry come from the counter's *conditions*,
    evaluated first to last (the first whose values all match wins, and
    its thresholds replace the fall-back as a whole), else from the
    counter's own fall-back.  An entry with no threshold at all is not
    limited.  A counter with no fields has exactly one entry: a global
    limit.

    A field may carry *groups* that roll values up into one entry:
    ``remotemx: {gsuite: ['*.google.com', '/\.goog$/']}`` makes every MX
    that matches one of the patterns count as the single value
    ``#gsuite``, which conditions then name.  Patterns are wildcards
    (``*`` = any characters) or ``/regex/`` (``/regex/i`` ignores case),
    matched against the lower-cased value; the first group that matches
    wins.

    A condition may name a pattern too (``if: {remotemx: '*.google.com'}``),
    and then it pools like a group: every value it matches counts in one
    entry, whose key holds the pattern as written (Counter.entry_key).  So
    a condition on a provider's hosts -- a shaping back-off, an operator's
    limit -- holds for the provider as a whole, not for each host.  When
    the condition goes, the values count one by one again.

    Two spellings are accepted, and both end in the same Policy:

    Halon's file        ``{policies: [...], suspends: [...]}``; a counter
                        has ``conditions: [{if: {...}, then: {...}}]`` and
                        ``default: {...}``.
    compact (the seed)  a bare list of counters; a counter has ``if`` (one
                        mapping or a list) whose items mix the values to
                        match with the thresholds, and its fall-back
                        thresholds directly on the counter.

    docs/policies.md shows each of the specification's examples in both.

INVARIANTS
    A condition only names fields of its own counter (otherwise one entry
    could have two thresholds), and a ``#id`` only names a group of that
    field.  Host names (recipientdomain, remotemx) compare without case,
    ids with case.

    Counter.thresholds_for(Counter.entry_key(k)) chooses the condition
    that k itself chooses: a key component that is a pattern (a pooled
    entry's) fits a condition's pattern only when it is the same text,
    never by matching it as a value.  (A value that looks like a pattern,
    ``a*b`` as a tenant id, is therefore taken for a pooled one.)

SEE ALSO
    sluice.scheduler.scheduler (who enforces it), schemas/policy.schema.json,
    seeds/004 section 2.3.1, docs/policies.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CASELESS_FIELDS",
    "DESTINATION_FIELDS",
    "FIELDS",
    "PATTERN_SUSPENSION_FIELDS",
    "SCOPES",
    "Condition",
    "Counter",
    "FieldSpec",
    "Group",
    "Pattern",
    "Policy",
    "PolicyError",
    "Rate",
    "Suspension",
    "Thresholds",
    "host_pattern",
    "key_fits",
    "pooled_key",
]

#: The fields a counter, a condition or a suspension may name (seeds 001, 004).
FIELDS: tuple[str, ...] = (
    "tenantid",
    "jobid",
    "transportid",
    "localip",
    "grouping",
    "remoteip",
    "remotemx",
    "recipientdomain",
)

#: Fields that say where mail goes; a counter over one of them limits a destination.
DESTINATION_FIELDS = frozenset({"grouping", "remoteip", "remotemx", "recipientdomain"})

#: Host names compare without case; ids (tenantid, jobid, transportid, grouping) with.
CASELESS_FIELDS = frozenset({"recipientdomain", "remotemx"})

#: Fields a suspension may name by a host name pattern (``*.google.com``):
#: a provider is the suffix of its MX hosts' (or its domains') names.
PATTERN_SUSPENSION_FIELDS = frozenset({"recipientdomain", "remotemx"})

_HOST_WILDCARD_RE = re.compile(r"^[A-Za-z0-9_.*-]+$")

#: Where a counter's thresholds hold when several nodes share a queue: across
#: all of them (through the cluster's shared limits), or on each node alone.
SCOPES = ("cluster", "node")


class PolicyError(Exception):
    """A policy or suspension list is unusable.

    ``problems`` holds every (key path, message) found; str() is one line
    per problem, each starting with the source.
    """

    def __init__(self, source: str, problems: Sequence[tuple[str, str]]) -> None:
        self.source = source
        self.problems = list(problems)
        lines = [f"{source}: {path}: {msg}" if path else f"{source}: {msg}"
                 for path, msg in self.problems]
        super().__init__("\n".join(lines))


# --------------------------------------------------------------------------
# The policy as data.


@dataclass(frozen=True, slots=True)
class Rate:
    """At most ``count`` pickups in any window of ``per_s`` seconds."""

    count: int
    per_s: float = 1.0

    def __post_init__(self) -> None:
        if self.count < 0 or self.per_s <= 0:
            raise ValueError(f"bad rate {self.count}/{self.per_s}")

    def __str__(self) -> str:
        per = f"{self.per_s:g}"
        return f"{self.count}/{per}"


@dataclass(frozen=True, slots=True)
class Thresholds:
    """The limits of one counter entry; None = not limited by that kind."""

    concurrency: int | None = None
    rate: Rate | None = None
    connectinterval_s: float | None = None

    @property
    def is_empty(self) -> bool:
        """Whether no threshold is set."""
        return self.concurrency is None and self.rate is None and self.connectinterval_s is None

    def to_data(self) -> dict[str, Any]:
        """The thresholds as the policy file writes them."""
        out: dict[str, Any] = {}
        if self.concurrency is not None:
            out["concurrency"] = self.concurrency
        if self.rate is not None:
            out["rate"] = str(self.rate)
        if self.connectinterval_s is not None:
            out["connectinterval"] = self.connectinterval_s
        return out

    def __str__(self) -> str:
        parts = [f"{k}={v}" for k, v in self.to_data().items()]
        return ", ".join(parts) if parts else "unlimited"


@dataclass(frozen=True, slots=True)
class Pattern:
    """A wildcard (``*.google.com``) or ``/regex/`` as written, and its matcher."""

    text: str
    regex: re.Pattern[str] = field(compare=False, repr=False)

    @classmethod
    def compile(cls, text: str) -> Pattern:
        """Raises ValueError for a regex that does not compile."""
        if Pattern.is_regex(text):
            ignore_case = text.endswith("/i")
            body = text[1:-2] if ignore_case else text[1:-1]
            try:
                rx = re.compile(body, re.IGNORECASE if ignore_case else 0)
            except re.error as exc:
                raise ValueError(f"bad regular expression {text!r}: {exc}") from None
            return cls(text, rx)
        # Wildcards ignore case: they are mostly host names.
        parts = (re.escape(p) for p in text.split("*"))
        return cls(text, re.compile("^" + ".*".join(parts) + "$", re.IGNORECASE))

    @staticmethod
    def is_regex(text: str) -> bool:
        """Whether ``text`` is written as a ``/regex/`` (or ``/regex/i``)."""
        return len(text) >= 2 and text.startswith("/") and (text.endswith("/")
                                                             or text.endswith("/i"))

    @staticmethod
    def is_pattern(text: str) -> bool:
        """Whether ``text`` is a pattern (a wild-card or a /regex/) rather than a literal."""
        return "*" in text or Pattern.is_regex(text)

    def matches(self, value: str) -> bool:
        """Whether ``value`` fits the pattern."""
        return self.regex.search(value) is not None


def host_pattern(text: str) -> Pattern:
    """A wildcard (``*.google.com``) or ``/regex/`` over host names, checked.

    Raises ValueError naming what is wrong: a regex that does not
    compile, a wildcard with characters no host name has (spaces,
    commas), or one that names no label at all (``*``, ``*.``), which
    would match every host.
    """
    if not Pattern.is_regex(text):
        if not _HOST_WILDCARD_RE.match(text):
            raise ValueError(f"{text!r} is not a host name pattern: use letters, digits, "
                             "'-', '.' and '*' (or a /regex/)")
        if not text.replace("*", "").strip("."):
            raise ValueError(f"{text!r} would match every host: name at least one label, "
                             "as in '*.example.com'")
        if ".." in text:
            raise ValueError(f"{text!r} is not a host name pattern: empty label")
    return Pattern.compile(text)


@dataclass(frozen=True, slots=True)
class Group:
    """Values matching any of ``patterns`` count as the one value ``#id``."""

    id: str
    patterns: tuple[Pattern, ...]

    def matches(self, value: str) -> bool:
        """Whether ``value`` fits any pattern of the group."""
        return any(p.matches(value) for p in self.patterns)


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One field of a counter, with its groups (in order; the first match wins)."""

    name: str
    groups: tuple[Group, ...] = ()

    def component(self, value: str) -> str:
        """The value as the counter's key sees it: ``#id`` of its group, or itself."""
        for group in self.groups:
            if group.matches(value):
                return "#" + group.id
        return value

    def to_data(self) -> str | dict[str, Any]:
        """The field as the policy file writes it: its name, or its name and groups."""
        if not self.groups:
            return self.name
        return {self.name: {g.id: [p.text for p in g.patterns] for g in self.groups}}

    @property
    def signature(self) -> str:
        """The field and its groups as one string, equal for equal specs."""
        if not self.groups:
            return self.name
        inner = ";".join(f"{g.id}=" + ",".join(p.text for p in g.patterns) for g in self.groups)
        return f"{self.name}{{{inner}}}"


@dataclass(frozen=True, slots=True)
class Condition:
    """``if`` all of ``match`` hold, the entry gets ``thresholds``.

    A value in ``match`` is compared with the entry's key component: a
    literal (lower-cased), a ``#group`` id, or a pattern, which pools the
    values it matches into one entry (Counter.entry_key).  Conditions
    added at run time carry an id, and may carry an expiry, tag and reason.
    """

    match: tuple[tuple[str, str], ...]
    thresholds: Thresholds
    id: str = ""
    expires_at: float | None = None
    tag: str = ""
    reason: str = ""

    def matcher(self, fields: Sequence[str]) -> tuple[tuple[int, str | Pattern], ...]:
        """(position in ``fields``, literal or Pattern) pairs for a key tuple."""
        out: list[tuple[int, str | Pattern]] = []
        for name, value in self.match:
            pos = list(fields).index(name)
            if Pattern.is_pattern(value):
                out.append((pos, Pattern.compile(value)))
            elif value.startswith("#") or name not in CASELESS_FIELDS:
                out.append((pos, value))
            else:
                out.append((pos, value.lower()))
        return tuple(out)

    @property
    def pools(self) -> bool:
        """Whether a value is a pattern, so that the entries it chooses are pooled."""
        return any(Pattern.is_pattern(v) for _, v in self.match)

    def to_data(self) -> dict[str, Any]:
        """The condition as the policy file writes it."""
        out: dict[str, Any] = {"if": dict(self.match), "then": self.thresholds.to_data()}
        if self.id:
            out["id"] = self.id
        if self.expires_at is not None:
            out["expires_at"] = self.expires_at
        if self.tag:
            out["tag"] = self.tag
        if self.reason:
            out["reason"] = self.reason
        return out


@dataclass(frozen=True, slots=True)
class Counter:
    """Fields that key the entries, conditions first to last, and a fall-back."""

    fields: tuple[FieldSpec, ...]
    conditions: tuple[Condition, ...] = ()
    default: Thresholds = field(default_factory=Thresholds)
    id: str = ""
    scope: str = "cluster"  # SCOPES; only a cluster's shared limits read it

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", "+".join(f.name for f in self.fields) or "global")

    @property
    def field_names(self) -> tuple[str, ...]:
        """The names of the fields the counter counts by."""
        return tuple(f.name for f in self.fields)

    @property
    def signature(self) -> str:
        """What keys its entries: the fields and their groups (not thresholds).

        Entries of two policies with the same signature are the same
        entries, so a reload that only changes numbers keeps their counts.
        """
        return "|".join(f.signature for f in self.fields) or "*"

    @property
    def pooling(self) -> tuple[tuple[tuple[str, str], ...], ...]:
        """What keys pooled entries: every condition's match, if any pools (else ()).

        Two counters over the same fields with the same pooling key every
        delivery alike.
        """
        if not any(c.pools for c in self.conditions):
            return ()
        return tuple(c.match for c in self.conditions)

    def entry_key(self, key: Sequence[str]) -> tuple[str, ...]:
        """The key of the entry that a delivery whose values are ``key`` counts in.

        ``key`` itself, unless the first condition it meets names a
        pattern: then that field's component is the pattern as written,
        shared by every value the pattern matches.
        """
        names = self.field_names
        for cond in self.conditions:
            matcher = cond.matcher(names)
            if key_fits(matcher, key):
                return pooled_key(matcher, key)
        return tuple(key)

    @property
    def limits_destination(self) -> bool:
        """Whether the counter counts by a destination field (so limits a destination)."""
        return any(f.name in DESTINATION_FIELDS for f in self.fields)

    def thresholds_for(self, key: Sequence[str]) -> tuple[Thresholds, Condition | None]:
        """The thresholds of the entry ``key`` and the condition that chose them."""
        names = self.field_names
        for cond in self.conditions:
            if key_fits(cond.matcher(names), key):
                return cond.thresholds, cond
        return self.default, None

    def to_data(self) -> dict[str, Any]:
        """The counter as the policy file writes it."""
        out: dict[str, Any] = {"id": self.id, "fields": [f.to_data() for f in self.fields]}
        if self.scope != "cluster":
            out["scope"] = self.scope
        if self.conditions:
            out["conditions"] = [c.to_data() for c in self.conditions]
        if not self.default.is_empty:
            out["default"] = self.default.to_data()
        return out


def key_fits(matcher: Iterable[tuple[int, str | Pattern]], key: Sequence[str]) -> bool:
    """Whether a condition's ``matcher`` (Condition.matcher) fits an entry's ``key``.

    A pattern fits a value it matches, or a pooled component that is the
    same pattern as written (and no other: ``*.com`` does not take the
    entry pooled under ``*.google.com``).
    """
    for pos, want in matcher:
        have = key[pos]
        if isinstance(want, Pattern):
            if Pattern.is_pattern(have):
                if have != want.text:
                    return False
            elif not want.matches(have):
                return False
        elif have != want:
            return False
    return True


def pooled_key(matcher: Iterable[tuple[int, str | Pattern]], key: Sequence[str]
               ) -> tuple[str, ...]:
    """``key`` with the component of each pattern of ``matcher`` replaced by its text."""
    out = list(key)
    for pos, want in matcher:
        if isinstance(want, Pattern):
            out[pos] = want.text
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Suspension:
    """Pickup of every delivery that matches all ``fields`` is suspended.

    ``localip`` suspends one source IP: a delivery that may use others
    goes out from those (seed 004, "Excluding IPs from pool").  An expired
    suspension is lifted by the scheduler on its own.

    ``remotemx`` and ``recipientdomain`` may be a host name pattern
    (``*.google.com``, see host_pattern()): the suspension then holds
    every destination whose MX host (or domain) fits, a provider's
    whole fleet (a shaping rule's *where*, sluice.shaping).  Other
    fields are exact values.
    """

    fields: tuple[tuple[str, str], ...]
    id: str = ""
    expires_at: float | None = None
    tag: str = ""
    reason: str = ""
    _patterns: tuple[tuple[str, Pattern], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.fields:
            raise ValueError("a suspension needs at least one field")
        # Host names and wildcards over them ignore case; a /regex/ is kept as written.
        norm = tuple(sorted((k, v.lower().rstrip(".")
                             if k in CASELESS_FIELDS and not Pattern.is_regex(v) else v)
                            for k, v in self.fields))
        names = [k for k, _ in norm]
        if len(set(names)) != len(names):
            raise ValueError("a suspension names each field at most once")
        for name in names:
            if name not in FIELDS:
                raise ValueError(f"unknown field {name!r}")
        patterns: list[tuple[str, Pattern]] = []
        for name, value in norm:
            if not Pattern.is_pattern(value):
                continue
            if name not in PATTERN_SUSPENSION_FIELDS:
                raise ValueError(f"a suspension matches {name} exactly, not by a pattern "
                                 f"({value!r})")
            patterns.append((name, host_pattern(value)))
        object.__setattr__(self, "fields", norm)
        object.__setattr__(self, "_patterns", tuple(patterns))
        if not self.id:
            object.__setattr__(self, "id", ",".join(f"{k}={v}" for k, v in norm))

    @property
    def is_pattern(self) -> bool:
        """Whether a field is a host name pattern rather than one value."""
        return bool(self._patterns)

    def matches(self, value: Callable[[str], str]) -> bool:
        """Whether a delivery whose field values ``value(name)`` gives is held."""
        patterns = dict(self._patterns)
        for name, want in self.fields:
            have = value(name)
            if name in CASELESS_FIELDS:
                have = have.lower().rstrip(".")
            pattern = patterns.get(name)
            if pattern is not None:
                if not have or not pattern.matches(have):
                    return False
            elif have != want:
                return False
        return True

    @property
    def field_names(self) -> tuple[str, ...]:
        """The names of the fields the suspension matches."""
        return tuple(k for k, _ in self.fields)

    @property
    def values(self) -> tuple[str, ...]:
        """The values the suspension matches, in field order."""
        return tuple(v for _, v in self.fields)

    def to_data(self) -> dict[str, Any]:
        """The suspension as the suspension list file writes it."""
        out: dict[str, Any] = dict(self.fields)
        out["id"] = self.id
        if self.expires_at is not None:
            out["expires_at"] = self.expires_at
        if self.tag:
            out["tag"] = self.tag
        if self.reason:
            out["reason"] = self.reason
        return out


@dataclass(frozen=True, slots=True)
class Policy:
    """Counters in file order, and the suspensions the file lists."""

    counters: tuple[Counter, ...] = ()
    suspensions: tuple[Suspension, ...] = ()
    source: str = "<empty policy>"

    def counter(self, counter_id: str) -> Counter:
        """The counter with id ``counter_id``; KeyError if there is none."""
        for c in self.counters:
            if c.id == counter_id:
                return c
        raise KeyError(counter_id)

    def with_condition(self, counter_id: str, cond: Condition, position: int = 0
                       ) -> tuple[Policy, Condition]:
        """This policy with ``cond`` inserted in a counter at ``position``.

        0 is evaluated first; a condition with the same id is replaced.  A
        condition without an id gets the first free ``cN``.  Returns the new
        policy and the condition as inserted.
        """
        counter = self.counter(counter_id)
        conditions = list(counter.conditions)
        if not cond.id:
            taken = {c.id for c in conditions}
            n = len(conditions) + 1
            while f"c{n}" in taken:
                n += 1
            cond = Condition(cond.match, cond.thresholds, f"c{n}", cond.expires_at, cond.tag,
                             cond.reason)
        conditions = [c for c in conditions if c.id != cond.id]
        conditions.insert(max(0, min(position, len(conditions))), cond)
        return self._with(counter, tuple(conditions)), cond

    def without_condition(self, counter_id: str, cond_id: str) -> Policy:
        """This policy without a counter's condition ``cond_id``."""
        counter = self.counter(counter_id)
        return self._with(counter, tuple(c for c in counter.conditions if c.id != cond_id))

    def _with(self, counter: Counter, conditions: tuple[Condition, ...]) -> Policy:
        changed = Counter(counter.fields, conditions, counter.default, counter.id, counter.scope)
        counters = tuple(changed if c is counter else c for c in self.counters)
        return Policy(counters, self.suspensions, self.source)

    def to_data(self) -> dict[str, Any]:
        """The policy as the policy file writes it."""
        return {
            "policies": [c.to_data() for c in self.counters],
            "suspends": [s.to_data() for s in self.suspensions],
        }
