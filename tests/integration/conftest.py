from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.sink import Sink
from sluice.store import Store
from tests.integration.stores import FLAVOURS, open_flavour


@pytest.fixture(params=FLAVOURS)
def flavour(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(flavour: str, tmp_path: Path) -> Iterator[Store]:
    s = open_flavour(flavour, tmp_path)
    yield s
    s.close()


@pytest.fixture
def kept_sink() -> Iterator[tuple[Sink, int]]:
    """The programmable sink (aiosmtpd) on a free loopback port, keeping every message."""
    s = Sink(keep=True)
    port = s.start_in_thread()
    yield s, port
    s.stop_thread()
