"""The package as README installs it: every import is a declared dependency, every core
dependency is imported, the licence is declared, and the svg export says how to get `dot`."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# imported by a dependency on ds4's behalf: transitions' dot export (`ds4 statechart`)
IMPORTED_FOR_US = {"graphviz"}


def canonical(requirement: str) -> str:
    """A requirement's distribution name, normalized as PyPI does."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement)[0]).lower()


def third_party_imports(folder: Path) -> set[str]:
    """Top-level modules imported anywhere under `folder`, less the stdlib and ds4."""
    names = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "ds4"}


def distributions(modules: set[str]) -> set[str]:
    """The installed distributions that provide `modules`."""
    provided = packages_distributions()
    return {canonical(d) for m in modules for d in provided.get(m, [m])}


def test_every_import_of_ds4_is_a_core_dependency_and_every_dependency_is_used() -> None:
    core = {canonical(r) for r in PROJECT["dependencies"]}
    gpu = {canonical(r) for r in PROJECT["optional-dependencies"]["gpu"]}
    # cupyx ships inside the cupy wheels (the gpu extra), as cupy does
    used = distributions(third_party_imports(ROOT / "ds4") - {"cupy", "cupyx", "matplotlib"})
    assert used <= core, used - core
    assert core - used == distributions(IMPORTED_FOR_US)
    assert gpu == {"cupy-cuda12x"}
    assert {canonical(r) for r in PROJECT["optional-dependencies"]["plot"]} == {"matplotlib"}
    assert {canonical(r) for r in PROJECT["optional-dependencies"]["gpu-cuda13"]} == \
        {"cupy-cuda13x"}


def test_replay_needs_only_core_dependencies() -> None:
    core = {canonical(r) for r in PROJECT["dependencies"]}
    assert "httpx" in core
    replay = third_party_imports(ROOT / "ds4" / "cli") - {"matplotlib"}  # --plot: ds4[plot]
    assert distributions(replay) <= core


def test_licence_is_mit_and_declared() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n") and "the ds4 authors" in text
    assert PROJECT["license"] == "MIT" and PROJECT["license-files"] == ["LICENSE"]


def test_svg_export_without_dot_says_how_to_get_it(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": str(tmp_path)}  # no `dot` here
    result = subprocess.run([sys.executable, "-m", "ds4", "statechart", "--format", "svg",
                             "-o", str(tmp_path / "job.svg")], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 1
    assert result.stderr.startswith("ds4: svg export needs graphviz's `dot` program")
    assert "apt-get install graphviz" in result.stderr and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "job.svg").exists()
