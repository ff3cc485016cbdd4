"""Sluice: a mail transfer agent's queue manager.

See README.md and docs/ for the whole picture; DESIGN in docs/design.md.
"""

__version__ = "0.1.0"
