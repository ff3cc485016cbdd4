"""Several Sluice nodes as one MTA: limits shared in Redis, nodes watched in PostgreSQL.

See docs/cluster.md.  ``enabled(config)`` says whether this node is part of
a cluster (``cluster.redis`` or $SLUICE_REDIS_URL is set).
"""

from __future__ import annotations

import os

from sluice.config import Config

__all__ = ["enabled"]


def enabled(config: Config) -> bool:
    """Whether the configuration makes this node share its limits."""
    return bool(os.environ.get("SLUICE_REDIS_URL") or config.cluster.redis)
