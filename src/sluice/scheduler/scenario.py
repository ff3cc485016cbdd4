"""Scenarios for the policy simulator: destinations, traffic and operators as data.

SUMMARY
    scenario = parse_scenario(data, source, policy=None)   or ScenarioError

DESCRIPTION
    A scenario (a YAML file for `sluice simulate`) names the scheduler's
    settings, the policy (inline or a file), simulated destinations (MX,
    latency, throttling, greylisting, random failures, dead periods),
    traffic flows per tenant and job, operator actions during the run,
    and the retry rules.  Like a policy, every problem is reported with its
    key path, all at once.

SEE ALSO
    sluice.scheduler.simulation (what runs it), examples/scenarios/,
    docs/scheduler.md
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.retry import RetryPolicy
from sluice.scheduler.policy import Policy, PolicyError, Suspension
from sluice.scheduler.policy_parse import parse_policy, parse_suspension, parse_suspensions
from sluice.scheduler.settings import Settings

__all__ = [
    "DEFAULT_RETRY",
    "DestinationSpec",
    "FlowSpec",
    "OperatorAction",
    "Scenario",
    "ScenarioError",
    "parse_scenario",
]


#: Retry rules of a scenario that gives none: quick, so that runs end soon.
DEFAULT_RETRY = RetryPolicy(delays_s=(60.0, 300.0, 900.0), granularity_s=0.0,
                            maxtime_s=4 * 3600.0)


class ScenarioError(PolicyError):
    """A scenario is unusable; like PolicyError, every problem with its key path."""


# --------------------------------------------------------------------------
# The scenario as data.


@dataclass(frozen=True, slots=True)
class DestinationSpec:
    """How one simulated destination behaves.

    ``dead`` lists [from, until) periods (seconds from the start) when
    connections fail.  ``max_per_minute``: the destination answers 421 at
    the door once it has taken that many deliveries in the current minute.
    ``max_concurrency``: 421 at the door beyond that many at once.
    ``greylist_s``: a message's first attempt gets 451 4.7.1, and so does
    every attempt until that long after the first.
    """

    domain: str
    mx: str = ""
    remoteip: str = ""
    latency_s: float = 0.2
    jitter: float = 0.5
    connect_timeout_s: float = 5.0
    max_per_minute: int | None = None
    max_concurrency: int | None = None
    greylist_s: float | None = None
    temp_fail_rate: float = 0.0
    perm_fail_rate: float = 0.0
    dead: tuple[tuple[float, float], ...] = ()
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class FlowSpec:
    """Traffic of one tenant and job.

    ``messages`` at ``rate_per_s`` from ``start_s``, to ``destinations``
    (names; empty = all) picked by weight.
    """

    tenant: str
    messages: int
    rate_per_s: float
    start_s: float = 0.0
    jobid: str = ""
    transportid: str = ""
    localip: tuple[str, ...] = ()
    priority: int = 0
    destinations: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class OperatorAction:
    """At ``at_s``: add ``suspend`` or lift the suspension with id ``lift``.

    An added suspension lasts ``ttl_s``, or until lifted.
    """

    at_s: float
    suspend: Suspension | None = None
    ttl_s: float | None = None
    lift: str | None = None


@dataclass(frozen=True, slots=True)
class Scenario:
    """One simulation: destinations, traffic, the policy and settings, and operators' actions."""
    name: str
    destinations: tuple[DestinationSpec, ...]
    flows: tuple[FlowSpec, ...]
    policy: Policy = field(default_factory=Policy)
    settings: Settings = field(default_factory=Settings)
    retry: RetryPolicy = field(default_factory=lambda: DEFAULT_RETRY)
    actions: tuple[OperatorAction, ...] = ()
    seed: int = 1
    resolution_s: float = 0.01
    arrival_tick_s: float = 0.1
    max_time_s: float = 7 * 86400.0
    zipf: float = 0.0

    @property
    def messages(self) -> int:
        """How many messages the flows send in all."""
        return sum(f.messages for f in self.flows)


# --------------------------------------------------------------------------
# Parsing a scenario from plain data (YAML).

