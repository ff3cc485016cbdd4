"""`sluice sendmail` as programs run it: Postfix's options, the suppression
list, -bs, and the hand-over to a running server that holds a kv queue.
Real processes, real stores, a real `sluice serve` and a real next hop."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from sluice.config import load_config
from sluice.queue import Queue
from sluice.sink import Sink
from tests.conftest import SLUICE, subprocess_env, write_config
from tests.integration.serving import serving, wait_until
from tests.integration.test_cli import qlist, run

pytestmark = pytest.mark.integration


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    return write_config(tmp_path)


def content(cfg: Path, spid: str) -> bytes:
    with Queue.open(load_config(str(cfg))) as queue, queue.store.open_content(spid) as fh:
        return fh.read()


def spid_of(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.stdout.startswith("queued "), proc.stdout + proc.stderr
    return proc.stdout.split()[1]


def test_the_options_programs_pass(cfg: Path) -> None:
    """cron and PHP: -oi -t; git send-email: -i -f X; mutt: -oem -oi -F; -r, -odi."""
    msg = (b"To: Ann <ann@example.net>, bob@example.net\nCc: cc@example.net\n"
           b"Bcc: hidden@example.net\nSubject: t\n\nline\n.\nafter the dot\n")
    spid = spid_of(run(cfg, "sendmail", "-oi", "-t", "-fcron@example.org", stdin=msg))
    rows, _ = qlist(cfg)
    assert sorted((r["Sender"], r["Recipient"]) for r in rows) == [
        ("cron@example.org", r) for r in
        ("ann@example.net", "bob@example.net", "cc@example.net", "hidden@example.net")]
    text = content(cfg, spid)
    assert b"Bcc:" not in text and text.endswith(b"line\n.\nafter the dot\n")
    assert b"From: <cron@example.org>" in text

    spid = spid_of(run(cfg, "sendmail", "-i", "-odi", "-oem", "-F", "Git Q. User",
                       "-f", "<git@example.org>", "--", "x@example.net", stdin=b"Subject: g\n\n"
                       b"x\n.\ny\n"))
    text = content(cfg, spid)
    assert b'From: "Git Q. User" <git@example.org>' in text and text.endswith(b"x\n.\ny\n")
    spid = spid_of(run(cfg, "sendmail", "-r", "", "-odb", "-N", "failure,delay", "-v",
                       "-ti", "y@example.net", stdin=b"Subject: r\n\nz\n"))
    rows, _ = qlist(cfg, "--recipient", "y@example.net")
    assert [(r["SPID"], r["Sender"]) for r in rows] == [(spid, "<>")]


def test_without_i_a_lone_dot_ends_the_message(cfg: Path) -> None:
    spid = spid_of(run(cfg, "sendmail", "-f", "a@example.org", "x@example.net",
                       stdin=b"Subject: d\n\nkept\n.\nnot read\n"))
    assert content(cfg, spid).endswith(b"\n\nkept\n")


def test_unknown_options_are_one_line_and_exit_2(cfg: Path) -> None:
    for args in (("-Q",), ("-bd",), ("-q",), ("--frobnicate",), ("-f",), ("-X", "log")):
        proc = run(cfg, "sendmail", "x@example.net", *args, stdin=b"Subject: u\n\n", check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("sluice: sendmail: ")
    rows, _ = qlist(cfg)
    assert rows == []


def test_bs_speaks_smtp_on_standard_input_and_output(cfg: Path) -> None:
    dialogue = (b"EHLO client\r\nMAIL FROM:<a@example.org>\r\nRCPT TO:<x@example.net>\r\n"
                b"DATA\r\nSubject: bs\r\n\r\n..one dot\r\n.\r\nQUIT\r\n")
    proc = run(cfg, "sendmail", "-bs", stdin=dialogue)
    codes = [line[:4] for line in proc.stdout.splitlines()]
    assert codes == ["220 ", "250-", "250-", "250-", "250 ", "250 ", "250 ", "354 ", "250 ",
                     "221 "], proc.stdout
    spid = proc.stdout.splitlines()[-2].split()[-1]
    assert content(cfg, spid).endswith(b"\r\n\r\n.one dot\r\n")


def suppression_config(tmp: Path, mode: str, **sections: dict[str, object]) -> Path:
    listed = tmp / "suppression.jsonl"
    listed.write_text(json.dumps({"address": "gone@example.net", "reason": "hard"}) + "\n"
                      + json.dumps({"address": "@closed.example"}) + "\n")
    return write_config(tmp, suppression={"path": str(listed), "mode": mode}, **sections)


def suppressed_events(tmp: Path) -> list[tuple[str, str]]:
    events = []
    for path in sorted((tmp / "log").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "suppressed":
                events.append((event["recipient"], event["sender"]))
    return events


def test_sendmail_applies_the_suppression_list(tmp_path: Path) -> None:
    cfg = suppression_config(tmp_path, "reject")
    proc = run(cfg, "sendmail", "-f", "a@example.org", "ok@example.net", "gone@example.net",
               "who@closed.example", stdin=b"Subject: s\n\n")
    assert proc.stderr.count("\n") == 2
    assert "<gone@example.net> not queued: 550 5.1.1" in proc.stderr
    assert "who@closed.example" in proc.stderr
    rows, _ = qlist(cfg)
    assert [r["Recipient"] for r in rows] == ["ok@example.net"]
    proc = run(cfg, "sendmail", "-f", "a@example.org", "gone@example.net",
               stdin=b"Subject: s\n\n", check=False)
    assert proc.returncode == 1 and "nothing queued" in proc.stderr
    assert sorted(suppressed_events(tmp_path)) == [
        ("gone@example.net", "a@example.org"), ("gone@example.net", "a@example.org"),
        ("who@closed.example", "a@example.org")]


def test_in_drop_mode_suppressed_recipients_are_left_out_quietly(tmp_path: Path) -> None:
    cfg = suppression_config(tmp_path, "drop")
    proc = run(cfg, "sendmail", "-f", "a@example.org", "ok@example.net", "gone@example.net",
               stdin=b"Subject: s\n\n")
    assert proc.stderr == "" and "for 1 recipient(s)" in proc.stdout
    rows, _ = qlist(cfg)
    assert [r["Recipient"] for r in rows] == ["ok@example.net"]
    assert suppressed_events(tmp_path) == [("gone@example.net", "a@example.org")]


def test_sendmail_named_sendmail_takes_postfix_options(tmp_path: Path, cfg: Path) -> None:
    link = tmp_path / "bin" / "sendmail"
    link.parent.mkdir()
    link.symlink_to(SLUICE)
    proc = subprocess.run([str(link), "-t", "-oi"], input=b"To: z@example.net\n\nhi\n",
                          capture_output=True, env=subprocess_env(SLUICE_CONFIG=str(cfg)),
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows, _ = qlist(cfg)
    assert [r["Recipient"] for r in rows] == ["z@example.net"]


@pytest.fixture
def sink(kept_sink: tuple[Sink, int]) -> tuple[Sink, int]:
    return kept_sink


def test_with_a_kv_queue_held_by_serve_sendmail_hands_the_message_over(
        tmp_path: Path, sink: tuple[Sink, int]) -> None:
    s, sport = sink
    listed = tmp_path / "suppression.jsonl"
    listed.write_text(json.dumps({"address": "gone@example.net"}) + "\n")
    with serving(tmp_path, queue={"store": "kv"},
                 delivery={"transport": {"*": f"smtp:[127.0.0.1]:{sport}"}},
                 suppression={"path": str(listed), "mode": "reject"}) as srv:
        env = subprocess_env()
        proc = subprocess.run(
            [SLUICE, "-c", str(srv.config), "sendmail", "-oi", "-t", "-F", "Cron Daemon",
             "-fcron@example.org"],
            input=b"To: ok@example.net, gone@example.net\nSubject: k\n\n.\nend\n",
            capture_output=True, env=env, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert f"by the running server at 127.0.0.1:{srv.port}" in proc.stdout.decode()
        assert "<gone@example.net> not queued: 550 5.1.1" in proc.stderr.decode()
        held = subprocess.run(
            [SLUICE, "-c", str(srv.config), "sendmail", "--hold", "x@example.net"],
            input=b"Subject: h\n\n", capture_output=True, env=env, timeout=60)
        assert held.returncode == 1 and b"--hold" in held.stderr
        assert held.stderr.count(b"\n") == 1
        assert wait_until(lambda: len(s.messages) == 1, 30)
    (msg,) = s.messages
    assert (msg.sender, msg.recipients) == ("cron@example.org", ("ok@example.net",))
    assert b"From: Cron Daemon <cron@example.org>" in msg.data
    assert msg.data.endswith(b"\r\n.\r\nend\r\n")
    assert os.path.isdir(tmp_path / "queue")
