"""The mypyc build's guard: a compiled module runs only while it matches its source."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice import _native

pytestmark = pytest.mark.unit

SRC = Path(_native.__file__).resolve().parent.parent


def _tree(root: Path) -> None:
    """Every listed module's source under root (a C module's too), with a manifest of them."""
    for name in _native.BUILT:
        path = _native.source_path(root, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"NAME = {name!r}\n")
    for name in _native.C_MODULES:
        _native.c_source_path(root, name).write_text(f"/* {name} */\n")
    (root / "sluice" / _native.MANIFEST).write_text(json.dumps(_native.manifest_of(root)))


def test_a_build_matching_its_sources_is_current(tmp_path: Path) -> None:
    _tree(tmp_path)
    assert _native.stale(tmp_path) is None
    assert _native.current(tmp_path)


def test_an_edited_source_makes_the_build_stale_and_names_the_file(tmp_path: Path) -> None:
    _tree(tmp_path)
    edited = _native.source_path(tmp_path, "sluice.queue")
    edited.write_text(edited.read_text() + "# an edit after the build\n")
    why = _native.stale(tmp_path)
    assert why == "sluice/queue.py changed since the build"
    assert not _native.current(tmp_path)


def test_an_edited_c_source_makes_the_build_stale(tmp_path: Path) -> None:
    _tree(tmp_path)
    edited = _native.c_source_path(tmp_path, "sluice._wirescan")
    edited.write_text(edited.read_text() + "/* an edit after the build */\n")
    assert _native.stale(tmp_path) == "sluice/_wirescan.c changed since the build"
    assert "sluice._wirescan" in _native.kept_out(tmp_path)


def test_sources_as_large_and_as_old_as_at_the_build_are_not_read_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tree(tmp_path)

    def no_hashing(path: Path) -> str:
        raise AssertionError(f"{path} hashed")

    monkeypatch.setattr(_native, "digest", no_hashing)
    assert _native.stale(tmp_path) is None


def test_a_source_touched_but_not_changed_is_hashed_and_still_current(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tree(tmp_path)
    hashed: list[str] = []
    digest = _native.digest

    def counted(path: Path) -> str:
        hashed.append(path.name)
        return digest(path)

    monkeypatch.setattr(_native, "digest", counted)
    touched = _native.source_path(tmp_path, "sluice.queue")
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert _native.stale(tmp_path) is None
    assert "queue.py" in hashed  # the stat moved: the hashes decided


def test_a_file_replaced_with_its_mtime_set_back_is_still_seen(tmp_path: Path) -> None:
    # tar or cp -p write a new file and set its mtime to the old one's: same
    # size, same mtime, but another inode (and ctime), which no tool sets.
    _tree(tmp_path)
    edited = _native.source_path(tmp_path, "sluice.model")
    st = edited.stat()
    new = edited.with_name("model.py.new")
    new.write_text(edited.read_text().replace("NAME", "EMAN"))
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    new.replace(edited)
    assert (edited.stat().st_size, edited.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert _native.stale(tmp_path) == "sluice/model.py changed since the build"


def test_a_source_that_cannot_be_read_keeps_the_build_out(tmp_path: Path) -> None:
    _tree(tmp_path)
    (tmp_path / "sluice" / ".#queue.py").symlink_to("user@host.1234")  # an editor's lock
    assert _native.stale(tmp_path).startswith("a source cannot be read")


def test_an_edit_of_the_same_size_makes_the_build_stale(tmp_path: Path) -> None:
    _tree(tmp_path)
    edited = _native.source_path(tmp_path, "sluice.model")
    st = edited.stat()
    edited.write_text(edited.read_text().replace("NAME", "EMAN"))
    assert edited.stat().st_size == st.st_size
    os.utime(edited, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # even a nanosecond later
    assert _native.stale(tmp_path) == "sluice/model.py changed since the build"


def test_a_manifest_without_stats_is_checked_by_hashes(tmp_path: Path) -> None:
    # A build made before the stats were recorded.
    _tree(tmp_path)
    manifest = tmp_path / "sluice" / _native.MANIFEST
    data = json.loads(manifest.read_text())
    del data["stats"]
    manifest.write_text(json.dumps(data))
    assert _native.stale(tmp_path) is None
    edited = _native.source_path(tmp_path, "sluice.queue")
    edited.write_text(edited.read_text() + "# an edit\n")
    assert _native.stale(tmp_path) == "sluice/queue.py changed since the build"


def test_extension_modules_without_a_manifest_are_stale(tmp_path: Path) -> None:
    _tree(tmp_path)
    (tmp_path / "sluice" / _native.MANIFEST).unlink()
    assert _native.stale(tmp_path) is None  # nothing was built: nothing to keep out
    _native.built_path(tmp_path, "sluice.queue").write_bytes(b"\0")
    assert _native.stale(tmp_path) == f"{_native.MANIFEST} is missing"


def test_a_manifest_that_cannot_be_read_is_stale(tmp_path: Path) -> None:
    _tree(tmp_path)
    (tmp_path / "sluice" / _native.MANIFEST).write_text("{not json")
    assert _native.stale(tmp_path) == f"{_native.MANIFEST} cannot be read"


def test_a_new_or_removed_source_or_another_list_makes_the_build_stale(
        tmp_path: Path) -> None:
    # A compiled module also bakes in what it saw of the others (their
    # constants, their classes): any source of the package counts.
    _tree(tmp_path)
    added = tmp_path / "sluice" / "extra.py"
    added.write_text("X = 1\n")
    assert _native.stale(tmp_path) == "sluice/extra.py was added since the build"
    added.unlink()
    assert _native.stale(tmp_path) is None
    manifest = tmp_path / "sluice" / _native.MANIFEST
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "modules": data["modules"][1:]}))
    assert _native.stale(tmp_path) == "the list of compiled modules changed since the build"
    # and a finder then keeps out the old list's modules too
    manifest.write_text(json.dumps({**data, "modules": [*data["modules"], "sluice.gone"]}))
    assert _native.kept_out(tmp_path) == [*_native.BUILT, "sluice.gone"]
    manifest.write_text(json.dumps({**data, "suffix": ".other.so"}))
    assert _native.stale(tmp_path).startswith("the build is for another interpreter")


def test_the_finder_loads_the_source_where_an_extension_module_lies_beside_it(
        tmp_path: Path) -> None:
    # A broken extension module that Python would otherwise prefer to the .py.
    package = tmp_path / "pkgx"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "hot.py").write_text("WHERE = 'source'\n")
    (package / f"hot{_suffix()}").write_bytes(b"not an ELF file")
    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from sluice import _native\n"
        "try:\n"
        "    import pkgx.hot\n"
        "except ImportError as exc:\n"
        "    print('extension:', type(exc).__name__)\n"
        "sys.modules.pop('pkgx.hot', None)\n"
        "sys.meta_path.insert(0, _native.SourcesOnly(['pkgx.hot']))\n"
        "import pkgx.hot\n"
        "print(pkgx.hot.WHERE, pkgx.hot.__file__.endswith('hot.py'))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env={**os.environ, "SLUICE_NATIVE": "0"}).stdout
    assert out.splitlines() == ["extension: ImportError", "source True"]


def test_a_stale_build_says_so_and_runs_the_sources(tmp_path: Path) -> None:
    _tree(tmp_path)
    edited = _native.source_path(tmp_path, "sluice.smtpd.protocol")
    edited.write_text("# edited\n")
    # This tree's own guard ran silently (SLUICE_NATIVE=0); then the stale tree's.
    script = ("import os, sys\n"
              "from pathlib import Path\n"
              "from sluice import _native\n"
              "del os.environ['SLUICE_NATIVE']\n"
              f"print(_native.guard(Path({str(tmp_path)!r})))\n"
              "print(sum(isinstance(f, _native.SourcesOnly) for f in sys.meta_path))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True, env={**os.environ, "SLUICE_NATIVE": "0"})
    why, finders = done.stdout.splitlines()
    assert why == "sluice/smtpd/protocol.py changed since the build"
    assert finders == "1"
    assert done.stderr == (f"sluice: running the pure-Python modules: {why}; "
                           f"rebuild with {_native.REBUILD}\n")


def _suffix() -> str:
    import importlib.machinery
    return importlib.machinery.EXTENSION_SUFFIXES[0]


def _imported(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = ("import sluice.queue, sluice.smtpd.connection\n"
              "from sluice import _native\n"
              "print(sluice.queue.__file__)\n"
              "print(' '.join(_native.in_use()))\n"
              "print(_native.state())\n")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True, env={**os.environ, **env})


def test_sluice_native_0_runs_the_sources_and_says_nothing() -> None:
    done = _imported({"SLUICE_NATIVE": "0"})
    path, compiled, state = done.stdout.splitlines()
    assert path.endswith("queue.py")
    assert compiled == ""
    assert state == "hot path pure Python (SLUICE_NATIVE=0)"
    assert done.stderr == ""


@pytest.mark.skipif(not _native.current(SRC), reason="no current mypyc build in this tree "
                    "(scripts/setup builds one; SLUICE_NATIVE=0 skips it)")
def test_a_current_build_runs_compiled() -> None:
    done = _imported({"SLUICE_NATIVE": "1"})
    path, compiled, state = done.stdout.splitlines()
    assert not path.endswith(".py")
    assert {"sluice.queue", "sluice.smtpd.connection"} <= set(compiled.split())
    assert state == "hot path compiled by mypyc"
    assert done.stderr == ""