_DEST_KEYS = {
    "domain", "mx", "remoteip", "latency_s", "jitter", "connect_timeout_s", "max_per_minute",
    "max_concurrency", "greylist_s", "temp_fail_rate", "perm_fail_rate", "dead", "weight",
}
_SETTINGS_KEYS = {f for f in Settings.__dataclass_fields__}


def _num(data: Mapping[str, Any], key: str, path: str, problems: list[tuple[str, str]],
         default: float | None, minimum: float = 0.0, integer: bool = False) -> Any:
    if key not in data or data[key] is None:
        return default
    value = data[key]
    where = f"{path}.{key}" if path else key
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum \
            or (integer and not isinstance(value, int)):
        kind = "a whole number" if integer else "a number"
        problems.append((where, f"{value!r} is not {kind} >= {minimum:g}"))
        return default
    return int(value) if integer else float(value)


def _dest_spec(data: Mapping[str, Any], path: str, problems: list[tuple[str, str]],
               domain: str, base: DestinationSpec | None) -> DestinationSpec:
    for key in data:
        if key not in _DEST_KEYS and key not in ("count", "name", "mx_name", "count_start"):
            problems.append((f"{path}.{key}", "unknown key"))
    b = base or DestinationSpec(domain)
    dead: list[tuple[float, float]] = list(b.dead)
    if "dead" in data:
        dead = []
        raw = data["dead"]
        if not isinstance(raw, list):
            problems.append((f"{path}.dead", "dead is a list of [from_s, until_s] periods"))
        else:
            for i, period in enumerate(raw):
                if (not isinstance(period, list | tuple) or len(period) != 2
                        or not all(isinstance(x, int | float) for x in period)
                        or period[0] >= period[1]):
                    problems.append((f"{path}.dead[{i}]", "a period is [from_s, until_s]"))
                    continue
                dead.append((float(period[0]), float(period[1])))
    mx = data.get("mx", b.mx if base else "")
    remoteip = data.get("remoteip", b.remoteip if base else "")
    return DestinationSpec(
        domain=domain,
        mx=str(mx or ""),
        remoteip=str(remoteip or ""),
        latency_s=_num(data, "latency_s", path, problems, b.latency_s),
        jitter=_num(data, "jitter", path, problems, b.jitter),
        connect_timeout_s=_num(data, "connect_timeout_s", path, problems, b.connect_timeout_s),
        max_per_minute=_num(data, "max_per_minute", path, problems, b.max_per_minute,
                            integer=True),
        max_concurrency=_num(data, "max_concurrency", path, problems, b.max_concurrency,
                             minimum=1, integer=True),
        greylist_s=_num(data, "greylist_s", path, problems, b.greylist_s),
        temp_fail_rate=_num(data, "temp_fail_rate", path, problems, b.temp_fail_rate),
        perm_fail_rate=_num(data, "perm_fail_rate", path, problems, b.perm_fail_rate),
        dead=tuple(dead),
        weight=_num(data, "weight", path, problems, b.weight),
    )


