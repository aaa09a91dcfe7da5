"""src/ stays clean: ruff's lint and format, and mypy, with their settings in pyproject.toml (skipped
where they are not installed: they come with the `test` extra). Run one alone to see or fix what it
finds, e.g. `.venv/bin/python -m ruff format src`."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKS = {
    "ruff check": ["ruff", "check", "--output-format", "concise", "src"],
    "ruff format": ["ruff", "format", "--diff", "src"],
    "mypy": ["mypy"],  # the files and settings: [tool.mypy]
}


@pytest.mark.parametrize("name", CHECKS)
def test_clean(name: str) -> None:
    command = CHECKS[name]
    pytest.importorskip(command[0])
    done = subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        pytest.fail(f"`python -m {' '.join(command)}` found problems:\n{done.stdout}{done.stderr}", pytrace=False)


LAZY = [("gpufeed", ["__version__"]), ("gpufeed.decode", []), ("gpufeed.store", [])]


@pytest.mark.parametrize(("package", "extra"), LAZY)
def test_all_is_what_is_served(package: str, extra: list[str]) -> None:
    """A package that imports its names on first use spells out `__all__` for static tools: the same
    names its `__getattr__` serves, sorted."""
    module = importlib.import_module(package)
    assert module.__all__ == sorted([*module._EXPORTS, *extra])
