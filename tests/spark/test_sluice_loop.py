"""The loop end to end: a real `sluice serve` -> accounting log -> report and
suppression list -> a restarted Sluice refuses the suppressed recipient.

Sluice relays everything to the project's programmable sink: ok.example
accepts, grey.example greylists (451 once, then accepts), bad.example
rejects (550 5.1.1).  The report's totals are checked against what the sink
received; the suppress job's list is then given to Sluice in
suppression.path, and RCPT TO a listed address gets 550 5.1.1.
"""

from __future__ import annotations

import smtplib
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.pipeline.jobs import run_jobs
from sluice.sink import Behaviour, Sink
from sluice.suppression import SuppressionList
from tests.integration.serving import serving, wait_until

pytestmark = [pytest.mark.spark, pytest.mark.integration, pytest.mark.slow]

MSG = b"Subject: analytics loop\r\n\r\nbody\r\n"


@pytest.fixture
def sink() -> Iterator[tuple[Sink, int]]:
    s = Sink({"grey.example": Behaviour("greylist"), "bad.example": Behaviour("reject")})
    port = s.start_in_thread()
    yield s, port
    s.stop_thread()


def _send(port: int, rcpts: list[str]) -> None:
    with smtplib.SMTP("127.0.0.1", port, local_hostname="client.test", timeout=30) as c:
        c.sendmail("news@sender.example", rcpts, MSG)


def test_report_and_suppression_loop(spark, tmp_path: Path, sink: tuple[Sink, int]) -> None:
    s, sport = sink
    relay = {"transport": {"*": f"smtp:[127.0.0.1]:{sport}"}}
    listed = tmp_path / "suppression.jsonl"
    ok = [f"user{i}@ok.example" for i in range(12)]
    grey = [f"g{i}@grey.example" for i in range(3)]
    bad = ["nobody@bad.example", "gone@bad.example"]
    with serving(tmp_path, delivery=relay) as srv:
        _send(srv.port, ok[:6] + grey)
        _send(srv.port, ok[6:] + bad[:1])
        _send(srv.port, bad[1:])
        # 15 recipients delivered and one NDR per message with a bounce
        assert wait_until(lambda: s.snapshot().total_delivered == 17, 60)
        assert wait_until(lambda: srv.recipients_left() == 0, 60)
    sunk = s.snapshot()
    (report, _, suppress) = run_jobs(
        spark, [str(tmp_path / "log" / "*.jsonl")], str(tmp_path / "analytics"),
        ["report", "bounces", "suppress"],
        options={"suppress": {"list_path": str(listed)}},
    )
    totals = report.counts
    assert totals["delivered"] == sunk.total_delivered
    assert totals["bounced"] == len(bad)
    assert totals["deferred"] >= len(grey)  # greylisted once each
    assert totals["received"] == totals["delivered"] + totals["bounced"]
    assert suppress.counts["found_hard"] == len(bad)
    assert sorted(e.address for e in SuppressionList.load(listed)) == sorted(bad)

    # Sluice now reads the list and refuses those recipients at RCPT TO.
    with serving(tmp_path, delivery=relay,
                 suppression={"path": str(listed), "mode": "reject"}) as srv, \
            smtplib.SMTP("127.0.0.1", srv.port, local_hostname="client.test", timeout=30) as c:
        c.ehlo()
        c.mail("news@sender.example")
        code, text = c.rcpt("Nobody@Bad.Example")
        assert code == 550
        assert text.decode().startswith("5.1.1 <nobody@bad.example>: recipient address "
                                        "suppressed")
        assert c.rcpt("user0@ok.example")[0] == 250
