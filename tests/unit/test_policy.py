"""Pickup policy parsing: both spellings, groups, conditions, and the errors (pure)."""

from __future__ import annotations

import pytest

from sluice.scheduler import (
    Pattern,
    PolicyError,
    Rate,
    Suspension,
    Thresholds,
    parse_policy,
    parse_suspensions,
)

pytestmark = pytest.mark.unit

# The examples of seed 004, section 2.3.1, as docs/policies.md reads them.
SEED_LOCALIP = [{"fields": ["localip"], "concurrency": 10000}]
SEED_HALON_IO = [{
    "fields": ["localip", "recipientdomain"],
    "if": {"recipientdomain": "halon.io", "concurrency": 2},
    "concurrency": 5,
}]
SEED_GROUPS = [
    {
        "fields": ["localip",
                   {"remotemx": {"gsuite": ["*.google.com", "*.googlemail.com", "*.smtp.goog"]}}],
        "if": {"remotemx": "#gsuite", "concurrency": 10, "rate": 50},
        "concurrency": 5,
        "rate": 10,
    },
    {
        "fields": ["localip", {"remotemx": {"o365": ["*.protection.outlook.com"]}}, "remoteip"],
        "if": {"remotemx": "#o365", "concurrency": 10, "rate": 30},
    },
]
HALON_GROUPS = {"policies": [
    {
        "fields": ["localip",
                   {"remotemx": {"gsuite": ["*.google.com", "*.googlemail.com", "*.smtp.goog"]}}],
        "conditions": [{"if": {"remotemx": "#gsuite"}, "then": {"concurrency": 10, "rate": 50}}],
        "default": {"concurrency": 5, "rate": 10},
    },
    {
        "fields": ["localip", {"remotemx": {"o365": ["*.protection.outlook.com"]}}, "remoteip"],
        "conditions": [{"if": {"remotemx": "#o365"}, "then": {"concurrency": 10, "rate": 30}}],
    },
]}


def test_the_localip_example_is_one_counter_with_a_fallback() -> None:
    policy = parse_policy(SEED_LOCALIP)
    (counter,) = policy.counters
    assert counter.field_names == ("localip",)
    assert counter.conditions == ()
    assert counter.default == Thresholds(concurrency=10000)
    assert counter.id == "localip"


def test_the_halon_io_condition_wins_and_the_counter_falls_back() -> None:
    (counter,) = parse_policy(SEED_HALON_IO).counters
    assert counter.thresholds_for(("192.0.2.1", "halon.io"))[0] == Thresholds(concurrency=2)
    assert counter.thresholds_for(("192.0.2.1", "example.com"))[0] == Thresholds(concurrency=5)


def test_both_spellings_give_the_same_policy() -> None:
    compact = parse_policy(SEED_GROUPS)
    halon = parse_policy(HALON_GROUPS)
    assert compact.counters == halon.counters


def test_groups_roll_values_up_and_conditions_name_them() -> None:
    gsuite, o365 = parse_policy(SEED_GROUPS).counters
    spec = gsuite.fields[1]
    assert spec.component("aspmx.l.google.com") == "#gsuite"
    assert spec.component("ALT1.ASPMX.L.GOOGLE.COM") == "#gsuite"  # wildcards ignore case
    assert spec.component("mx.smtp.goog") == "#gsuite"
    assert spec.component("mx.example.com") == "mx.example.com"
    assert gsuite.thresholds_for(("ip", "#gsuite"))[0] == Thresholds(10, Rate(50, 1.0))
    assert gsuite.thresholds_for(("ip", "mx.example.com"))[0] == Thresholds(5, Rate(10, 1.0))
    # The o365 counter has no fall-back: only Outlook MXs are limited.
    assert o365.thresholds_for(("ip", "#o365", "203.0.113.5"))[0] == Thresholds(10, Rate(30))
    assert o365.thresholds_for(("ip", "mx.example.com", "203.0.113.5"))[0].is_empty


def test_conditions_are_evaluated_first_to_last() -> None:
    (counter,) = parse_policy([{
        "fields": ["recipientdomain"],
        "if": [{"recipientdomain": "/\\.io$/", "concurrency": 1},
               {"recipientdomain": "halon.io", "concurrency": 7}],
    }]).counters
    # The general condition above the specific one always wins (seed 004).
    assert counter.thresholds_for(("halon.io",))[0].concurrency == 1


