"""The shaping rules file: schema errors name file and key; the shipped rules match their tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.shaping.engine import Apply, Engine
from sluice.shaping.rulefile import ShapingError, default_rules_path, load_file, load_rules
from sluice.shaping.rules import Action, Observation

pytestmark = pytest.mark.unit

SHIPPED = load_file(default_rules_path())

#: An MX host of each provider a shipped rule names, to place the test reply.
HOSTS = {
    "*.google.com": "alt1.gmail-smtp-in.l.google.com",
    "*.yahoodns.net": "mta5.am0.yahoodns.net",
    "*.protection.outlook.com": "outlook-com.olc.protection.outlook.com",
    "*.comcast.net": "mx1.comcast.net",
    "*.mail.icloud.com": "mx01.mail.icloud.com",
    "*.gmx.net": "mx00.gmx.net",
    "*.web.de": "mx-ha02.web.de",
}


def placed(rule_where: tuple[tuple[str, str], ...], line: str) -> Observation:
    mx = dict(rule_where).get("remotemx", "mx.example.net")
    return Observation.from_line(line, 0.0, recipientdomain="example.net",
                                 remotemx=HOSTS.get(mx, mx), remoteip="192.0.2.7")


@pytest.mark.parametrize("rule", SHIPPED, ids=lambda r: r.name)
def test_each_shipped_rule_matches_its_test_reply_and_is_the_first_to(rule: object) -> None:
    from sluice.shaping.rules import Rule
    assert isinstance(rule, Rule)
    assert rule.test, f"{rule.name} has no test reply"
    obs = placed(rule.where.fields, rule.test)
    assert rule.matches(obs)
    first = next(r for r in SHIPPED if r.matches(obs))
    assert first.name == rule.name


@pytest.mark.parametrize("line", [
    "550 5.1.1 The email account that you tried to reach does not exist.",
    "250 2.0.0 OK",
    "451 4.7.1 Greylisted, please try again in 300 seconds",
    "450 4.2.0 <a@example.net>: Recipient address rejected: Greylisted for 5 minutes",
    "452 4.2.2 The email account that you tried to reach is over quota.",
])
def test_ordinary_replies_set_off_nothing(line: str) -> None:
    engine = Engine(SHIPPED)
    for i in range(20):
        obs = Observation.from_line(line, float(i), recipientdomain="gmail.com",
                                    remotemx="alt1.gmail-smtp-in.l.google.com")
        assert engine.observe(obs) == []


def test_gmail_rate_limit_backs_off_at_once() -> None:
    engine = Engine(SHIPPED)
    obs = placed((("remotemx", "*.google.com"),),
                 "421-4.7.28 [192.0.2.7] Gmail has detected an unusual rate")
    [out] = engine.observe(obs)
    assert isinstance(out, Apply) and out.fired.rule == "gmail-rate"
    assert out.fired.action is Action.BACKOFF


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "shaping.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(("text", "expected"), [
    ("rules:\n  - name: a\n    reply: {code: 421}\n    action: explode\n",
     "rules[0].action: 'explode' is not one of"),
    ("rules:\n  - name: a\n    reply: {code: 421}\n    action: suspend\n    colour: red\n",
     "rules[0].colour: unknown key"),
    ("rules:\n  - name: a\n    reply: {regex: '(('}\n    action: suspend\n",
     "rules[0].reply.regex: bad regular expression"),
    ("rules:\n  - name: a\n    where: {domain: 'gmail .com'}\n    reply: {code: 421}\n"
     "    action: suspend\n", "rules[0].where.domain:"),
    ("rules:\n  - name: a\n    reply: {code: 421}\n    action: suspend\n"
     "  - name: a\n    reply: {code: 421}\n    action: suspend\n",
     "rules[1].name: rule 'a' is named twice"),
    ("rules:\n  - name: a\n    reply: {code: 421}\n    action: suspend\n"
     "    trigger: {within: soon}\n", "rules[0].trigger.within:"),
    ("rules:\n  - name: a\n    where: {mx: '*'}\n    reply: {code: 421}\n"
     "    action: suspend\n", "rules[0].where.mx: '*' would match every host"),
    ("rules:\n  - name: a\n    where: {mx: '*.google,com'}\n    reply: {code: 421}\n"
     "    action: suspend\n", "rules[0].where.mx: '*.google,com' is not a host name pattern"),
    ("rules:\n  - name: a\n    where: {mx: '*..google.com'}\n    reply: {code: 421}\n"
     "    action: backoff\n", "rules[0].where.mx: '*..google.com' is not a host name pattern"),
    ("rules:\n  - name: a\n    where: {tenant: acme, mx: '/(/'}\n    reply: {code: 421}\n"
     "    action: suspend\n", "rules[0].where.mx: bad regular expression"),
    ("rules: [\n", "invalid YAML at line"),
])
def test_errors_are_one_line_naming_file_and_key(tmp_path: Path, text: str,
                                                 expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ShapingError) as info:
        load_rules(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert expected in message, message
    assert len(message.splitlines()) == 1


def test_own_rules_come_first_replace_and_disable_shipped_ones(tmp_path: Path) -> None:
    path = write(tmp_path, (
        "disable: [yahoo-ts03]\n"
        "rules:\n"
        "  - name: gmail-rate\n    where: {mx: '*.google.com'}\n"
        "    reply: {code: 421, enhanced: 4.7.28}\n    action: suspend\n    duration: 10m\n"
        "  - name: mine\n    where: {domain: example.org}\n    reply: {code: 452}\n"
        "    trigger: {matches: 3, within: 5m}\n    action: condition\n"
        "    thresholds: {concurrency: 1, rate: 1/10}\n"))
    rules = load_rules(path)
    names = [r.name for r in rules]
    assert names[:2] == ["gmail-rate", "mine"]
    assert names.count("gmail-rate") == 1 and "yahoo-ts03" not in names
    assert rules[0].action is Action.SUSPEND and rules[0].duration_s == 600
    assert rules[1].trigger.matches == 3 and rules[1].trigger.within_s == 300
    assert [r.name for r in load_rules(path, defaults=False)] == ["gmail-rate", "mine"]
    assert load_rules(None, defaults=False) == ()
