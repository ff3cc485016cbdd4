"""The Inbox: lines, overlong lines, DATA pieces that stop at the end mark, flow control."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from sluice.smtpd.inbox import HIGH_WATER, TOO_LONG, Inbox
from sluice.smtpd.protocol import LINE_READ_MAX

pytestmark = pytest.mark.unit


class Calls:
    def __init__(self) -> None:
        self.log: list[str] = []

    def pause(self) -> None:
        self.log.append("pause")

    def resume(self) -> None:
        self.log.append("resume")

    def flush(self) -> None:
        self.log.append("flush")


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def test_lines_come_out_whole_and_in_order() -> None:
    async def scenario() -> None:
        calls = Calls()
        inbox = Inbox(asyncio.get_running_loop(), calls.pause, calls.resume, calls.flush)
        inbox.feed(b"EHLO a\r\nMAIL FR")
        assert await inbox.readline() == b"EHLO a\r\n"
        reader = asyncio.ensure_future(inbox.readline())
        await asyncio.sleep(0)
        assert not reader.done()
        assert calls.log == ["flush"]  # replies go out before waiting for the client
        inbox.feed(b"OM:<a@b>\r\n")
        assert await reader == b"MAIL FROM:<a@b>\r\n"
        inbox.feed(b"QUIT")
        inbox.feed_eof()
        assert await inbox.readline() is None  # a partial last line is no command

    run(scenario)


def test_an_overlong_line_is_dropped_up_to_its_end() -> None:
    async def scenario() -> None:
        calls = Calls()
        inbox = Inbox(asyncio.get_running_loop(), calls.pause, calls.resume, calls.flush)
        reader = asyncio.ensure_future(inbox.readline())
        for _ in range(10):
            inbox.feed(b"x" * (LINE_READ_MAX // 4))
            await asyncio.sleep(0)
        inbox.feed(b"tail\r\nNOOP\r\n")
        assert await reader is TOO_LONG
        assert await inbox.readline() == b"NOOP\r\n"

    run(scenario)


def test_data_pieces_stop_at_the_end_mark() -> None:
    async def scenario() -> None:
        calls = Calls()
        inbox = Inbox(asyncio.get_running_loop(), calls.pause, calls.resume, calls.flush)
        inbox.feed(b"Subject: x\r\n\r\nbody\r\n.\r\nQUIT\r\n")
        assert await inbox.read_data_piece() == b"Subject: x\r\n\r\nbody\r\n.\r\n"
        assert await inbox.readline() == b"QUIT\r\n"  # the pipelined command is still there

    run(scenario)


def test_a_big_message_comes_in_pieces_that_keep_a_possible_mark() -> None:
    async def scenario() -> None:
        calls = Calls()
        inbox = Inbox(asyncio.get_running_loop(), calls.pause, calls.resume, calls.flush)
        inbox.feed(b"y" * (HIGH_WATER + 10) + b".\r")
        assert calls.log == ["pause"]  # too much buffered: stop reading the socket
        piece = await inbox.read_data_piece()
        assert piece is not None
        assert piece.endswith(b"y") and len(piece) == HIGH_WATER + 10
        assert calls.log == ["pause", "resume"]
        inbox.feed(b"\n")
        assert await inbox.read_data_piece() == b".\r\n"

    run(scenario)


def test_discard_forgets_what_came_before_tls() -> None:
    async def scenario() -> None:
        calls = Calls()
        inbox = Inbox(asyncio.get_running_loop(), calls.pause, calls.resume, calls.flush)
        inbox.feed(b"MAIL FROM:<injected@x>\r\n")
        inbox.discard()
        inbox.feed(b"EHLO a\r\n")
        assert await inbox.readline() == b"EHLO a\r\n"

    run(scenario)
