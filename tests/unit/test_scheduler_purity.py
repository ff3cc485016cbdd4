"""sluice.scheduler stays pure: standard library only, and no module that does I/O.

Two checks.  The static one parses every module of the package (and every
sluice module it imports, transitively) and allows only a list of pure
standard-library modules, and no call that reads the clock.  The dynamic
one imports the package in a fresh interpreter and looks for I/O modules
in sys.modules, which also catches an import hidden in a dependency.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parents[2] / "src"

#: Standard-library modules the pure core may import: data, math, text, typing.
ALLOWED = {
    "__future__", "array", "bisect", "collections", "collections.abc", "dataclasses", "enum",
    "functools", "gc", "heapq", "itertools", "math", "operator", "random", "re", "typing",
}

#: Modules that do I/O or read the clock; none may be loaded by importing the package.
IO_MODULES = {
    "asyncio", "socket", "ssl", "selectors", "sqlite3", "subprocess", "threading",
    "multiprocessing", "concurrent.futures", "http.client", "urllib.request", "shutil",
    "tempfile", "yaml", "jsonschema", "psycopg", "plyvel", "aiosmtplib", "aiosmtpd",
}

#: Calls that read the clock or the environment.
FORBIDDEN_CALLS = {"time", "monotonic", "perf_counter", "now", "utcnow", "open", "getenv"}


def module_path(name: str) -> Path:
    base = SRC.joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def walk_package() -> dict[str, set[str]]:
    """Every sluice module reachable from sluice.scheduler, with its imports."""
    todo = [f"sluice.scheduler.{p.stem}" if p.stem != "__init__" else "sluice.scheduler"
            for p in (SRC / "sluice" / "scheduler").glob("*.py")]
    seen: dict[str, set[str]] = {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen[name] = imports_of(module_path(name))
        for imported in seen[name]:
            if imported.startswith("sluice") and module_path(imported).exists():
                todo.append(imported)
            parent = imported.rpartition(".")[0]
            if parent == "sluice" and not module_path(imported).exists():
                raise AssertionError(f"{name} imports {imported}, which does not exist")
    return seen


def test_the_package_imports_only_pure_standard_library_modules() -> None:
    modules = walk_package()
    assert "sluice.scheduler.scheduler" in modules and "sluice.model" in modules
    bad = {
        (name, imported)
        for name, imports in modules.items()
        for imported in imports
        if not imported.startswith("sluice") and imported not in ALLOWED
    }
    assert not bad, f"impure imports: {sorted(bad)}"
    # sluice.config reads files and uses jsonschema: the core takes its values duck-typed.
    assert "sluice.config" not in modules


def test_no_module_of_the_package_reads_the_clock_or_opens_files() -> None:
    offenders = []
    for path in (SRC / "sluice" / "scheduler").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else \
                    func.id if isinstance(func, ast.Name) else ""
                if name in FORBIDDEN_CALLS:
                    offenders.append(f"{path.name}:{node.lineno} {name}()")
    assert not offenders, offenders


def test_importing_the_package_loads_no_io_module() -> None:
    code = ("import json, sys; import sluice.scheduler, sluice.scheduler.simulation; "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    loaded = set(json.loads(out.stdout))
    assert "sluice.scheduler.scheduler" in loaded
    assert not (loaded & IO_MODULES), sorted(loaded & IO_MODULES)


def test_the_walker_would_notice_an_io_import(tmp_path: Path) -> None:
    # The check above must be able to fail: an impure module is caught.
    sample = tmp_path / "impure.py"
    sample.write_text("import socket\nfrom time import time\n")
    assert imports_of(sample) == {"socket", "time"}
    assert not imports_of(sample) <= ALLOWED