def test_regex_patterns_and_rates_with_an_interval() -> None:
    (counter,) = parse_policy([{
        "fields": [{"remotemx": {"yahoo": ["/^mta[0-9]+\\.am0\\.yahoodns\\.net$/"]}}],
        "rate": "120/60", "connectinterval": 2,
    }]).counters
    assert counter.fields[0].component("mta7.am0.yahoodns.net") == "#yahoo"
    assert counter.fields[0].component("xmta7.am0.yahoodns.net") != "#yahoo"
    assert counter.default == Thresholds(None, Rate(120, 60.0), 2.0)


def test_a_counter_without_fields_is_global() -> None:
    (counter,) = parse_policy([{"concurrency": 100}]).counters
    assert counter.fields == ()
    assert counter.id == "global"
    assert counter.thresholds_for(())[0].concurrency == 100


def test_two_counters_over_the_same_fields_get_distinct_ids() -> None:
    a, b = parse_policy([{"fields": ["localip"], "concurrency": 1},
                         {"fields": ["localip"], "rate": 5}]).counters
    assert a.id == "localip"
    assert b.id == "localip#2"


def test_every_problem_is_reported_with_its_key_path() -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy({"policies": [
            {"fields": ["localip", "sender"], "concurrency": -1},
            {"fields": [{"remotemx": {"g": ["/([/"]}}], "rate": "fast"},
            {"fields": ["localip"], "if": {"recipientdomain": "x.com", "concurrency": 1}},
            {"fields": [{"remotemx": {"g": ["*.google.com"]}}],
             "conditions": [{"if": {"remotemx": "#nope"}, "then": {"concurrency": 1}}]},
            {"fields": ["localip"], "default": {"concurrency": 1}, "concurrency": 2},
        ], "suspends": [{"transportid": ""}], "extra": 1}, source="p.yaml")
    paths = [p for p, _ in err.value.problems]
    assert "policies[0].fields[1]" in paths  # unknown field
    assert "policies[0].concurrency" in paths  # negative
    assert "policies[1].fields[0].remotemx.g[0]" in paths  # bad regex
    assert "policies[1].rate" in paths
    assert "policies[2].if.recipientdomain" in paths  # not a field of the counter
    assert "policies[3].conditions[0].if.remotemx" in paths  # unknown group
    assert "policies[4]" in paths  # default twice
    assert "suspends[0].transportid" in paths
    assert "extra" in paths
    assert str(err.value).splitlines()[0].startswith("p.yaml: ")


def test_a_condition_cannot_mix_then_and_inline_thresholds() -> None:
    with pytest.raises(PolicyError, match="either under 'then'"):
        parse_policy({"policies": [{
            "fields": ["localip"],
            "conditions": [{"if": {"localip": "1.2.3.4"}, "then": {"concurrency": 1},
                            "concurrency": 2}],
        }]})


def test_an_empty_policy_file_is_no_counters() -> None:
    assert parse_policy(None).counters == ()
    assert parse_policy([]).counters == ()
    assert parse_policy({"policies": None}).counters == ()


def test_the_policy_round_trips_through_to_data() -> None:
    policy = parse_policy(HALON_GROUPS)
    again = parse_policy({"policies": [
        {k: v for k, v in c.items() if k != "id"} for c in policy.to_data()["policies"]]})
    assert again.counters == policy.counters


def test_the_seed_suspension_examples_parse() -> None:
    customer, pool = parse_suspensions([
        {"transportid": "customer1", "recipientdomain": "gmail.com"},
        {"localip": "192.0.2.10", "recipientdomain": "Gmail.COM", "tag": "warmup",
         "reason": "IP warming", "expires_at": 1800000000},
    ])
    assert customer.fields == (("recipientdomain", "gmail.com"), ("transportid", "customer1"))
    assert customer.id == "recipientdomain=gmail.com,transportid=customer1"
    assert pool.fields == (("localip", "192.0.2.10"), ("recipientdomain", "gmail.com"))
    assert (pool.tag, pool.reason, pool.expires_at) == ("warmup", "IP warming", 1.8e9)


def test_suspension_errors() -> None:
    with pytest.raises(PolicyError) as err:
        parse_suspensions([{}, {"localip": None}, {"recipientdomain": "*"}, "x"])
    assert [p for p, _ in err.value.problems] == ["[0]", "[1].localip", "[2].recipientdomain",
                                                  "[3]"]
    with pytest.raises(ValueError, match="at least one field"):
        Suspension(())


def test_pattern_kinds() -> None:
    assert Pattern.is_pattern("*.x") and Pattern.is_pattern("/a/") and Pattern.is_pattern("/a/i")
    assert not Pattern.is_pattern("halon.io")
    assert Pattern.compile("/^A/i").matches("abc")
    assert not Pattern.compile("/^A/").matches("abc")
