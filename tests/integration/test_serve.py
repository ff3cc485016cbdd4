"""`sluice serve` end to end against real peers on loopback.

Clients: Python's smtplib, swaks and Postfix's smtp-source.  Next hops:
the programmable sink (aiosmtpd) and Postfix's smtp-sink.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import email
import email.policy
import json
import os
import shutil
import smtplib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiosmtpd.controller import Controller

from sluice.sink import Behaviour, Sink
from tests.integration.serving import free_port, serving, wait_until
from tests.integration.test_delivery_peers import SinkHandler

pytestmark = pytest.mark.integration


@pytest.fixture
def sink() -> Iterator[tuple[Sink, int]]:
    s = Sink({"grey.example": Behaviour("greylist"), "bad.example": Behaviour("reject")},
             keep=True)
    port = s.start_in_thread()
    yield s, port
    s.stop_thread()


def relay_to(port: int) -> dict[str, object]:
    return {"transport": {"*": f"smtp:[127.0.0.1]:{port}"}}


def send(port: int, sender: str, rcpts: list[str], data: bytes, **kw: object) -> None:
    with smtplib.SMTP("127.0.0.1", port, local_hostname="client.test", **kw) as c:  # type: ignore[arg-type]
        c.sendmail(sender, rcpts, data)


def test_byte_exact_round_trip(tmp_path: Path, sink: tuple[Sink, int]) -> None:
    s, sport = sink
    body = (
        "From: Zoë <zoe@sender.example>\r\n"
        "To: bob@ok.example\r\n"
        "Subject: =?utf-8?q?Gr=C3=BC=C3=9Fe?= und Grüße\r\n"
        "\r\n"
        ".leading dot\r\n"
        "..two dots\r\n"
        ".\r\n"
        "a line of 990 characters: " + "x" * 964 + "\r\n"
        "8-bit: \xe9t\xe9, ünïcödé ✓\r\n"
        "last line without a newline"
    ).encode("utf-8")
    with serving(tmp_path, delivery=relay_to(sport)) as srv:
        with smtplib.SMTP("127.0.0.1", srv.port, local_hostname="client.test") as c:
            c.sendmail("zoe@sender.example", ["bob@ok.example"], body,
                       mail_options=["SMTPUTF8", "BODY=8BITMIME"])
        assert wait_until(lambda: s.snapshot().total_delivered == 1, 20)
    (msg,) = s.messages
    assert msg.data.startswith(b"Received: from client.test ([127.0.0.1])")
    # smtplib adds the final CRLF a message must end with; nothing else changes.
    assert msg.data.endswith(body + b"\r\n")
    header_end = msg.data.index(b"\r\n\r\n")
    assert msg.data[header_end:] == body[body.index(b"\r\n\r\n"):] + b"\r\n"


def test_each_delivery_sends_its_own_message_when_many_start_together(tmp_path: Path) -> None:
    """Deliveries started in one loop step share one read of their contents (SQLite).

    Greylisting sends every first attempt back, so the retries come due
    together; each message goes to two domains, i.e. two deliveries of one
    content.  A third of them are over the store's inline limit (64 KiB):
    those are not read ahead but opened from their spool files, in the same
    steps.  Every recipient must get the body made for it, byte for byte.
    """
    s = Sink({"a.example": Behaviour("greylist"), "b.example": Behaviour("greylist")},
             keep=True)
    sport = s.start_in_thread()
    n = 24

    def text(i: int) -> str:
        return "x" * (i * 37) + ("\r\n" + "y" * 70) * (1000 if i % 3 == 0 else 0)

    try:
        with serving(tmp_path, delivery=relay_to(sport)) as srv:
            def one(i: int) -> None:
                body = f"Subject: m{i}\r\n\r\nfor u{i} only: {text(i)}\r\n".encode()
                send(srv.port, "s@sender.example", [f"u{i}@a.example", f"u{i}@b.example"], body)

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(one, range(n)))
            assert wait_until(lambda: s.snapshot().total_delivered == 2 * n, 60)
    finally:
        s.stop_thread()
    got = {r: m.data for m in s.messages for r in m.recipients}
    assert sorted(got) == sorted(f"u{i}@{d}.example" for i in range(n) for d in "ab")
    for rcpt, data in got.items():
        i = int(rcpt[1:rcpt.index("@")])
        assert data.endswith(f"\r\n\r\nfor u{i} only: {text(i)}\r\n".encode()), rcpt
    assert sum(len(d) > 65536 for d in got.values()) == 16  # 8 messages, 2 domains each


@contextlib.contextmanager
def recording_sink(smtputf8: bool) -> Iterator[tuple[SinkHandler, int]]:
    """An aiosmtpd next hop that offers SMTPUTF8 or not and records each MAIL's options."""
    handler = SinkHandler()
    port = free_port()
    controller = Controller(handler, hostname="127.0.0.1", port=port,
                            server_hostname="sink.test", enable_SMTPUTF8=smtputf8)
    controller.start()
    try:
        yield handler, port
    finally:
        controller.stop()


