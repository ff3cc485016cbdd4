"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from sluice.config import Config, config_from_dict

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
SLUICE = str(VENV_BIN / "sluice")


def make_config(tmp: Path, **sections: dict[str, object]) -> Config:
    """A Config whose state lives under ``tmp`` (merged with ``sections``)."""
    data: dict[str, dict[str, object]] = {
        "node": {"hostname": "mx.sluice.test", "id": "test-node"},
        "queue": {"path": str(tmp / "queue"), "spool": {"rootpath": str(tmp / "spool")}},
        "accounting": {"path": str(tmp / "log")},
    }
    for name, values in sections.items():
        base = data.setdefault(name, {})
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                base[key] = {**base[key], **value}  # type: ignore[dict-item]
            else:
                base[key] = value
    return config_from_dict(data, source="<test>", base_dir=tmp)


def write_config(tmp: Path, **sections: dict[str, object]) -> Path:
    """The same as make_config, as a YAML file for a subprocess."""
    cfg = make_config(tmp, **sections)
    data = cfg.to_dict(readable=True)
    path = tmp / "sluice.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return make_config(tmp_path)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_CONFIG", raising=False)


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_CONFIG"}
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    env.update(extra)
    return env
