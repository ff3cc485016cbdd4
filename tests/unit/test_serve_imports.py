"""`sluice serve` outside a cluster loads neither the Redis nor the PostgreSQL client.

They were a third of the queue manager's memory (24 of about 70 MB), and a
process killed with SIGKILL closes its connections only once the kernel has
freed all of its memory: the longer that takes, the more next hops answer
"250" to a sender that is gone, and the more messages go twice (docs/queue.md,
"no reply").  A fresh interpreter imports what `sluice serve` imports and
looks in sys.modules.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

CHECK = """
import json, sys
import sluice.runtime.serve
import sluice.runtime.manager
import sluice.store.kv, sluice.store.sqlite, sluice.store.fs
print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'psycopg', 'redis'})))
"""


def test_serve_without_a_cluster_imports_no_redis_or_postgresql_client() -> None:
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert json.loads(out) == []