def test_smtputf8_received_goes_on_only_where_the_next_hop_can_take_it(tmp_path: Path
                                                                      ) -> None:
    """Received with SMTPUTF8, ASCII addresses: to a next hop without
    SMTPUTF8 a UTF-8 Subject bounces with 5.6.9, and so does a UTF-8
    attachment name far into the message; an all-ASCII message is
    delivered as it is; a next hop with SMTPUTF8 is told on MAIL, for the
    NDR too."""
    utf8_subject = "Subject: Grüße ☃\r\n\r\nbody\r\n".encode()
    ascii_only = b"Subject: plain\r\n\r\nbody\r\n"
    utf8_attachment = (
        b'Subject: plain\r\nContent-Type: multipart/mixed; boundary="b"\r\n\r\n'
        b"--b\r\n\r\n" + (b"x" * 76 + b"\r\n") * 2000 + b"--b\r\nContent-Type: text/plain; "
        + 'name="Grüße.txt"\r\n\r\nattached\r\n--b--\r\n'.encode())
    with recording_sink(smtputf8=False) as (old, old_port), \
            recording_sink(smtputf8=True) as (new, new_port):
        transport = {"old.example": f"smtp:[127.0.0.1]:{old_port}",
                     "*": f"smtp:[127.0.0.1]:{new_port}"}
        with serving(tmp_path, delivery={"transport": transport}) as srv:
            with smtplib.SMTP("127.0.0.1", srv.port, local_hostname="client.test") as c:
                for rcpt, data in (("bounce@old.example", utf8_subject),
                                   ("ascii@old.example", ascii_only),
                                   ("utf8@new.example", utf8_subject),
                                   ("ascii@new.example", ascii_only)):
                    c.sendmail("alice@sender.example", [rcpt], data,
                               mail_options=["SMTPUTF8"])
                c.sendmail("bob@sender.example", ["attached@old.example"], utf8_attachment,
                           mail_options=["SMTPUTF8"])
            # The NDRs go to the senders, whose domain the "*" next hop takes.
            assert wait_until(lambda: len(new.messages) == 4 and len(old.messages) == 1, 30), (
                [m.recipients for m in old.messages], [m.recipients for m in new.messages],
                srv.run("qlist").stdout)
            assert wait_until(lambda: srv.recipients_left() == 0, 30)
    (delivered,) = old.messages
    assert delivered.recipients == ("ascii@old.example",)
    assert delivered.data.endswith(ascii_only) and "SMTPUTF8" not in delivered.mail_options
    by_rcpt = {m.recipients[0]: m for m in new.messages}
    assert "SMTPUTF8" in by_rcpt["utf8@new.example"].mail_options
    assert "SMTPUTF8" in by_rcpt["ascii@new.example"].mail_options  # all ASCII, but flagged
    ndr = by_rcpt["alice@sender.example"]
    assert ndr.sender == "<>"
    # The NDR is flagged like the message it reports on (RFC 6533): it quotes
    # the UTF-8 header block as message/global-headers, and says SMTPUTF8.
    assert "SMTPUTF8" in ndr.mail_options
    report = email.message_from_bytes(ndr.data, policy=email.policy.default)
    _, status_part, headers_part = report.iter_parts()
    status = status_part.get_payload()[1]
    assert status["Final-Recipient"] == "rfc822; bounce@old.example"
    assert status["Status"] == "5.6.9"
    assert "SMTPUTF8 is required" in status["Diagnostic-Code"]
    assert headers_part.get_content_type() == "message/global-headers"
    assert b"\r\n" + utf8_subject[:utf8_subject.index(b"\r\n") + 2] in ndr.data
    # The attachment's NDR: the same refusal, and an ASCII header block.
    report = email.message_from_bytes(by_rcpt["bob@sender.example"].data,
                                      policy=email.policy.default)
    _, status_part, headers_part = report.iter_parts()
    status = status_part.get_payload()[1]
    assert status["Final-Recipient"] == "rfc822; attached@old.example"
    assert status["Status"] == "5.6.9"
    assert headers_part.get_content_type() == "text/rfc822-headers"


