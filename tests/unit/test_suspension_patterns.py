"""A suspension may name an MX host (or domain) suffix: a provider's whole fleet (issue 17).

The registry is pure: times are plain numbers, no clock.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sluice.policyfile import load_suspensions_file
from sluice.scheduler.events import Route
from sluice.scheduler.policy import PolicyError, Suspension, host_pattern
from sluice.scheduler.suspensions import Suspensions

pytestmark = pytest.mark.unit

GMAIL = Route("gmail.com", remotemx="aspmx.l.google.com", remoteip="192.0.2.1")
GOOGLEMAIL = Route("googlemail.com", remotemx="alt1.aspmx.l.google.com", remoteip="192.0.2.2")
YAHOO = Route("yahoo.com", remotemx="mta5.am0.yahoodns.net", remoteip="192.0.2.3")
LOOKALIKE = Route("evil.test", remotemx="google.com.evil.test", remoteip="192.0.2.4")


def held(susps: Suspensions, route: Route, ip: str = "198.51.100.1") -> str | None:
    [found] = susps.lookup(route, [ip])
    return None if found is None else found.suspension.id


def test_a_suffix_suspension_holds_every_destination_on_the_providers_mx_hosts() -> None:
    susps = Suspensions()
    assert susps.add(Suspension((("remotemx", "*.google.com"),), "g", 700.0), 100.0,
                     from_file=False) is not None
    assert held(susps, GMAIL) == "g" and held(susps, GOOGLEMAIL) == "g"
    assert held(susps, YAHOO) is None and held(susps, LOOKALIKE) is None
    # Case and a trailing dot do not matter for host names.
    assert held(susps, Route("x.test", remotemx="ASPMX.L.Google.COM.")) == "g"
    assert held(susps, Route("x.test", remotemx="")) is None
    susps.remove("g")
    assert held(susps, GMAIL) is None and not susps.patterned


def test_a_pattern_with_other_fields_needs_them_all() -> None:
    susps = Suspensions()
    susps.add(Suspension((("remotemx", "*.google.com"), ("localip", "198.51.100.1")), "g"),
              0.0, from_file=False)
    assert susps.lookup(GMAIL, ["198.51.100.1", "198.51.100.2"])[1] is None
    assert held(susps, GMAIL, "198.51.100.1") == "g"


def test_an_exact_suspension_is_found_before_a_pattern_and_one_per_set_of_values() -> None:
    susps = Suspensions()
    susps.add(Suspension((("remotemx", "*.google.com"),), "g", 500.0), 0.0, from_file=False)
    susps.add(Suspension((("remotemx", "aspmx.l.google.com"),), "exact"), 0.0, from_file=False)
    assert held(susps, GMAIL) == "exact" and held(susps, GOOGLEMAIL) == "g"
    # The same pattern again moves the expiry of the one in force.
    again = susps.add(Suspension((("remotemx", "*.GOOGLE.com"),), "other", 900.0), 0.0,
                      from_file=False)
    assert again is not None and again.suspension.id == "g"
    assert again.suspension.expires_at == 900.0 and len(susps) == 2
    # An already expired one is not added.
    assert susps.add(Suspension((("recipientdomain", "*.example"),), "old", 5.0), 10.0,
                     from_file=False) is None
    assert not any(s.suspension.id == "old" for s in susps.patterned.values())


@pytest.mark.parametrize(("text", "error"), [
    ("*", "would match every host"),
    ("*.", "would match every host"),
    ("*.google,com", "not a host name pattern"),
    ("*.goo gle.com", "not a host name pattern"),
    ("*..google.com", "empty label"),
    ("/(/", "bad regular expression"),
])
def test_bad_host_patterns_are_refused(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        host_pattern(text)
    with pytest.raises(ValueError, match=error):
        Suspension((("remotemx", text),))


def test_patterns_only_for_host_names() -> None:
    assert host_pattern("*.protection.outlook.com").matches("x.mail.protection.outlook.com")
    assert host_pattern("/yahoodns\\.net$/").matches("mta5.am0.yahoodns.net")
    with pytest.raises(ValueError, match="tenantid exactly"):
        Suspension((("tenantid", "acme*"),))


def test_the_suspension_file_takes_a_suffix_and_names_file_and_key_for_a_bad_one(
        tmp_path: Path) -> None:
    path = tmp_path / "suspensions.yaml"
    path.write_text("- remotemx: '*.yahoodns.net'\n  reason: TS03\n")
    (susp,) = load_suspensions_file(str(path))
    assert susp.fields == (("remotemx", "*.yahoodns.net"),) and susp.is_pattern
    # What the file writes reads back (the API persists shaping's suspensions too).
    path.write_text(yaml.safe_dump([susp.to_data()]))
    assert load_suspensions_file(str(path)) == (susp,)
    path.write_text("- remotemx: '*'\n- tenantid: 'a*'\n")
    with pytest.raises(PolicyError) as info:
        load_suspensions_file(str(path))
    lines = str(info.value).splitlines()
    assert lines[0].startswith(f"{path}: [0].remotemx: '*' would match every host")
    assert lines[1].startswith(f"{path}: [1].tenantid: a suspension matches exact values")
