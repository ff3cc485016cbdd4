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

    STRATEGY.  setup.py compiles MODULES into one group when mypyc and
    the dependencies are importable where it runs: scripts/setup builds in
    the venv with `pip install --no-build-isolation -e .`; a build in an
    isolated environment (plain `pip install .`) has no mypyc and is pure.
    A finished build writes MANIFEST: the modules compiled, the
    interpreter's extension suffix, and the SHA-256 of every source of the
    package, since a compiled module also bakes in what it saw of the
    others.  An extension module sits next to its .py and Python prefers
    it, so at `import sluice` this module checks, once, that the sources
    are as they were built: first by what each file's stat says (size,
    times, inode: about 2 ms for the package's 240 files), and only if
    one of those moved by their hashes (about 10 ms; a file touched but
    not changed is still current, and is hashed at every import until
    the next build records it again).  If one differs (an edit or a
    checkout after the build), if the list or the interpreter changed, if
    the manifest is missing, or if SLUICE_NATIVE=0 is set, a finder at the
    head of sys.meta_path loads every listed module (and every module of
    the last build) from its .py file: all of them, since compiled modules
    call each other's C directly and a mix would run the old code of a
    changed module.  A stale build says so in one line on stderr, with the
    command that rebuilds it; SLUICE_NATIVE=0 says nothing.

    What compiling changes, and the code here keeps to it: compiled code
    calls compiled functions and methods directly, so replacing one at run
    time (a test's monkeypatch) reaches only callers that are not compiled;
    instances of a compiled class take no attributes beyond its own;
    annotations are checked at run time (a float where an `int` is
    annotated raises TypeError, so the configuration's integers are made
    ints when it is loaded), and a class-typed argument must be of that
    class (the receiver takes a Protocol, Submitting, where tests give
    fakes); an attribute may not be named `_thread` (mypyc names the C
    field `__thread`, a keyword of GCC); and a dataclass writes its
    ``__init__`` out (setting frozen fields with object.__setattr__),
    since mypyc runs the methods the decorator generates in the
    interpreter: a Reply took 1.8 µs to make that way and 0.2 µs written
    out, timed from Python (tests/unit/test_native_inits.py holds each
    to its fields).

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
#: client, and the SQLite store's committer and WAL syncer threads.  Not
#: the stores' facades (sluice.store.sqlite, _sql and the other flavours):
#: PostgreSQL's subclasses _sql's classes, which a compiled class forbids
#: to an uncompiled module, and tests replace the facades' methods.
MODULES: tuple[str, ...] = (
    "sluice.accounting",
    "sluice.attempts",
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
    "sluice.store._commit",
    "sluice.store._sqlite_apply",
    "sluice.store._sqlite_db",
    "sluice.store._sqlite_schema",
)

#: Extension modules written by hand in C, each beside its pure-Python twin
#: of the same name (the twin's docstring says what both do, and a test
#: holds them to the same answers).  Built and kept out with MODULES.
C_MODULES: tuple[str, ...] = ("sluice._wirescan",)
#: Everything a build makes, and a stale build's finder keeps out.
BUILT: tuple[str, ...] = MODULES + C_MODULES

#: Written by setup.py beside this file once a build is done: the modules it
#: compiled, the interpreter's extension suffix, and the SHA-256 of every
#: source of the package (a compiled module also bakes in what it saw of the
#: others: their Final constants, the classes of what they hand it), with
#: what each source's stat said (stats_of).
MANIFEST = "_native.json"
#: Set to 0 to run the pure-Python modules even when a build matches.
SWITCH = "SLUICE_NATIVE"
REBUILD = "scripts/setup (or .venv/bin/pip install --no-build-isolation --no-deps -e .)"
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def source_path(root: Path, name: str) -> Path:
    """The .py file of a dotted module name under `root` (the directory holding `sluice`)."""
    return root.joinpath(*name.split(".")).with_suffix(".py")


def c_source_path(root: Path, name: str) -> Path:
    """The .c file of a dotted name of C_MODULES under `root`."""
    return source_path(root, name).with_suffix(".c")


def built_path(root: Path, name: str, suffix: str = SUFFIX) -> Path:
    """Where a build puts the extension module of a dotted name (this interpreter's suffix)."""
    return root.joinpath(*name.split(".")).with_name(name.rpartition(".")[2] + suffix)


def digest(path: Path) -> str:
    """The SHA-256 of a file's bytes, in hex."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def source_names(root: Path) -> list[str]:
    """Every .py and .c file of the package under `root`, by path relative to it (``/``), sorted.

    The one list both checks take (sources_of, stats_of); paths as strings,
    as a Path per file cost more than the stat of it.
    """
    names: list[str] = []
    skip = len(str(root)) + 1
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "sluice")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        names += [os.path.join(dirpath, name)[skip:].replace(os.sep, "/")
                  for name in filenames if name.endswith((".py", ".c"))]
    return sorted(names)


def sources_of(root: Path) -> dict[str, str]:
    """Every source file of the package under `root` (source_names), with its hash."""
    return {name: digest(root / name) for name in source_names(root)}


def stats_of(root: Path) -> dict[str, list[int]]:
    """Every source file of the package under `root` (source_names), with what its stat says.

    Without reading them: a stat each.  Size, mtime, ctime and inode: a
    tool may set a file's mtime (tar, cp -p, touch -r), but a write, a
    copy or a rename also moves its ctime or its inode, which no tool sets.
    """
    out: dict[str, list[int]] = {}
    for name in source_names(root):
        st = os.stat(os.path.join(root, name))
        out[name] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    return out


def manifest_of(root: Path, names: Sequence[str] = BUILT) -> dict[str, object]:
    """What setup.py writes after compiling `names` (read before mypyc reads them).

    The stats are taken before the hashes: a file changed in between has
    a newer mtime than the one recorded, and is then hashed again.
    """
    stats = stats_of(root)
    return {"modules": list(names), "suffix": SUFFIX, "sources": sources_of(root),
            "stats": stats}


def recorded(root: Path) -> dict[str, object] | None:
    """The manifest of the build under `root`, or None without one (or an unreadable one)."""
    try:
        data = json.loads((root / "sluice" / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def stale(root: Path) -> str | None:
    """Why the compiled modules under `root` may not be used, or None if they match.

    None also when nothing was built: then there is nothing to keep out.
    """
    package = root / "sluice"
    path = package / MANIFEST
    if not path.exists():
        built = any(built_path(root, name).exists() for name in BUILT)
        return f"{MANIFEST} is missing" if built else None
    data = recorded(root)
    if data is None:
        return f"{MANIFEST} cannot be read"
    if data.get("modules") != list(BUILT):
        return "the list of compiled modules changed since the build"
    if data.get("suffix") != SUFFIX:
        return f"the build is for another interpreter ({data.get('suffix')}, this is {SUFFIX})"
    try:
        if data.get("stats") == stats_of(root):
            return None  # every source as it was at the build: none read again
        now = sources_of(root)
    except OSError as exc:  # a source gone mid-walk, a dangling link
        return f"a source cannot be read ({exc})"
    then = data.get("sources")
    if not isinstance(then, dict):
        return f"{MANIFEST} cannot be read"
    for name in sorted(then.keys() | now.keys()):
        if then.get(name) != now.get(name):
            what = "changed" if name in then and name in now else (
                "was added" if name in now else "was removed")
            return f"{name} {what} since the build"
    return None


def kept_out(root: Path) -> list[str]:
    """The modules a finder must load from source: today's list and the last build's."""
    data = recorded(root) or {}
    before = data.get("modules")
    names = list(BUILT)
    if isinstance(before, list):
        names += [name for name in before if isinstance(name, str) and name not in names]
    return names


class SourcesOnly:
    """Loads the listed modules from their .py files, never from an extension module.

    A meta path finder (find_spec is all the import system asks of one); not
    a subclass of importlib.abc.MetaPathFinder, whose module imports tempfile
    and shutil into every process (tests/unit/test_scheduler_purity.py).
    """

    def __init__(self, names: Sequence[str], why: str = "") -> None:
        self.names = frozenset(names)
        #: Why the build was kept out (for serve's start-up line).
        self.why = why

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
        # Never fall through to the extension module that was just refused.
        raise ModuleNotFoundError(f"no source file for {fullname}", name=fullname)


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
        sys.meta_path.insert(0, SourcesOnly(kept_out(root), why))
    return why


def state() -> str:
    """This process's build in a few words, for serve's start-up line."""
    finder = next((f for f in sys.meta_path if isinstance(f, SourcesOnly)), None)
    if finder is not None:
        return f"hot path pure Python ({finder.why})"
    if in_use():
        return "hot path compiled by mypyc"
    return "hot path pure Python (no mypyc build)"


def current(root: Path) -> bool:
    """True when a build exists under `root` and matches every source."""
    return (root / "sluice" / MANIFEST).is_file() and stale(root) is None


def in_use() -> list[str]:
    """The listed modules imported so far that run compiled."""
    return [name for name in BUILT
            if (module := sys.modules.get(name)) is not None
            and not str(getattr(module, "__file__", "")).endswith(".py")]