def test_greylisting_then_delivery_and_bounce_with_ndr(tmp_path: Path,
                                                       sink: tuple[Sink, int]) -> None:
    s, sport = sink
    with serving(tmp_path, delivery=relay_to(sport)) as srv:
        msg = b"Subject: hello\r\n\r\nbody\r\n"
        send(srv.port, "alice@sender.example", ["a@ok.example", "b@grey.example"], msg)
        send(srv.port, "alice@sender.example", ["c@bad.example"], msg)
        assert wait_until(lambda: s.snapshot().delivered["grey.example"] == 1, 30)
        assert wait_until(lambda: s.snapshot().delivered["sender.example"] == 1, 30)
        assert wait_until(lambda: srv.recipients_left() == 0, 30)
    snap = s.snapshot()
    assert snap.replies[("grey.example", 451)] == 1  # refused once, delivered on retry
    assert snap.delivered["ok.example"] == 1
    ndr = next(m for m in s.messages if m.recipients == ("alice@sender.example",))
    assert ndr.sender == "<>"
    report = email.message_from_bytes(ndr.data, policy=email.policy.default)
    assert report.get_content_type() == "multipart/report"
    status = list(report.iter_parts())[1].get_payload()[1]
    assert status["Final-Recipient"] == "rfc822; c@bad.example"
    assert status["Status"] == "5.1.1"
    assert "no such user" in status["Diagnostic-Code"]
    events = [json.loads(line)["event"] for f in sorted((tmp_path / "log").glob("*.jsonl"))
              for line in f.read_text().splitlines()]
    for kind in ("received", "delivered", "deferred", "bounced", "ndr"):
        assert kind in events


def test_a_slow_destination_does_not_delay_a_fast_one(tmp_path: Path) -> None:
    slow = Sink(default=Behaviour("slow", seconds=1.0))
    fast = Sink()
    slow_port, fast_port = slow.start_in_thread(), fast.start_in_thread()
    policy = tmp_path / "policy.yaml"
    policy.write_text("- fields:\n  - recipientdomain\n  concurrency: 2\n")
    try:
        with serving(tmp_path, scheduler={"policy": str(policy)},
                     delivery={"transport": {"slow.example": f"smtp:[127.0.0.1]:{slow_port}",
                                             "fast.example": f"smtp:[127.0.0.1]:{fast_port}"}}
                     ) as srv:
            msg = b"Subject: x\r\n\r\nbody\r\n"
            t0 = time.monotonic()
            for i in range(20):
                send(srv.port, "s@sender.example", [f"u{i}@slow.example"], msg)
                send(srv.port, "s@sender.example", [f"u{i}@fast.example"], msg)
            assert wait_until(lambda: fast.snapshot().total_delivered == 20, 30)
            fast_done = time.monotonic() - t0
            slow_so_far = slow.snapshot().total_delivered
            assert wait_until(lambda: slow.snapshot().total_delivered == 20, 60)
            slow_done = time.monotonic() - t0
        # 20 slow messages, 2 at a time, 1 s each: about 10 s.  The fast
        # ones do not wait for them.
        assert slow_so_far < 20
        assert fast_done < slow_done / 2, (fast_done, slow_done)
        assert slow.snapshot().peak_connections <= 2
    finally:
        slow.stop_thread()
        fast.stop_thread()


def test_the_sink_never_sees_more_connections_than_the_policy_allows(tmp_path: Path) -> None:
    s = Sink(default=Behaviour("slow", seconds=0.2))
    sport = s.start_in_thread()
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "- fields:\n    - recipientdomain\n  if:\n    recipientdomain: limited.example\n"
        "    concurrency: 3\n  concurrency: 10\n")
    try:
        with serving(tmp_path, scheduler={"policy": str(policy)},
                     delivery=relay_to(sport)) as srv:
            msg = b"Subject: x\r\n\r\nbody\r\n"
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda i: send(srv.port, "s@sender.example",
                                             [f"u{i}@limited.example"], msg), range(40)))
            assert wait_until(lambda: s.snapshot().total_delivered == 40, 60)
        snap = s.snapshot()
        assert snap.peak_connections <= 3
        assert snap.peak_by_domain["limited.example"] <= 3
        assert snap.peak_connections >= 2  # it did go in parallel (slow start begins at 2)
    finally:
        s.stop_thread()


def test_rate_limits_hold_at_the_sink(tmp_path: Path) -> None:
    s = Sink()
    sport = s.start_in_thread()
    policy = tmp_path / "policy.yaml"
    policy.write_text("- fields:\n  - recipientdomain\n  rate: 5/1\n")
    try:
        with serving(tmp_path, scheduler={"policy": str(policy)},
                     delivery=relay_to(sport)) as srv:
            msg = b"Subject: x\r\n\r\nbody\r\n"
            for i in range(20):
                send(srv.port, "s@sender.example", [f"u{i}@rated.example"], msg)
            assert wait_until(lambda: s.snapshot().total_delivered == 20, 60)
        times = sorted(s.snapshot().accepted_at["rated.example"])
        # No window of (1 s less 150 ms for a delivery's own time: the sink
        # notes the end of the data, not the pickup) holds more than 5.  A
        # CI run once saw one delivery of a second's five end 50-60 ms late.
        for i, t in enumerate(times):
            within = sum(1 for u in times[i:] if u - t < 0.85)
            assert within <= 5, (i, [round(u - times[0], 3) for u in times])
        assert times[-1] - times[0] >= 2.9  # 20 at 5 a second: at least three windows on
    finally:
        s.stop_thread()


