"""Where the shared peer-MTA harness is (../shared/bench), for the benchmarks that use it.

The harness is used from where it is, never copied.  It sits in shared/
beside the checkout (/work/main -> /work/shared), or one level further up
for a worktree (/work/wt/NAME -> /work/shared); SLUICE_BENCH_HARNESS names
another place.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def harness_dir() -> Path:
    """The harness directory; the first candidate when none holds e2e_run.py."""
    env = os.environ.get("SLUICE_BENCH_HARNESS")
    candidates = [Path(env)] if env else []
    candidates += [ROOT.parent / "shared" / "bench", ROOT.parent.parent / "shared" / "bench"]
    for c in candidates:
        if (c / "e2e_run.py").exists():
            return c.resolve()
    return candidates[0]
