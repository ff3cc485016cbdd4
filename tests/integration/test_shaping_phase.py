"""The SMTP phase of a reply, from a real peer on loopback to a shaping rule.

The delivery agent talks to raw and aiosmtpd servers that refuse at the
greeting, at EHLO, at MAIL, at RCPT, at DATA and after the final dot; each
result's reply must say the phase it came in, and a rule restricted to
``rcpt`` must fire for a RCPT refusal and stay silent for a DATA refusal.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from sluice.delivery.agent import DeliveryResult
from sluice.model import Delivered
from sluice.scheduler import Event, Route, SuspensionAdded, parse_policy
from sluice.shaping.runtime import Shaper
from tests.conftest import make_config
from tests.integration.test_delivery_peers import SinkHandler, mini_smtp, raw_server, run, sink
from tests.integration.test_delivery_smtp import hop, make_agent, request

pytestmark = pytest.mark.integration

EHLO_PLAIN = b"250-mini.test\r\n250 8BITMIME\r\n"
EHLO_PIPELINING = b"250-mini.test\r\n250 PIPELINING\r\n"


def refuse(prefix: bytes, reply: bytes) -> Callable[[bytes], bytes | None]:
    """An on_command that answers the commands starting with ``prefix`` with ``reply``."""
    return lambda line: reply if line.upper().startswith(prefix) else None


def phases(res: DeliveryResult) -> list[tuple[str, int, str]]:
    return [(e.recipient, o.reply.code, o.reply.phase) for e, o in res.outcomes]


async def raw(rcpts: tuple[str, ...], **kw: object) -> DeliveryResult:
    async with raw_server(mini_smtp(**kw)) as port:  # type: ignore[arg-type]
        return await make_agent().deliver(request(hop(port), *rcpts))


@pytest.mark.parametrize("ehlo", [EHLO_PLAIN, EHLO_PIPELINING], ids=["lockstep", "pipelined"])
def test_each_refusal_carries_the_phase_it_came_in(ehlo: bytes) -> None:
    async def scenario() -> None:
        one = ("a@dest.test",)
        greeting = await raw(one, greeting=b"421 4.7.0 too busy\r\n", ehlo=ehlo)
        assert phases(greeting) == [("a@dest.test", 421, "connect")]
        hello = await raw(one, ehlo=ehlo, on_command=refuse(b"EHLO", b"421 4.7.0 not you\r\n"))
        assert phases(hello) == [("a@dest.test", 421, "helo")]
        mail = await raw(("a@dest.test", "b@dest.test"), ehlo=ehlo,
                         on_command=refuse(b"MAIL", b"553 5.7.1 sender rejected\r\n"))
        assert phases(mail) == [("a@dest.test", 553, "mail"), ("b@dest.test", 553, "mail")]
        rcpt = await raw(("a@dest.test", "b@dest.test"), ehlo=ehlo,
                         on_command=refuse(b"RCPT TO:<B@", b"550 5.1.1 no such user\r\n"))
        assert phases(rcpt) == [("a@dest.test", 250, "end-of-data"),
                                ("b@dest.test", 550, "rcpt")]
        data = await raw(one, ehlo=ehlo, on_command=refuse(b"DATA", b"554 5.7.1 not now\r\n"))
        assert phases(data) == [("a@dest.test", 554, "data")]

    run(scenario())


@pytest.mark.parametrize("pipelining", [False, True], ids=["lockstep", "pipelined"])
def test_a_refusal_after_the_final_dot_is_end_of_data(pipelining: bool) -> None:
    async def scenario() -> None:
        handler = SinkHandler(data_reply="451 4.7.1 try later", pipelining=pipelining)
        async with sink(handler) as s:
            res = await make_agent().deliver(request(hop(s.port), "a@dest.test"))
        assert phases(res) == [("a@dest.test", 451, "end-of-data")]

    run(scenario())


def test_a_stalled_rcpt_times_out_in_the_rcpt_phase() -> None:
    async def scenario() -> None:
        res = await raw(("a@dest.test",), ehlo=EHLO_PLAIN, stall_on=b"RCPT")
        assert phases(res) == [("a@dest.test", 451, "rcpt")]

    run(scenario())


RCPT_RULE = ("rules:\n  - name: rcpt-only\n    reply: {code: 5xx, phase: [rcpt]}\n"
             "    action: suspend\n    duration: 10m\n")


def shaper(tmp: Path) -> tuple[Shaper, list[Event]]:
    path = tmp / "rules.yaml"
    path.write_text(RCPT_RULE)
    config = make_config(tmp, delivery={"shaping": str(path), "shaping_defaults": False})
    events: list[Event] = []
    policy = Shaper.augment(parse_policy(None))
    return Shaper(config, events.append, lambda: policy, lambda: 1000.0), events


def test_a_rule_on_rcpt_fires_for_a_rcpt_refusal_not_for_a_data_refusal(tmp_path: Path) -> None:
    async def scenario() -> tuple[DeliveryResult, DeliveryResult]:
        data = await raw(("a@dest.test",), ehlo=EHLO_PIPELINING,
                         on_command=refuse(b"DATA", b"554 5.7.1 not now\r\n"))
        rcpt = await raw(("a@dest.test",), ehlo=EHLO_PIPELINING,
                         on_command=refuse(b"RCPT", b"554 5.7.1 not now\r\n"))
        return data, rcpt

    data, rcpt = run(scenario())
    # Same code, same text: only the phase tells them apart.
    assert [str(o.reply) for _, o in data.outcomes] == [str(o.reply) for _, o in rcpt.outcomes]
    assert not any(isinstance(o, Delivered) for _, o in data.outcomes + rcpt.outcomes)
    shape, events = shaper(tmp_path)
    route = Route("dest.test", remotemx="mx0.test", remoteip="127.0.0.1")
    shape.observe(route, data.attempt_results())
    assert events == []
    shape.observe(route, rcpt.attempt_results())
    [added] = events
    assert isinstance(added, SuspensionAdded)
    assert "rcpt-only" in added.suspension.reason