def test_relay_is_denied_to_an_outsider(tmp_path: Path, sink: tuple[Sink, int]) -> None:
    s, sport = sink
    with serving(tmp_path, delivery=relay_to(sport),
                 smtpd={"mynetworks": ["127.0.0.1/32"], "relay_domains": ["local.example"]}
                 ) as srv:
        with smtplib.SMTP("127.0.0.1", srv.port, local_hostname="outsider.test",
                          source_address=("127.0.0.2", 0)) as c:
            with pytest.raises(smtplib.SMTPRecipientsRefused) as info:
                c.sendmail("x@outsider.test", ["victim@elsewhere.example"], b"Subject: x\r\n\r\n")
            code, text = info.value.recipients["victim@elsewhere.example"]
            assert code == 554 and b"5.7.1" in text
            # but mail for our own domain is taken from anyone
            c.sendmail("x@outsider.test", ["postmaster@local.example"], b"Subject: x\r\n\r\nhi\r\n")
        assert wait_until(lambda: s.snapshot().delivered["local.example"] == 1, 20)
        assert s.snapshot().delivered["elsewhere.example"] == 0


@pytest.mark.skipif(shutil.which("swaks") is None, reason="swaks is installed by scripts/setup")
def test_swaks_client(tmp_path: Path, sink: tuple[Sink, int]) -> None:
    s, sport = sink
    with serving(tmp_path, delivery=relay_to(sport)) as srv:
        proc = subprocess.run(
            ["swaks", "--server", f"127.0.0.1:{srv.port}", "--from", "a@sender.example",
             "--to", "b@ok.example,c@ok.example", "--helo", "swaks.test", "--pipeline"],
            capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "250 2.0.0" in proc.stdout
        assert wait_until(lambda: s.snapshot().delivered["ok.example"] == 2, 20)
    assert s.messages[0].recipients == ("b@ok.example", "c@ok.example")  # one transaction


def test_smtp_source_load_through_two_receivers_to_smtp_sink(tmp_path: Path) -> None:
    sink_port = free_port()
    as_user = ["-u", "nobody"] if os.geteuid() == 0 else []  # smtp-sink refuses root
    sink = subprocess.Popen(["smtp-sink", *as_user, f"127.0.0.1:{sink_port}", "100"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        with serving(tmp_path, delivery=relay_to(sink_port), smtpd={"processes": 2}) as srv:
            proc = subprocess.run(
                ["smtp-source", "-s", "10", "-m", "300", "-l", "1024", "-c",
                 "-f", "load@sender.example", "-t", "rcpt@d1.example",
                 f"127.0.0.1:{srv.port}"], capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert wait_until(lambda: srv.recipients_left() == 0, 60)
            lines = [json.loads(line) for f in (tmp_path / "log").glob("*.jsonl")
                     for line in f.read_text().splitlines()]
        assert sum(1 for e in lines if e["event"] == "received") == 300
        assert sum(1 for e in lines if e["event"] == "delivered") == 300
    finally:
        sink.terminate()
        sink.wait()


def test_why_asks_the_running_server_then_the_store(tmp_path: Path,
                                                    sink: tuple[Sink, int]) -> None:
    _, sport = sink
    policy = tmp_path / "policy.yaml"
    policy.write_text("- fields:\n    - recipientdomain\n  if:\n    recipientdomain: "
                      "blocked.example\n    concurrency: 0\n  concurrency: 10\n")
    api_port = free_port()
    with serving(tmp_path, delivery=relay_to(sport), scheduler={"policy": str(policy)},
                 api={"enabled": True, "listen": f"127.0.0.1:{api_port}",
                      "tokens": {"ops": "0123456789abcdef0123"}}) as srv:
        send(srv.port, "a@sender.example", ["u@blocked.example"], b"Subject: x\r\n\r\nx\r\n")
        qid = ""

        def queued() -> bool:
            nonlocal qid
            rows = srv.run("qlist").stdout.splitlines()[1:-1]
            qid = rows[0].split(";")[0] if rows else ""
            return bool(qid)

        assert wait_until(queued, 20)
        assert wait_until(lambda: "concurrency 0" in srv.run("why", qid).stdout, 20)
        live = srv.run("why", qid).stdout
        assert "counter recipientdomain [recipientdomain=blocked.example]" in live
    stored = srv.run("why", qid).stdout  # no server now: the store's view
    assert "waiting for the next refill" in stored  # its claim was given back at stop
    assert "concurrency 0" not in stored
