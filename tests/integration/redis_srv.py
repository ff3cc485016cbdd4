"""A throwaway Redis for the cluster tests (Debian's redis-server on a loopback port)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sluice.cluster._redisserver import RedisServer, find_redis


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if find_redis() is None:
        pytest.skip("redis-server is not installed (scripts/setup installs it)")
    server = RedisServer.start(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()
