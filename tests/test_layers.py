"""Layers without a cycle: every import in ds4/ follows one of the allowed arrows.

The layers, top to bottom: cli, server, jobs, chat, engine, model, kernels, backend. An import
inside one layer is always fine; an import across layers must be listed in `ALLOWED`. Imports
under `if TYPE_CHECKING:` count too: a type named across a seam is still a dependency a reader
must follow, and a cycle hidden there is the one lazy imports were invented to dodge.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ds4"

ENGINE_MODULES = {"ds4.engine", "ds4.session", "ds4.snapshot", "ds4.sampling", "ds4.tokenizer",
                  "ds4.mtp", "ds4.builtin_model"}

# layer -> layers it may import. chat sees the engine level only through the tokenizer.
ALLOWED = {
    "cli": {"server", "jobs", "engine", "chat"},
    "server": {"jobs", "chat", "engine"},
    "jobs": {"engine", "chat"},
    "chat": set(),
    "engine": {"model", "kernels", "backend"},
    "model": {"kernels", "backend"},
    "kernels": {"backend"},
    "backend": set(),
    "root": set(),
}

# Narrower arrows: (importing layer, imported module) pairs beyond the layer table.
CHAT_MAY_IMPORT = {"ds4.tokenizer"}
# The server touches the engine level in two files only: runtime.py opens the Engine (and finds
# the built-in model's directory), completions.py reads the BOS/EOS ids a token-array prompt of
# /v1/completions is checked against. Everything else reaches the engine through jobs.
SERVER_ENGINE_FILES = {"ds4/server/runtime.py", "ds4/server/completions.py"}


def layer_of(module: str) -> str | None:
    """The layer a `ds4...` module name belongs to, or None for modules outside ds4."""
    if module != "ds4" and not module.startswith("ds4."):
        return None
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__init__", "__main__"):
        return "cli" if module == "ds4.__main__" else "root"
    if ".".join(parts[:2]) in ENGINE_MODULES:
        return "engine"
    return parts[1]


def module_name(path: Path) -> str:
    """The dotted module name of a file under ds4/."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module an ImportFrom names, relative levels resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def is_module(name: str) -> bool:
    """Whether `ds4.<name>` is a module or package rather than a name in ds4/__init__.py."""
    return (PACKAGE / f"{name}.py").exists() or (PACKAGE / name / "__init__.py").exists()


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in a file, function-level and TYPE_CHECKING ones too."""
    module = module_name(path)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = resolve(node, module, path.name == "__init__.py")
            found.append((node.lineno, target))
            # `from ds4 import jobs` names a submodule, so the edge goes to it.
            if target == "ds4":
                found += [(node.lineno, f"ds4.{a.name}") for a in node.names if is_module(a.name)]
    return found


def forbidden(path: Path, target: str) -> str | None:
    """Why importing `target` from `path` crosses layers the table does not allow, or None."""
    rel = path.relative_to(PACKAGE.parent).as_posix()
    source, dest = layer_of(module_name(path)), layer_of(target)
    if dest is None or dest == "root" or dest == source:
        return None
    if source == "chat" and target in CHAT_MAY_IMPORT:
        return None
    if source == "server" and dest == "engine" and rel not in SERVER_ENGINE_FILES:
        return f"{source} -> {dest} (only {sorted(SERVER_ENGINE_FILES)} may)"
    if dest in ALLOWED[source]:
        return None
    return f"{source} -> {dest}"


def violations() -> list[str]:
    """Every forbidden edge in ds4/, as 'file:line imports module (arrow)'."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, target in imports_of(path):
            arrow = forbidden(path, target)
            if arrow:
                rel = path.relative_to(PACKAGE.parent).as_posix()
                found.append(f"{rel}:{line} imports {target} ({arrow} is not an allowed arrow)")
    return found


def test_every_import_follows_an_allowed_arrow():
    """No file in ds4/ imports across layers against the table."""
    found = violations()
    assert not found, "forbidden imports:\n" + "\n".join(found)


def test_the_walk_sees_function_level_and_type_checking_imports():
    """The checker flags an upward import hidden inside a function or TYPE_CHECKING."""
    source = PACKAGE / "model" / "_probe_layers.py"
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ds4.jobs import Scheduler\n"
        "def f():\n    from ..server import app\n"
    )
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = resolve(node, module_name(source), False)
            found.append((target, forbidden(source, target)))
    assert found == [
        ("typing", None),
        ("ds4.jobs", "model -> jobs"),
        ("ds4.server", "model -> server"),
    ]