def parse_scenario(data: object, source: str = "<scenario>", policy: Policy | None = None
                   ) -> Scenario:
    """A Scenario from plain data.

    ``policy`` (already loaded by the caller from a file the scenario names)
    overrides an inline ``policy``.
    """
    problems: list[tuple[str, str]] = []
    if not isinstance(data, Mapping):
        raise ScenarioError(source, [("", "a scenario is a mapping")])
    known = {"name", "seed", "resolution_s", "arrival_tick_s", "max_time_s", "policy",
             "policy_file", "suspensions", "scheduler", "retry", "destinations", "traffic",
             "events", "zipf"}
    for key in data:
        if key not in known:
            problems.append((str(key), "unknown key"))
    # Policy and suspensions.
    if policy is None:
        try:
            policy = parse_policy(data.get("policy"), source)
        except PolicyError as exc:
            problems.extend((f"policy.{p}" if p and not p.startswith("[") else f"policy{p}", m)
                            for p, m in exc.problems)
            policy = Policy()
    try:
        extra = parse_suspensions(data.get("suspensions"), source, "suspensions")
    except PolicyError as exc:
        problems.extend(exc.problems)
        extra = ()
    if extra:
        policy = Policy(policy.counters, policy.suspensions + extra, policy.source)
    # Scheduler settings.
    sdata = data.get("scheduler") or {}
    settings = Settings(max_deliveries=1000)
    if not isinstance(sdata, Mapping):
        problems.append(("scheduler", "a mapping of scheduler settings"))
    else:
        values: dict[str, Any] = {}
        for key, value in sdata.items():
            if key not in _SETTINGS_KEYS:
                problems.append((f"scheduler.{key}", "unknown key"))
                continue
            values[key] = value
        try:
            settings = Settings(**{"max_deliveries": 1000, **values})
        except (TypeError, ValueError) as exc:
            problems.append(("scheduler", str(exc)))
    # Retry rules.
    rdata = data.get("retry") or {}
    retry = DEFAULT_RETRY
    if not isinstance(rdata, Mapping):
        problems.append(("retry", "a mapping: delays_s, maxtime_s"))
    else:
        for key in rdata:
            if key not in ("delays_s", "maxtime_s", "granularity_s"):
                problems.append((f"retry.{key}", "unknown key"))
        delays = rdata.get("delays_s", list(retry.delays_s))
        if not isinstance(delays, list) or not delays or not all(
                isinstance(d, int | float) and not isinstance(d, bool) and d > 0 for d in delays):
            problems.append(("retry.delays_s", "a list of positive seconds"))
            delays = list(retry.delays_s)
        retry = RetryPolicy(
            delays_s=tuple(float(d) for d in delays),
            granularity_s=_num(rdata, "granularity_s", "retry", problems, 0.0),
            maxtime_s=_num(rdata, "maxtime_s", "retry", problems, retry.maxtime_s, minimum=1),
            maxtime_reports_s=retry.maxtime_reports_s,
        )
    # Destinations: generated ones (count) and named ones.
    ddata = data.get("destinations")
    dests: list[DestinationSpec] = []
    if not isinstance(ddata, Mapping):
        problems.append(("destinations", "a mapping: generated (count, name, ...) and/or "
                                         "named: [{domain: ...}]"))
    else:
        for key in ddata:
            if key not in ("generated", "named"):
                problems.append((f"destinations.{key}", "unknown key (generated, named)"))
        gen = ddata.get("generated")
        if gen is not None:
            if not isinstance(gen, Mapping):
                problems.append(("destinations.generated", "a mapping"))
            else:
                count = _num(gen, "count", "destinations.generated", problems, 0, integer=True)
                name = str(gen.get("name", "d{i}.example"))
                mx_name = str(gen.get("mx_name", "mx.{domain}"))
                template = _dest_spec(gen, "destinations.generated", problems, "", None)
                width = len(str(max(count - 1, 0)))
                for i in range(count):
                    n = str(i).zfill(width)
                    domain = name.replace("{i}", n)
                    dests.append(DestinationSpec(
                        domain=domain, mx=mx_name.replace("{domain}", domain).replace("{i}", n),
                        remoteip=f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}",
                        latency_s=template.latency_s, jitter=template.jitter,
                        connect_timeout_s=template.connect_timeout_s,
                        max_per_minute=template.max_per_minute,
                        max_concurrency=template.max_concurrency,
                        greylist_s=template.greylist_s, temp_fail_rate=template.temp_fail_rate,
                        perm_fail_rate=template.perm_fail_rate, dead=template.dead,
                        weight=template.weight))
        named = ddata.get("named") or []
        if not isinstance(named, list):
            problems.append(("destinations.named", "a list of {domain: ..., ...}"))
        else:
            for i, item in enumerate(named):
                path = f"destinations.named[{i}]"
                if not isinstance(item, Mapping) or not isinstance(item.get("domain"), str):
                    problems.append((path, "a destination needs a domain"))
                    continue
                spec = _dest_spec(item, path, problems, item["domain"].lower(), None)
                if not spec.mx:
                    spec = DestinationSpec(**{**_asdict(spec), "mx": f"mx.{spec.domain}"})
                if not spec.remoteip:
                    spec = DestinationSpec(**{**_asdict(spec), "remoteip": f"10.255.0.{i % 256}"})
                dests.append(spec)
    names = [d.domain for d in dests]
    if len(set(names)) != len(names):
        problems.append(("destinations", "a domain is listed twice"))
    if not dests and isinstance(ddata, Mapping):
        problems.append(("destinations", "no destinations"))
    # Traffic.
    flows: list[FlowSpec] = []
    tdata = data.get("traffic")
    if not isinstance(tdata, list) or not tdata:
        problems.append(("traffic", "a list of flows: {tenant, messages, rate_per_s, ...}"))
    else:
        flow_keys = {"tenant", "messages", "rate_per_s", "start_s", "jobid", "transportid",
                     "localip", "priority", "destinations"}
        known_names = set(names)
        for i, item in enumerate(tdata):
            path = f"traffic[{i}]"
            if not isinstance(item, Mapping):
                problems.append((path, "a flow is a mapping"))
                continue
            for key in item:
                if key not in flow_keys:
                    problems.append((f"{path}.{key}", "unknown key"))
            localip = item.get("localip") or []
            if isinstance(localip, str):
                localip = [localip]
            fdests = item.get("destinations") or []
            if not isinstance(fdests, list):
                problems.append((f"{path}.destinations", "a list of domains"))
                fdests = []
            for d in fdests:
                if str(d).lower() not in known_names:
                    problems.append((f"{path}.destinations", f"unknown destination {d!r}"))
            priority = _num(item, "priority", path, problems, 0, integer=True)
            if priority not in (0, 1):
                problems.append((f"{path}.priority", "0 or 1"))
                priority = 0
            flows.append(FlowSpec(
                tenant=str(item.get("tenant", f"tenant{i}")),
                messages=_num(item, "messages", path, problems, 0, integer=True),
                rate_per_s=_num(item, "rate_per_s", path, problems, 1000.0, minimum=1e-9),
                start_s=_num(item, "start_s", path, problems, 0.0),
                jobid=str(item.get("jobid", "")),
                transportid=str(item.get("transportid", "")),
                localip=tuple(str(x) for x in localip),
                priority=priority,
                destinations=tuple(str(d).lower() for d in fdests),
            ))
    # Operator actions.
    actions: list[OperatorAction] = []
    edata = data.get("events") or []
    if not isinstance(edata, list):
        problems.append(("events", "a list of {at_s, suspend | lift}"))
    else:
        for i, item in enumerate(edata):
            path = f"events[{i}]"
            if not isinstance(item, Mapping) or "at_s" not in item:
                problems.append((path, "an event needs at_s, and suspend or lift"))
                continue
            at = _num(item, "at_s", path, problems, 0.0)
            if "suspend" in item:
                try:
                    susp = parse_suspension(item["suspend"], f"{path}.suspend", source)
                except PolicyError as exc:
                    problems.extend(exc.problems)
                    continue
                actions.append(OperatorAction(at, susp, _num(item, "ttl_s", path, problems,
                                                             None)))
            elif "lift" in item:
                actions.append(OperatorAction(at, lift=str(item["lift"])))
            else:
                problems.append((path, "an event needs suspend or lift"))
    if problems:
        raise ScenarioError(source, problems)
    return Scenario(
        name=str(data.get("name", source)),
        destinations=tuple(dests),
        flows=tuple(flows),
        policy=policy,
        settings=settings,
        retry=retry,
        actions=tuple(sorted(actions, key=lambda a: a.at_s)),
        seed=_num(data, "seed", "", problems, 1, integer=True),
        resolution_s=_num(data, "resolution_s", "", problems, 0.01, minimum=1e-6),
        arrival_tick_s=_num(data, "arrival_tick_s", "", problems, 0.1, minimum=1e-6),
        max_time_s=_num(data, "max_time_s", "", problems, 7 * 86400.0, minimum=1),
        zipf=_num(data, "zipf", "", problems, 0.0),
    )


def _asdict(spec: DestinationSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in DestinationSpec.__dataclass_fields__}
