"""sluice.logs: one handler, one line per event, levels by module, mail log lines."""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import sluice.logs as logs
from sluice.accounting import EventKind, make_event
from sluice.config import LoggingConfig
from sluice.model import QueueEntry, QueueState, Reply

pytestmark = pytest.mark.unit


@pytest.fixture
def restore() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    named = {n: logging.getLogger(n).level for n in ("sluice.smtpd", "sluice.mail", "sluice.x")}
    enabled, maillog = logs._enabled, logs._maillog
    env = os.environ.get(logs.LOG_LEVEL_ENV)
    yield
    if env is None:
        os.environ.pop(logs.LOG_LEVEL_ENV, None)
    else:
        os.environ[logs.LOG_LEVEL_ENV] = env
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    for n, lv in named.items():
        logging.getLogger(n).setLevel(lv)
    if logs._maillog is not None and logs._maillog is not maillog:
        logs._maillog.close()
    logs._enabled, logs._maillog = enabled, maillog


def _event(kind: EventKind, **kw: object) -> dict[str, object]:
    entry = QueueEntry(spid="019A2B3C4D5E6F70", idx=0, sender="s@shop.test",
                       recipient="r@example.com", state=QueueState.INCOMING, arrival_at=100.0,
                       next_attempt_at=100.0, size=10)
    return make_event(kind, entry, 112.5, **kw)  # type: ignore[arg-type]


def test_setup_twice_still_writes_each_record_once(restore: None) -> None:
    out = io.StringIO()
    logs.setup_logging(LoggingConfig(), stream=out)
    logs.setup_logging(LoggingConfig(), stream=out)
    logs.ready("up")
    logging.getLogger("sluice.x").info("hello")
    assert [line.split(" ", 2)[2] for line in out.getvalue().splitlines()] == [
        "INFO sluice.ready: up", "INFO sluice.x: hello"]


def test_levels_by_module_and_the_ready_line_at_every_level(restore: None) -> None:
    out = io.StringIO()
    logs.setup_logging(LoggingConfig(levels={"sluice.smtpd": "debug"}), "warning", stream=out)
    logging.getLogger("sluice.x").info("quiet")
    logging.getLogger("sluice.smtpd").debug("loud")
    logs.ready("up")
    text = out.getvalue()
    assert "quiet" not in text and "DEBUG sluice.smtpd: loud" in text and "up" in text


def test_json_lines_carry_the_event_and_never_span_lines(restore: None) -> None:
    out = io.StringIO()
    logs.setup_logging(LoggingConfig(format="json"), stream=out)
    logs.publish([_event(EventKind.DEFERRED, reply=Reply(451, "4.7.1", "later\r\nplease"))])
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("sluice.x").exception("failed")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["level"] == "WARNING" and first["logger"] == "sluice.mail"
    assert first["event"]["recipient"] == "r@example.com"
    assert "(451 4.7.1 later  please)" in first["message"]
    assert second["message"] == "failed" and "ValueError: boom" in second["exc"]


def test_failures_still_show_at_level_warning(restore: None) -> None:
    out = io.StringIO()
    logs.setup_logging(LoggingConfig(level="warning"), stream=out)
    logs.publish([_event(EventKind.DELIVERED, reply=Reply(250, "2.0.0", "Ok")),
                  _event(EventKind.EXPIRED)])
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "WARNING sluice.mail: expired" in lines[0]


def test_publish_is_silent_until_logging_is_set_up(restore: None,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    logs._enabled = False
    logs.publish([_event(EventKind.BOUNCED, reply=Reply(550, "5.1.1", "no"))])
    assert capsys.readouterr().err == ""


def test_mail_log_lines_as_postfix_writes_them(restore: None, tmp_path: Path) -> None:
    hop = {"remotemx": "mx.example.com", "remoteip": "203.0.113.5", "duration_s": 0.25}
    sent = logs.maillog_line(_event(EventKind.DELIVERED, reply=Reply(250, "2.0.0", "Ok"),
                                    **hop), host="mx1", pid=7)
    assert sent == ("1970-01-01T00:01:52.500+00:00 mx1 sluice/smtp[7]: 019A2B3C4D5E6F70: "
                    "to=<r@example.com>, relay=mx.example.com[203.0.113.5], delay=12.5, "
                    "delays=0/12.25/0/0.25, dsn=2.0.0, status=sent (250 2.0.0 Ok)")
    bounced = logs.maillog_line(_event(EventKind.BOUNCED, reply=Reply(550, "", "no")), pid=7)
    assert bounced is not None
    assert "sluice/error[7]" in bounced and "relay=none" in bounced
    assert "dsn=5.0.0, status=bounced (550 no)" in bounced
    assert logs.maillog_line(_event(EventKind.HELD)) is None
    path = tmp_path / "maillog"
    logs.setup_logging(LoggingConfig(maillog=str(path)), stream=io.StringIO(), hostname="mx9")
    logs.publish([_event(EventKind.RECEIVED), _event(EventKind.HELD)])
    path.rename(tmp_path / "maillog.1")  # logrotate moves it away
    logs._maillog._checked = 0.0  # type: ignore[union-attr]
    logs.publish([_event(EventKind.EXPIRED)])
    assert "mx9 sluice/qmgr[" in (tmp_path / "maillog.1").read_text()
    assert "status=expired, returned to sender" in path.read_text()
