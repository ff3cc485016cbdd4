"""Lines over 998 characters: accepted by `sluice serve`, folded on delivery as Postfix does,
or passed on unchanged when delivery.smtp_line_length_limit is 0."""

from __future__ import annotations

import contextlib
import re
import smtplib
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP

from tests.integration.serving import free_port, serving, wait_until
from tests.integration.test_delivery_peers import SinkHandler

pytestmark = pytest.mark.integration

#: One line of 5,000 characters, as an HTML mailer without line breaks writes it.
LONG = ("<p>" + "".join(f"cell {i:04d} " for i in range(500)))[:5000].encode()
MESSAGE = (b"From: app@sender.example\r\nTo: bob@ok.example\r\nSubject: long line\r\n\r\n"
           b"<html>\r\n" + LONG + b"\r\n</html>\r\n")


class _LongLineSMTP(SMTP):
    line_length_limit = 1 << 20  # a next hop that takes long lines, as Postfix's smtpd does


class _LongLineController(Controller):
    def factory(self) -> SMTP:
        return _LongLineSMTP(self.handler, **self.SMTP_kwargs)


@contextlib.contextmanager
def next_hop() -> Iterator[tuple[SinkHandler, int]]:
    handler = SinkHandler()
    port = free_port()
    controller = _LongLineController(handler, hostname="127.0.0.1", port=port,
                                     server_hostname="sink.test")
    controller.start()
    try:
        yield handler, port
    finally:
        controller.stop()


def deliver(tmp_path: Path, **delivery: object) -> bytes:
    with next_hop() as (handler, port), serving(
            tmp_path, delivery={"transport": {"*": f"smtp:[127.0.0.1]:{port}"}, **delivery}
    ) as srv:
        with smtplib.SMTP("127.0.0.1", srv.port, local_hostname="client.test") as c:
            assert c.sendmail("app@sender.example", ["bob@ok.example"], MESSAGE) == {}
        assert wait_until(lambda: len(handler.messages) == 1, 60)
    (msg,) = handler.messages
    return msg.data


def test_long_line_is_accepted_and_folded_as_postfix_does(tmp_path: Path) -> None:
    data = deliver(tmp_path)
    lines = data.split(b"\r\n")
    assert max(map(len, lines)) == 998
    start = lines.index(LONG[:998])
    # then SP + 997 characters at a time, the last piece what is left
    rest = LONG[998:]
    pieces = [rest[i:i + 997] for i in range(0, len(rest), 997)]
    assert lines[start + 1:start + 1 + len(pieces)] == [b" " + p for p in pieces]
    assert lines[start + 1 + len(pieces)] == b"</html>"
    # nothing else changed: taking the inserted CRLF SP out gives the message back
    assert data.replace(b"\r\n ", b"").endswith(MESSAGE)
    assert re.search(rb"^Received: from client\.test", data)


def test_long_line_passes_unchanged_when_folding_is_off(tmp_path: Path) -> None:
    data = deliver(tmp_path, smtp_line_length_limit=0)
    assert data.endswith(MESSAGE)
    assert b"\r\n" + LONG + b"\r\n" in data
