"""Compiled modules: the hot path built by mypyc, used only while it matches its sources.

SUMMARY
    Which modules setup.py compiles to C with mypyc, and the guard that
    keeps a stale build from running.

DESCRIPTION
    Every message passes through the same few dozen functions: the SMTP
    server's protocol, the submission, the store's batches, the queue's
    records and the delivery client.  Their Python is most of Sluice's CPU
    per message (docs/benchmarks.md), and mypyc, which compiles
    type-checked Python to C extension modules, runs the same code with
    less of it.  The sources stay the truth: the code is the same, mypy
    --strict checks it, and every module runs unchanged without a build.

    STRATEGY.  setup.py (so `pip install .` and `pip install -e .` alike)
    compiles MODULES into one group and writes MANIFEST: the SHA-256 of each
    source it compiled.  An extension module sits next to its .py and
    Python prefers it.  So at `import sluice` this module checks, once,
    that every listed source still has the hash it was compiled from.  If
    one differs (an edit or a checkout after the build), if the manifest is
    missing, or if SLUICE_NATIVE=0 is set, a finder at the head of
    sys.meta_path loads every listed module from its .py file instead:
    all of them, since compiled modules call each other's C directly and a
    mix would run the old code of a changed module.  A stale build says so
    in one line on stderr, with the command that rebuilds it; SLUICE_NATIVE=0
    says nothing.

    What compiling changes, and the code here keeps to it: a compiled
    class has no __dict__, so its instances take no new attributes and its
    methods cannot be replaced on an instance or the class (tests inject
    through constructors or module-level names instead); annotations are
    checked at run time (an `int` argument given a float raises TypeError);
    and an attribute may not be named `_thread` (mypyc names the C field
    `__thread`, a keyword of GCC).

SEE ALSO
    setup.py; docs/benchmarks.md (what it bought); README.md (building).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

#: The compiled modules, by dotted name.  One group: they call each other
#: natively.  Chosen by where a message's CPU goes (docs/benchmarks.md): the
#: receiver's protocol and submission, the queue's records, the delivery
#: client.  The stores are not among them: their work is SQLite's C or the
#: kernel's, their flavours subclass shared bases across modules, and
#: compiling them saved little (docs/benchmarks.md).
MODULES: tuple[str, ...] = (
    "sluice.accounting",
    "sluice.model",
    "sluice.queue",
    "sluice.delivery.agent",
    "sluice.delivery.client",
    "sluice.delivery.encoder",
    "sluice.delivery.plan",
    "sluice.delivery.pool",
    "sluice.delivery.replies",
    "sluice.delivery.request",
    "sluice.runtime.deliveries",
    "sluice.runtime.recorder",
    "sluice.runtime.refill",
    "sluice.smtpd.connection",
    "sluice.smtpd.content",
    "sluice.smtpd.envelope",
    "sluice.smtpd.handoff",
    "sluice.smtpd.inbox",
    "sluice.smtpd.policy",
    "sluice.smtpd.protocol",
    "sluice.smtpd.session",
    "sluice.smtpd.submission",
    "sluice.smtpd.trace",
)

#: Written by setup.py beside this file: {"modules": {name: sha256 of its source}}.
MANIFEST = "_native.json"
#: Set to 0 to run the pure-Python modules even when a build matches.
SWITCH = "SLUICE_NATIVE"
REBUILD = "pip install -e . (scripts/setup does it)"


def source_path(root: Path, name: str) -> Path:
    """The .py file of a dotted module name under `root` (the directory holding `sluice`)."""
    return root.joinpath(*name.split(".")).with_suffix(".py")


def digest(path: Path) -> str:
    """The SHA-256 of a file's bytes, in hex."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest_of(root: Path, names: Sequence[str] = MODULES) -> dict[str, object]:
    """What setup.py writes after compiling `names`: each source's hash."""
    return {"modules": {name: digest(source_path(root, name)) for name in names}}


def stale(root: Path) -> str | None:
    """Why the compiled modules under `root` may not be used, or None if they match.

    None also when nothing was built: then there is nothing to keep out.
    """
    package = root / "sluice"
    try:
        recorded = json.loads((package / MANIFEST).read_text())["modules"]
    except FileNotFoundError:
        built = any(package.rglob("*.so"))
        return f"{MANIFEST} is missing" if built else None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST} cannot be read ({exc})"
    for name in MODULES:
        path = source_path(root, name)
        try:
            now = digest(path)
        except OSError:
            return f"{path} cannot be read"
        if recorded.get(name) != now:
            return f"{path.relative_to(root)} changed since the build"
    return None


class SourcesOnly:
    """Loads the listed modules from their .py files, never from an extension module.

    A meta path finder (find_spec is all the import system asks of one); not
    a subclass of importlib.abc.MetaPathFinder, whose module imports tempfile
    and shutil into every process (tests/unit/test_scheduler_purity.py).
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        """The spec of the module's source file, for a listed module found on `path`."""
        if fullname not in self.names:
            return None
        leaf = fullname.rpartition(".")[2] + ".py"
        for entry in path or sys.path:
            file = os.path.join(entry, leaf)
            if os.path.isfile(file):
                return importlib.util.spec_from_file_location(fullname, file)
        return None


def guard(root: Path) -> str | None:
    """Keep a stale or unwanted build out of this process; say why it was kept out.

    Returns the reason the compiled modules are not used: None when they
    are, or when none were built.  One finder at most, however often called.
    """
    if os.environ.get(SWITCH) == "0":
        why: str | None = f"{SWITCH}=0"
    else:
        why = stale(root)
        if why is not None:
            print(f"sluice: running the pure-Python modules: {why}; rebuild with {REBUILD}",
                  file=sys.stderr)
    if why is not None and not any(isinstance(f, SourcesOnly) for f in sys.meta_path):
        sys.meta_path.insert(0, SourcesOnly(MODULES))
    return why


def current(root: Path) -> bool:
    """True when a build exists under `root` and matches every source."""
    return (root / "sluice" / MANIFEST).is_file() and stale(root) is None


def in_use() -> list[str]:
    """The listed modules imported so far that run compiled."""
    return [name for name in MODULES
            if (module := sys.modules.get(name)) is not None
            and not str(getattr(module, "__file__", "")).endswith(".py")]

