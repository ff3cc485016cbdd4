"""Pickup policies: counters over fields, conditions, groups and thresholds.

SUMMARY
    parse_policy(data, source) -> Policy, or PolicyError naming every
    problem by its key path.  parse_suspensions(data, source) for a
    suspension list.  Pure: the caller reads the file and the YAML.

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
    ``remotemx: {gsuite: ['*.google.com', '/\\.goog$/']}`` makes every MX
    that matches one of the patterns count as the single value
    ``#gsuite``, which conditions then name.  Patterns are wildcards
    (``*`` = any characters) or ``/regex/`` (``/regex/i`` ignores case),
    matched against the lower-cased value; the first group that matches
    wins.

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

SEE ALSO
    sluice.scheduler.scheduler (who enforces it), schemas/policy.schema.json,
    seeds/004 section 2.3.1, docs/policies.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CASELESS_FIELDS",
    "DESTINATION_FIELDS",
    "FIELDS",
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
    "parse_policy",
    "parse_suspension",
    "parse_suspensions",
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

_THRESHOLD_KEYS = ("concurrency", "rate", "connectinterval")
_RATE_RE = re.compile(r"^\s*(\d+)\s*(?:/\s*(\d+(?:\.\d+)?)\s*)?$")
_ID_RE = re.compile(r"^[A-Za-z0-9_.:@-]+$")


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
        return self.concurrency is None and self.rate is None and self.connectinterval_s is None

    def to_data(self) -> dict[str, Any]:
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
        if len(text) >= 2 and text.startswith("/") and (text.endswith("/") or text.endswith("/i")):
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
    def is_pattern(text: str) -> bool:
        return "*" in text or (len(text) >= 2 and text.startswith("/")
                               and (text.endswith("/") or text.endswith("/i")))

    def matches(self, value: str) -> bool:
        return self.regex.search(value) is not None


@dataclass(frozen=True, slots=True)
class Group:
    """Values matching any of ``patterns`` count as the one value ``#id``."""

    id: str
    patterns: tuple[Pattern, ...]

    def matches(self, value: str) -> bool:
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
        if not self.groups:
            return self.name
        return {self.name: {g.id: [p.text for p in g.patterns] for g in self.groups}}

    @property
    def signature(self) -> str:
        if not self.groups:
            return self.name
        inner = ";".join(f"{g.id}=" + ",".join(p.text for p in g.patterns) for g in self.groups)
        return f"{self.name}{{{inner}}}"


