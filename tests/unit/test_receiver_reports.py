"""A receiving process's report line, as ReceiverPool reads it (sluice.smtpd.worker)."""

from __future__ import annotations

from sluice.smtpd.worker import _report


def test_a_ready_report_gives_its_addresses() -> None:
    assert _report(7, b'["ready", 7, [["127.0.0.1", 2525], ["::1", 2525]]]') == (
        "ready", 7, [["127.0.0.1", 2525], ["::1", 2525]])


def test_an_error_report_keeps_its_message() -> None:
    assert _report(7, b'["error", 7, "cannot listen on 127.0.0.1:25: in use"]') == (
        "error", 7, "cannot listen on 127.0.0.1:25: in use")


def test_a_line_that_is_not_a_report_is_an_error_naming_the_process() -> None:
    for line in (b"Traceback (most recent call last):", b"[1, 2]", b'{"ready": 1}',
                 b'["started", 7, []]'):
        kind, pid, message = _report(7, line)
        assert (kind, pid) == ("error", 7)
        assert message.startswith("receiver 7 reported ") and repr(line[:20])[2:-1] in message
