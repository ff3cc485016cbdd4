"""Sluice: a mail transfer agent's queue manager.

See README.md and docs/ for the whole picture; DESIGN in docs/design.md.
"""

from pathlib import Path

from sluice import _native

__version__ = "0.1.0"

# A compiled module runs only while it matches its source (see _native.py).
_native.guard(Path(__file__).resolve().parent.parent)
