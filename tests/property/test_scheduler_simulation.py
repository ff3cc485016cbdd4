"""Random small scenarios through the simulator's engine (hypothesis).

Whatever the destinations do (throttle, greylist, fail, die for a while)
and whatever the policy, every message ends delivered or bounced, and no
limit is exceeded: per destination its concurrency limit, overall
max_deliveries, and in memory maxmemoryqueue.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.scheduler.simulation import Simulation, parse_scenario

pytestmark = pytest.mark.property

POLICIES: list[Any] = [
    None,
    [{"fields": ["recipientdomain"], "concurrency": 2}],
    [{"fields": ["localip", "recipientdomain"], "concurrency": 3, "rate": "5/1"}],
    {"policies": [{"fields": [{"recipientdomain": {"big": ["big*"]}}],
                   "conditions": [{"if": {"recipientdomain": "#big"},
                                   "then": {"concurrency": 4}}],
                   "default": {"concurrency": 1, "connectinterval": 0.5}}]},
    [{"fields": ["tenantid"], "concurrency": 5}, {"concurrency": 8}],
]

destination = st.fixed_dictionaries({
    "latency_s": st.sampled_from([0.05, 0.3, 2.0]),
}, optional={
    "max_per_minute": st.integers(20, 200),
    "max_concurrency": st.integers(1, 6),
    "greylist_s": st.sampled_from([10, 100]),
    "temp_fail_rate": st.sampled_from([0.1, 0.5]),
    "perm_fail_rate": st.sampled_from([0.05, 0.5]),
    "dead": st.just([[0, 50]]),
})

flow = st.fixed_dictionaries({
    "messages": st.integers(1, 120),
    "rate_per_s": st.sampled_from([5, 50, 500]),
    "localip": st.sampled_from([[], ["10.0.0.1"], ["10.0.0.1", "10.0.0.2"]]),
    "priority": st.integers(0, 1),
    "start_s": st.sampled_from([0, 10]),
})


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    dests = draw(st.lists(destination, min_size=1, max_size=4))
    named = [{"domain": f"{'big' if i == 0 else 'd'}{i}.example", **d}
             for i, d in enumerate(dests)]
    flows = draw(st.lists(flow, min_size=1, max_size=3))
    for i, f in enumerate(flows):
        f["tenant"] = f"t{i % 2}"
    return {
        "seed": draw(st.integers(0, 1000)),
        "policy": draw(st.sampled_from(POLICIES)),
        "scheduler": {
            "max_deliveries": draw(st.integers(1, 20)),
            "maxmemoryqueue": draw(st.integers(5, 200)),
            "refill_batch": draw(st.integers(1, 100)),
            "initial_destination_concurrency": draw(st.integers(1, 3)),
            "dead_destination_ttl_s": 20,
        },
        "retry": {"delays_s": [5, 20, 60], "maxtime_s": 1800},
        "destinations": {"named": named},
        "traffic": flows,
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_message_ends_delivered_or_bounced_within_the_limits(data: dict[str, Any]) -> None:
    scenario = parse_scenario(data)
    report = Simulation(scenario).run()
    assert report.drained, f"{report.remaining} messages still queued"
    assert report.delivered + report.bounced == scenario.messages
    assert report.peak_inflight <= scenario.settings.max_deliveries
    assert report.peak_memory <= scenario.settings.maxmemoryqueue
    for dest in report.destinations:
        assert dest.limit is not None and dest.peak_concurrency <= dest.limit, dest
        assert dest.delivered + dest.bounced == dest.messages
    for tenant in report.tenants:
        if tenant.limit is not None:
            assert tenant.peak_concurrency <= tenant.limit
