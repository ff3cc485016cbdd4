"""write_all, writev_all and pwritev_all finish what a short write leaves (sluice._fdio)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from sluice import _fdio


@pytest.fixture
def short_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """os.write and os.writev write at most 7 bytes a call, as under signals or quotas."""
    calls: list[int] = []
    real_write = os.write

    def write(fd: int, data: bytes | memoryview) -> int:
        n = real_write(fd, bytes(memoryview(data)[:7]))
        calls.append(n)
        return n

    def writev(fd: int, pieces: list[bytes | memoryview]) -> int:
        return write(fd, b"".join(pieces))

    real_pwrite = os.pwrite

    def pwrite(fd: int, data: bytes | memoryview, offset: int) -> int:
        n = real_pwrite(fd, bytes(memoryview(data)[:7]), offset)
        calls.append(n)
        return n

    def pwritev(fd: int, pieces: list[bytes | memoryview], offset: int) -> int:
        return pwrite(fd, b"".join(pieces), offset)

    monkeypatch.setattr(_fdio.os, "write", write)
    monkeypatch.setattr(_fdio.os, "writev", writev)
    monkeypatch.setattr(_fdio.os, "pwrite", pwrite)
    monkeypatch.setattr(_fdio.os, "pwritev", pwritev)
    return calls


def test_write_all_finishes_short_writes(tmp_path: Path, short_writes: list[int]) -> None:
    data = bytes(range(256)) * 3
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        _fdio.write_all(fd, data)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == data
    assert len(short_writes) == -(-len(data) // 7)


def test_writev_all_finishes_a_short_writev(tmp_path: Path, short_writes: list[int]) -> None:
    pieces: list[bytes | memoryview] = [b"header\n", memoryview(b"x" * 50), b"end"]
    total = sum(len(p) for p in pieces)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        _fdio.writev_all(fd, pieces, total)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"header\n" + b"x" * 50 + b"end"


def test_pwritev_all_finishes_short_writes_at_its_offset(tmp_path: Path,
                                                          short_writes: list[int]) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"-" * 10)
    pieces: list[bytes | memoryview] = [b"header\n", memoryview(b"x" * 50), b"end"]
    fd = os.open(path, os.O_WRONLY)
    try:
        assert _fdio.pwritev_all(fd, pieces, 60, 4) == 60
    finally:
        os.close(fd)
    assert path.read_bytes() == b"----header\n" + b"x" * 50 + b"end"


def test_pwritev_all_takes_more_pieces_than_one_call_may(tmp_path: Path) -> None:
    pieces = [bytes([i % 256]) * 3 for i in range(3 * _fdio.IOV_PIECES + 5)]
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        assert _fdio.pwritev_all(fd, pieces, 3 * len(pieces), 0) == 3 * len(pieces)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"".join(pieces)


def test_a_full_writev_is_one_call(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        _fdio.writev_all(fd, [b"a", b"bc"], 3)
        _fdio.write_all(fd, b"")
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"abc"


def test_write_all_by_gives_up_at_the_deadline_on_a_pipe_nobody_reads() -> None:
    r, w = os.pipe()
    try:
        data = b"x" * (4 << 20)  # more than any pipe holds
        # The deadline has passed: what the pipe takes is written, then False, at once.
        assert _fdio.write_all_by(w, data, time.monotonic() - 1.0) is False
        taken = len(os.read(r, len(data)))
        assert 0 < taken < len(data)
    finally:
        os.close(r)
        os.close(w)


def test_write_all_by_writes_everything_to_a_reader_that_reads() -> None:
    r, w = os.pipe()
    data = bytes(range(256)) * 8192  # 2 MB: many times a pipe's buffer
    got: list[bytes] = []

    def read_all() -> None:
        while chunk := os.read(r, 65536):
            got.append(chunk)

    reader = threading.Thread(target=read_all)
    reader.start()
    try:
        assert _fdio.write_all_by(w, data, time.monotonic() + 60.0) is True
    finally:
        os.close(w)
        reader.join()
        os.close(r)
    assert b"".join(got) == data


def test_write_all_by_to_a_reader_that_has_gone_raises() -> None:
    r, w = os.pipe()
    os.close(r)
    try:
        with pytest.raises(BrokenPipeError):
            _fdio.write_all_by(w, b"start", time.monotonic() + 60.0)
    finally:
        os.close(w)
