"""sluice.api never imports sluice.runtime: the runtime owns the API, not the other way.

The API sees the queue manager through the protocol of sluice.api.ports.
Two checks, as for the scheduler's purity: the static one parses every
module of sluice.api and every sluice module they import, transitively
(imports inside functions included), and looks for sluice.runtime; the
dynamic one imports every API module in a fresh interpreter and looks in
sys.modules.
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
API = SRC / "sluice" / "api"


def module_path(name: str) -> Path:
    base = SRC.joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module an import statement names, anywhere in the file."""
    found: set[str] = set()
    package = ""
    if path.is_relative_to(SRC):
        package = module_name(path) if path.name == "__init__.py" \
            else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            # "from sluice.api import routes": the names may be modules too.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def api_modules() -> list[str]:
    return sorted(module_name(p) for p in API.rglob("*.py"))


def reachable() -> dict[str, set[str]]:
    """Every sluice module reachable from sluice.api, with what it imports."""
    todo = api_modules()
    seen: dict[str, set[str]] = {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen[name] = {i for i in imports_of(module_path(name)) if i.startswith("sluice")}
        todo.extend(i for i in seen[name] if module_path(i).exists())
    return seen


def test_no_module_reachable_from_the_api_is_the_runtime() -> None:
    modules = reachable()
    assert "sluice.api.control" in modules and "sluice.api.routes.queue" in modules
    offenders = sorted((name, imported) for name, imports in modules.items()
                       for imported in imports if imported.startswith("sluice.runtime"))
    assert not offenders, f"sluice.api reaches sluice.runtime: {offenders}"


def test_importing_every_api_module_loads_no_runtime_module() -> None:
    code = ("import importlib, json, sys\n"
            f"for name in {api_modules()!r}:\n"
            "    importlib.import_module(name)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    loaded = set(json.loads(out.stdout))
    assert "sluice.api.server" in loaded
    assert not {m for m in loaded if m.startswith("sluice.runtime")}


def test_the_walker_would_notice_a_runtime_import(tmp_path: Path) -> None:
    # The check above must be able to fail: a lazy import inside a function counts.
    sample = tmp_path / "sample.py"
    sample.write_text("def later():\n    from sluice.runtime import manager\n")
    found = imports_of(sample)
    assert {"sluice.runtime", "sluice.runtime.manager"} <= found