@dataclass(frozen=True, slots=True)
class Condition:
    """``if`` all of ``match`` hold, the entry gets ``thresholds``.

    A value in ``match`` is compared with the entry's key component: a
    literal (lower-cased), a ``#group`` id, or a pattern.  Conditions
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

    def to_data(self) -> dict[str, Any]:
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

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", "+".join(f.name for f in self.fields) or "global")

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @property
    def signature(self) -> str:
        """What keys its entries: the fields and their groups (not thresholds).

        Entries of two policies with the same signature are the same
        entries, so a reload that only changes numbers keeps their counts.
        """
        return "|".join(f.signature for f in self.fields) or "*"

    @property
    def limits_destination(self) -> bool:
        return any(f.name in DESTINATION_FIELDS for f in self.fields)

    def thresholds_for(self, key: Sequence[str]) -> tuple[Thresholds, Condition | None]:
        """The thresholds of the entry ``key`` and the condition that chose them."""
        names = self.field_names
        for cond in self.conditions:
            if _condition_matches(cond.matcher(names), key):
                return cond.thresholds, cond
        return self.default, None

    def to_data(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "fields": [f.to_data() for f in self.fields]}
        if self.conditions:
            out["conditions"] = [c.to_data() for c in self.conditions]
        if not self.default.is_empty:
            out["default"] = self.default.to_data()
        return out


def _condition_matches(matcher: Iterable[tuple[int, str | Pattern]], key: Sequence[str]) -> bool:
    for pos, want in matcher:
        have = key[pos]
        if isinstance(want, Pattern):
            if not want.matches(have):
                return False
        elif have != want:
            return False
    return True


@dataclass(frozen=True, slots=True)
class Suspension:
    """Pickup of every delivery that matches all ``fields`` is suspended.

    ``localip`` suspends one source IP: a delivery that may use others
    goes out from those (seed 004, "Excluding IPs from pool").  An expired
    suspension is lifted by the scheduler on its own.
    """

    fields: tuple[tuple[str, str], ...]
    id: str = ""
    expires_at: float | None = None
    tag: str = ""
    reason: str = ""

    def __post_init__(self) -> None:
        if not self.fields:
            raise ValueError("a suspension needs at least one field")
        norm = tuple(sorted((k, v.lower().rstrip(".") if k in CASELESS_FIELDS else v)
                            for k, v in self.fields))
        names = [k for k, _ in norm]
        if len(set(names)) != len(names):
            raise ValueError("a suspension names each field at most once")
        for name in names:
            if name not in FIELDS:
                raise ValueError(f"unknown field {name!r}")
        object.__setattr__(self, "fields", norm)
        if not self.id:
            object.__setattr__(self, "id", ",".join(f"{k}={v}" for k, v in norm))

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.fields)

    @property
    def values(self) -> tuple[str, ...]:
        return tuple(v for _, v in self.fields)

    def to_data(self) -> dict[str, Any]:
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
        for c in self.counters:
            if c.id == counter_id:
                return c
        raise KeyError(counter_id)

    def with_condition(self, counter_id: str, cond: Condition, position: int = 0
                       ) -> tuple[Policy, Condition]:
        """This policy with ``cond`` inserted in a counter at ``position`` (0:
        evaluated first); a condition with the same id is replaced.  A
        condition without an id gets the first free ``cN``.  Returns the
        new policy and the condition as inserted."""
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
        changed = Counter(counter.fields, conditions, counter.default, counter.id)
        counters = tuple(changed if c is counter else c for c in self.counters)
        return Policy(counters, self.suspensions, self.source)

    def to_data(self) -> dict[str, Any]:
        return {
            "policies": [c.to_data() for c in self.counters],
            "suspends": [s.to_data() for s in self.suspensions],
        }


# --------------------------------------------------------------------------
# Parsing plain data (as YAML gives it) into a Policy.


class _Problems:
    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, path: str, message: str) -> None:
        self.items.append((path, message))


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _parse_rate(value: object, path: str, problems: _Problems) -> Rate | None:
    if isinstance(value, bool):
        problems.add(path, f"{value!r} is not a rate (use X or \"X/Y\")")
        return None
    if isinstance(value, int):
        if value < 0:
            problems.add(path, "a rate must not be negative")
            return None
        return Rate(value, 1.0)
    if isinstance(value, str):
        m = _RATE_RE.match(value)
        if m:
            per = float(m.group(2)) if m.group(2) else 1.0
            if per > 0:
                return Rate(int(m.group(1)), per)
            problems.add(path, "the interval of a rate must be more than 0 seconds")
            return None
    problems.add(path, f"{value!r} is not a rate (use X or \"X/Y\": X per Y seconds)")
    return None


def _parse_thresholds(data: Mapping[str, Any], path: str, problems: _Problems) -> Thresholds:
    concurrency: int | None = None
    rate: Rate | None = None
    interval: float | None = None
    if "concurrency" in data:
        value = data["concurrency"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            problems.add(_join(path, "concurrency"), f"{value!r} is not a whole number >= 0")
        else:
            concurrency = value
    if "rate" in data:
        rate = _parse_rate(data["rate"], _join(path, "rate"), problems)
    if "connectinterval" in data:
        value = data["connectinterval"]
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            problems.add(_join(path, "connectinterval"),
                         f"{value!r} is not a number of seconds >= 0")
        else:
            interval = float(value)
    return Thresholds(concurrency, rate, interval)


def _check_keys(data: Mapping[str, Any], allowed: Iterable[str], path: str,
                problems: _Problems) -> None:
    allowed = set(allowed)
    for key in data:
        if key not in allowed:
            problems.add(_join(path, str(key)), "unknown key")


def _parse_field(item: object, path: str, problems: _Problems) -> FieldSpec | None:
    if isinstance(item, str):
        if item not in FIELDS:
            problems.add(path, f"unknown field {item!r} (one of {', '.join(FIELDS)})")
            return None
        return FieldSpec(item)
    if isinstance(item, Mapping) and len(item) == 1:
        name, groups_data = next(iter(item.items()))
        gpath = _join(path, str(name))
        if name not in FIELDS:
            problems.add(gpath, f"unknown field {name!r} (one of {', '.join(FIELDS)})")
            return None
        if not isinstance(groups_data, Mapping) or not groups_data:
            problems.add(gpath, "groups are a mapping of group id to a list of patterns, "
                                "e.g. {gsuite: ['*.google.com']}")
            return None
        groups: list[Group] = []
        for gid, patterns in groups_data.items():
            ppath = _join(gpath, str(gid))
            if not isinstance(gid, str) or not _ID_RE.match(gid):
                problems.add(ppath, "a group id is letters, digits and _.:@-")
                continue
            if isinstance(patterns, str):
                patterns = [patterns]
            if not isinstance(patterns, list) or not patterns:
                problems.add(ppath, "a group needs a list of patterns")
                continue
            compiled: list[Pattern] = []
            for i, text in enumerate(patterns):
                if not isinstance(text, str) or not text:
                    problems.add(_join(ppath, i), "a pattern is a non-empty string")
                    continue
                try:
                    compiled.append(Pattern.compile(text))
                except ValueError as exc:
                    problems.add(_join(ppath, i), str(exc))
            groups.append(Group(gid, tuple(compiled)))
        return FieldSpec(name, tuple(groups))
    problems.add(path, "a field is a name, or {name: {group-id: [patterns]}}")
    return None


def _parse_match(data: Mapping[str, Any], fields: Sequence[FieldSpec], path: str,
                 problems: _Problems) -> tuple[tuple[str, str], ...]:
    by_name = {f.name: f for f in fields}
    out: list[tuple[str, str]] = []
    for name, value in data.items():
        vpath = _join(path, str(name))
        if name not in FIELDS:
            problems.add(vpath, f"unknown field {name!r}")
            continue
        spec = by_name.get(name)
        if spec is None:
            problems.add(vpath, f"the counter does not count {name!r}; a condition can only "
                                "name the counter's own fields")
            continue
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value:
            problems.add(vpath, "a condition value is a non-empty string")
            continue
        if value.startswith("#"):
            if value[1:] not in {g.id for g in spec.groups}:
                problems.add(vpath, f"no group {value!r} on field {name!r}")
                continue
        elif Pattern.is_pattern(value):
            try:
                Pattern.compile(value)
            except ValueError as exc:
                problems.add(vpath, str(exc))
                continue
        out.append((name, value))
    if not out and not data:
        problems.add(path, "a condition needs at least one field to match")
    return tuple(out)


def _parse_extra(data: Mapping[str, Any], path: str, problems: _Problems
                 ) -> tuple[str, float | None, str, str]:
    cid = data.get("id", "")
    if not isinstance(cid, str):
        problems.add(_join(path, "id"), "an id is a string")
        cid = ""
    expires = data.get("expires_at")
    if expires is not None and (isinstance(expires, bool) or not isinstance(expires, int | float)):
        problems.add(_join(path, "expires_at"), "expires_at is a time (POSIX seconds)")
        expires = None
    tag = data.get("tag", "")
    reason = data.get("reason", "")
    if not isinstance(tag, str):
        problems.add(_join(path, "tag"), "a tag is a string")
        tag = ""
    if not isinstance(reason, str):
        problems.add(_join(path, "reason"), "a reason is a string")
        reason = ""
    return cid, float(expires) if expires is not None else None, tag, reason


_CONDITION_EXTRA = ("id", "expires_at", "tag", "reason")


def _parse_condition(item: object, fields: Sequence[FieldSpec], path: str,
                     problems: _Problems, compact: bool) -> Condition | None:
    if not isinstance(item, Mapping):
        problems.add(path, "a condition is a mapping")
        return None
    if compact:
        # The seed's spelling: the values to match and the thresholds side by side.
        _check_keys(item, (*FIELDS, *_THRESHOLD_KEYS, *_CONDITION_EXTRA), path, problems)
        match_data = {k: v for k, v in item.items() if k in FIELDS}
        thresholds = _parse_thresholds(item, path, problems)
        match = _parse_match(match_data, fields, path, problems)
    else:
        _check_keys(item, ("if", "then", *_THRESHOLD_KEYS, *_CONDITION_EXTRA), path, problems)
        cond_if = item.get("if")
        if not isinstance(cond_if, Mapping):
            problems.add(_join(path, "if"), "a condition needs 'if': {field: value, ...}")
            return None
        _check_keys(cond_if, FIELDS, _join(path, "if"), problems)
        match = _parse_match(cond_if, fields, _join(path, "if"), problems)
        then = item.get("then")
        if then is not None and any(k in item for k in _THRESHOLD_KEYS):
            problems.add(path, "give the thresholds either under 'then' or beside 'if', not both")
        if then is None:
            thresholds = _parse_thresholds(item, path, problems)
        elif not isinstance(then, Mapping):
            problems.add(_join(path, "then"), "'then' is a mapping of thresholds")
            return None
        else:
            _check_keys(then, _THRESHOLD_KEYS, _join(path, "then"), problems)
            thresholds = _parse_thresholds(then, _join(path, "then"), problems)
    if not match:
        if not any(p.startswith(path) for p, _ in problems.items):
            problems.add(path, "a condition needs at least one field to match")
        return None
    cid, expires, tag, reason = _parse_extra(item, path, problems)
    return Condition(match, thresholds, cid, expires, tag, reason)


def _parse_counter(item: object, path: str, problems: _Problems) -> Counter | None:
    if not isinstance(item, Mapping):
        problems.add(path, "a counter is a mapping with 'fields'")
        return None
    _check_keys(item, ("id", "fields", "conditions", "if", "default", *_THRESHOLD_KEYS),
                path, problems)
    fields_data = item.get("fields", [])
    if fields_data is None:
        fields_data = []
    fields: list[FieldSpec] = []
    if not isinstance(fields_data, list):
        problems.add(_join(path, "fields"), "'fields' is a list")
    else:
        for i, fitem in enumerate(fields_data):
            spec = _parse_field(fitem, _join(_join(path, "fields"), i), problems)
            if spec is not None:
                if spec.name in {f.name for f in fields}:
                    problems.add(_join(_join(path, "fields"), i), f"field {spec.name!r} twice")
                    continue
                fields.append(spec)
    conditions: list[Condition] = []
    if "conditions" in item and "if" in item:
        problems.add(path, "use either 'conditions' (with if/then) or 'if', not both")
    if "conditions" in item:
        cpath = _join(path, "conditions")
        data = item["conditions"]
        if not isinstance(data, list):
            problems.add(cpath, "'conditions' is a list of {if: ..., then: ...}")
        else:
            for i, citem in enumerate(data):
                cond = _parse_condition(citem, fields, _join(cpath, i), problems, compact=False)
                if cond is not None:
                    conditions.append(cond)
    elif "if" in item:
        cpath = _join(path, "if")
        data = item["if"]
        items = data if isinstance(data, list) else [data]
        for i, citem in enumerate(items):
            ipath = _join(cpath, i) if isinstance(data, list) else cpath
            cond = _parse_condition(citem, fields, ipath, problems, compact=True)
            if cond is not None:
                conditions.append(cond)
    if "default" in item and any(k in item for k in _THRESHOLD_KEYS):
        problems.add(path, "give the fall-back either under 'default' or on the counter, not both")
    if "default" in item:
        ddata = item["default"]
        if not isinstance(ddata, Mapping):
            problems.add(_join(path, "default"), "'default' is a mapping of thresholds")
            default = Thresholds()
        else:
            _check_keys(ddata, _THRESHOLD_KEYS, _join(path, "default"), problems)
            default = _parse_thresholds(ddata, _join(path, "default"), problems)
    else:
        default = _parse_thresholds(item, path, problems)
    cid = item.get("id", "")
    if not isinstance(cid, str):
        problems.add(_join(path, "id"), "an id is a string")
        cid = ""
    return Counter(tuple(fields), tuple(conditions), default, cid)


def parse_suspension(item: object, path: str = "", source: str = "<suspension>") -> Suspension:
    """One suspension from plain data; raises PolicyError."""
    problems = _Problems()
    susp = _parse_suspension(item, path, problems)
    if problems.items or susp is None:
        raise PolicyError(source, problems.items or [(path, "not a suspension")])
    return susp


def _parse_suspension(item: object, path: str, problems: _Problems) -> Suspension | None:
    if not isinstance(item, Mapping):
        problems.add(path, "a suspension is a mapping of field: value")
        return None
    _check_keys(item, (*FIELDS, *_CONDITION_EXTRA), path, problems)
    fields: list[tuple[str, str]] = []
    for name in FIELDS:
        if name not in item:
            continue
        value = item[name]
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value:
            problems.add(_join(path, name), f"the {name} to suspend is a non-empty string")
            continue
        if Pattern.is_pattern(value):
            problems.add(_join(path, name), "a suspension matches exact values, not patterns")
            continue
        fields.append((name, value))
    if not fields:
        if not any(p.startswith(path) for p, _ in problems.items):
            problems.add(path, "a suspension needs at least one field")
        return None
    sid, expires, tag, reason = _parse_extra(item, path, problems)
    return Suspension(tuple(fields), sid, expires, tag, reason)


def parse_suspensions(data: object, source: str = "<suspensions>", path: str = ""
                      ) -> tuple[Suspension, ...]:
    """A list of suspensions (a suspension file, or a policy's ``suspends``)."""
    problems = _Problems()
    out = _parse_suspension_list(data, path, problems)
    if problems.items:
        raise PolicyError(source, problems.items)
    return out


def _parse_suspension_list(data: object, path: str, problems: _Problems
                           ) -> tuple[Suspension, ...]:
    if data is None:
        return ()
    if not isinstance(data, list):
        problems.add(path, "suspensions are a list of {field: value, ...}")
        return ()
    out: list[Suspension] = []
    for i, item in enumerate(data):
        susp = _parse_suspension(item, _join(path, i), problems)
        if susp is not None:
            out.append(susp)
    return tuple(out)


def parse_policy(data: object, source: str = "<policy>") -> Policy:
    """A Policy from plain data; PolicyError lists every problem with its key path."""
    problems = _Problems()
    counters_data: object
    suspensions: tuple[Suspension, ...] = ()
    prefix = ""
    if data is None:
        counters_data = []
    elif isinstance(data, Mapping):
        _check_keys(data, ("policies", "suspends"), "", problems)
        counters_data = data.get("policies") or []
        prefix = "policies"
        suspensions = _parse_suspension_list(data.get("suspends"), "suspends", problems)
    else:
        counters_data = data
    counters: list[Counter] = []
    if not isinstance(counters_data, list):
        problems.add(prefix, "the policy is a list of counters, "
                             "or {policies: [...], suspends: [...]}")
    else:
        for i, item in enumerate(counters_data):
            counter = _parse_counter(item, f"{prefix}[{i}]", problems)
            if counter is not None:
                counters.append(counter)
    seen: dict[str, int] = {}
    for i, c in enumerate(counters):
        if c.id in seen:
            # Two counters over the same fields are legal; give the later an ordinal id.
            seen[c.id] += 1
            counters[i] = Counter(c.fields, c.conditions, c.default, f"{c.id}#{seen[c.id]}")
        else:
            seen[c.id] = 1
    if problems.items:
        raise PolicyError(source, problems.items)
    return Policy(tuple(counters), suspensions, source)
