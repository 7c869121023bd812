"""Mutation testing of a few small, logic-dense modules against the tests that guard them.

Each mutant changes one thing in one module (a comparison, an operator, a constant, a boolean
connective, a `not`, or a statement replaced by `pass`), is written into a scratch copy of the
tree, and the module's test files run on it (`pytest -x`). A mutant is killed when a test
fails, survives when all pass. Survivors are listed with their line for docs/TESTING.md.
Not part of CI: a full run takes tens of minutes on two cores.

    python3 tools/mutation.py                                    # every module, this tree
    python3 tools/mutation.py ds4/jobs/stop.py --root /tmp/old   # one module, another tree
    python3 tools/mutation.py --rerun before.jsonl --log after.jsonl  # only earlier survivors
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

# module -> test files that guard it, quickest first (-x stops at the first failure)
TARGETS = {
    "ds4/jobs/stop.py": ["tests/test_stop_strings.py", "tests/test_jobs_decoding.py"],
    "ds4/chat/dsml.py": ["tests/test_dsml_values.py", "tests/test_chat_parse.py",
                         "tests/test_chat_fuzz.py"],
    "ds4/server/request_fields.py": ["tests/test_request_fields.py",
                                     "tests/test_server_requests.py",
                                     "tests/test_server_shapes.py",
                                     "tests/test_server_http.py",  # missing fields
                                     "tests/test_server_hostile.py"],  # lone surrogates
    "ds4/chat/parser.py": ["tests/test_chat_parse.py", "tests/test_chat_fuzz.py"],
    "ds4/sampling.py": ["tests/test_sampling.py"],
    "ds4/model/rope.py": ["tests/test_rope.py", "tests/test_engine_blocks.py",
                          "tests/test_parity_tiny.py"],
    "ds4/jobs/speculative.py": ["tests/test_mtp.py"],
    "ds4/mtp.py": ["tests/test_mtp_stepwise.py", "tests/test_mtp.py"],
    "ds4/model/placement.py": ["tests/test_placement_policy.py", "tests/test_placement.py"],
    "ds4/cli/replay_stream.py": ["tests/test_replay_stream.py"],
    "ds4/jobs/placement_policy.py": ["tests/test_placement_policy.py"],
}
COMPARE_SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
                 ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In,
                 ast.Is: ast.IsNot, ast.IsNot: ast.Is}
BINOP_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
               ast.FloorDiv: ast.Div, ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult}
DELETABLE = (ast.Assign, ast.AugAssign, ast.Expr, ast.Return, ast.Raise, ast.Break,
             ast.Continue)


@dataclass(frozen=True)
class Mutant:
    """One change: the `variant`-th mutation of the `index`-th node in ast.walk order."""

    index: int
    variant: int
    line: int
    description: str


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of docstring statements (changing them changes nothing a test could see)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.update((id(body[0]), id(body[0].value)))
    return out


def _inert(tree: ast.AST) -> set[int]:
    """ids of nodes no mutation should touch: annotations, f-string parts, log calls."""
    roots = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            roots.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
            roots.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
        elif isinstance(node, ast.JoinedStr):
            roots.append(node)
        elif _is_log_call(node):
            roots.append(node)
    return {id(n) for root in roots for n in ast.walk(root)} | _docstrings(tree)


def _is_log_call(node: ast.AST) -> bool:
    """`log.info(...)` and friends: logging is not behaviour a user sees."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "log")


def _constant_variants(value: object) -> list[object]:
    """Replacements of a literal: the other bool, n+1 (and 0 for 1), x*2 / 0, a changed string."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1] + ([0] if value == 1 else [])
    if isinstance(value, float):
        return [value * 2 if value else 1.0]
    if isinstance(value, str):
        return ["XX" + value if value else "XX"]
    return []


def variants(node: ast.AST, in_function: bool) -> list[tuple[str, object]]:
    """(description, replacement payload) of each mutation this node allows."""
    if isinstance(node, ast.Compare):
        return [(f"{type(op).__name__} -> {COMPARE_SWAPS[type(op)].__name__}", ("cmp", i))
                for i, op in enumerate(node.ops) if type(op) in COMPARE_SWAPS]
    if isinstance(node, ast.BinOp) and type(node.op) in BINOP_SWAPS:
        return [(f"{type(node.op).__name__} -> {BINOP_SWAPS[type(node.op)].__name__}",
                 ("binop", None))]
    if isinstance(node, ast.BoolOp):
        return [("and <-> or", ("boolop", None))]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return [("drop not", ("not", None))]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return [("drop unary minus", ("neg", None))]
    if isinstance(node, ast.Constant) and node.value is not None:
        return [(f"{node.value!r} -> {v!r}", ("const", v)) for v in _constant_variants(node.value)]
    if in_function and isinstance(node, DELETABLE):
        return [("statement -> pass", ("pass", None))]
    return []


def _function_statements(tree: ast.AST) -> set[int]:
    """ids of statements directly inside a function body (where `pass` may replace them)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for child in ast.walk(node):
                for name in ("body", "orelse", "finalbody"):
                    block = getattr(child, name, None)
                    if isinstance(block, list):
                        out.update(id(s) for s in block)
    return out


def mutants(source: str) -> list[Mutant]:
    """Every mutant of a module's source."""
    tree = ast.parse(source)
    inert, in_function = _inert(tree), _function_statements(tree)
    out = []
    for index, node in enumerate(ast.walk(tree)):
        if id(node) in inert:
            continue
        for variant, (text, _) in enumerate(variants(node, id(node) in in_function)):
            out.append(Mutant(index, variant, getattr(node, "lineno", 0), text))
    return out


def sampled(source: str, every: int) -> list[Mutant]:
    """One mutant in `every`, picked by a hash of its line's code and its change, so a run on
    an edited module samples the same mutants on the lines that did not change."""
    if every <= 1:
        return mutants(source)
    lines, seen, out = source.splitlines(), {}, []
    for m in mutants(source):
        key = f"{lines[m.line - 1].strip() if m.line else ''}|{m.description}"
        seen[key] = seen.get(key, 0) + 1
        if zlib.crc32(f"{key}|{seen[key]}".encode()) % every == 0:
            out.append(m)
    return out


class _Replace(ast.NodeTransformer):
    """Swaps one statement node for `pass` wherever it sits."""

    def __init__(self, target: ast.AST):
        self.target = target

    def generic_visit(self, node):
        if node is self.target:
            return ast.copy_location(ast.Pass(), node)
        return super().generic_visit(node)


def mutated_source(source: str, mutant: Mutant) -> str:
    """The module's source with `mutant` applied."""
    tree = ast.parse(source)
    inert, in_function = _inert(tree), _function_statements(tree)
    node = list(ast.walk(tree))[mutant.index]
    kind, arg = variants(node, id(node) in in_function)[mutant.variant][1]
    assert id(node) not in inert
    if kind == "cmp":
        node.ops[arg] = COMPARE_SWAPS[type(node.ops[arg])]()
    elif kind == "binop":
        node.op = BINOP_SWAPS[type(node.op)]()
    elif kind == "boolop":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif kind in ("not", "neg"):
        tree = _Unwrap(node).visit(tree)
    elif kind == "const":
        node.value = arg
    else:
        tree = _Replace(node).visit(tree)
    return ast.unparse(ast.fix_missing_locations(tree))


class _Unwrap(ast.NodeTransformer):
    """Replaces a unary operation by its operand."""

    def __init__(self, target: ast.AST):
        self.target = target

    def generic_visit(self, node):
        if node is self.target:
            return node.operand
        return super().generic_visit(node)


def scratch_tree(root: Path) -> Path:
    """A copy of the package, the tests and the pytest settings to mutate in."""
    work = Path(tempfile.mkdtemp(prefix="ds4-mutation-"))
    for name in ("ds4", "tests"):
        shutil.copytree(root / name, work / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(root / "setup.cfg", work / "setup.cfg")
    return work


# Imported once by the parent so that each forked test run skips their start-up cost; the
# parent never imports ds4 or the tests, so every child imports the mutated tree afresh.
PRELOAD = ("numpy", "pytest", "hypothesis", "tokenizers", "httpx", "starlette", "uvicorn",
           "anyio", "openai", "anthropic", "scipy.linalg", "ml_dtypes", "safetensors")


def preload() -> None:
    """Import the third-party libraries the tests use (those installed)."""
    sys.dont_write_bytecode = True  # a mutant must never leave a .pyc another one could load
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass


def run_tests(work: Path, tests: list[str], timeout: float) -> str:
    """killed | survived | timeout for the tree as it is now (pytest -x in a forked child)."""
    pid = os.fork()
    if pid == 0:  # the child: run the tests and leave without running the parent's cleanup
        os._exit(_child(work, tests))
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return "survived" if os.waitstatus_to_exitcode(status) == 0 else "killed"
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.05)


def _child(work: Path, tests: list[str]) -> int:
    """pytest on `tests` in `work`, output discarded; its exit status."""
    try:
        import pytest

        os.chdir(work)
        os.environ["PYTHONPATH"] = str(work)  # for tests that start `python -m ds4...`
        os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
        sys.path.insert(0, str(work))
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        return int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                                *tests]))
    except BaseException:
        return 99


def run_module(work: Path, module: str, tests: list[str], timeout: float, log,
               earlier: list[dict] | None = None, resume: bool = False,
               every: int = 1) -> dict[str, int]:
    """Run every mutant of one module; survivors are printed and logged as JSON lines.

    With `earlier` (this module's records of a run on the same source) only its survivors
    run again: a test added since cannot revive a mutant that a test already killed. With
    `resume` its records stand as they are and only the mutants it did not reach run.
    """
    path = work / module
    source = path.read_text()
    counts = {"killed": 0, "survived": 0, "timeout": 0}
    lines = source.splitlines()
    try:
        for n, mutant in enumerate(sampled(source, every)):
            record = {"module": module, "line": mutant.line, "mutation": mutant.description,
                      "code": lines[mutant.line - 1].strip() if mutant.line else ""}
            if earlier is not None and n < len(earlier) and (
                    resume or earlier[n]["outcome"] != "survived"):
                outcome = earlier[n]["outcome"]
            else:
                path.write_text(mutated_source(source, mutant))
                outcome = run_tests(work, tests, timeout)
            counts[outcome] += 1
            log.write(json.dumps({**record, "outcome": outcome}) + "\n")
            log.flush()
            if outcome == "survived":
                print(f"  survived {module}:{mutant.line} {mutant.description}: "
                      f"{record['code']}", flush=True)
    finally:
        path.write_text(source)
    return counts


def earlier_records(path: Path | None, module: str, source: str,
                    every: int = 1) -> list[dict] | None:
    """A previous log's records of `module` if they are of this source's mutants (the first
    ones, when that run stopped early)."""
    if path is None:
        return None
    records = [r for r in map(json.loads, path.read_text().splitlines()) if r["module"] == module]
    found = sampled(source, every)
    lines = source.splitlines()
    same = 0 < len(records) <= len(found) and all(
        (r["line"], r["mutation"], r["code"]) ==
        (m.line, m.description, lines[m.line - 1].strip() if m.line else "")
        for r, m in zip(records, found))
    return records if same else None


def baseline_seconds(work: Path, tests: list[str]) -> float:
    """Seconds the unmutated tests take; they must pass, or no mutant result means anything."""
    start = time.monotonic()
    if run_tests(work, tests, 900) != "survived":
        raise SystemExit(f"the tests fail without any mutant: {' '.join(tests)}")
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    """Mutate the named modules (all of TARGETS by default) and print the counts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", default=list(TARGETS))
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="tree whose ds4/ and tests/ are mutated (default: this one)")
    parser.add_argument("--log", type=Path, default=Path("mutation.jsonl"))
    parser.add_argument("--rerun", type=Path, default=None,
                        help="an earlier log: where a module's source is unchanged, run only "
                             "the mutants that survived it")
    parser.add_argument("--sample", type=int, default=1, metavar="N",
                        help="run one mutant in N (the same ones on unchanged lines)")
    parser.add_argument("--resume", action="store_true",
                        help="with --rerun: keep all its outcomes, run only what it lacks")
    args = parser.parse_args(argv)
    preload()
    work = scratch_tree(args.root.resolve())
    try:
        with args.log.open("w") as log:
            for module in args.modules:
                tests = [t for t in TARGETS[module] if (work / t).exists()]
                earlier = earlier_records(args.rerun, module, (work / module).read_text(),
                                          args.sample)
                timeout = 3 * baseline_seconds(work, tests) + 30
                counts = run_module(work, module, tests, timeout, log, earlier, args.resume,
                                    args.sample)
                total = sum(counts.values())
                print(f"{module}: {total} mutants, {counts['killed']} killed, "
                      f"{counts['timeout']} timed out, {counts['survived']} survived "
                      f"({' '.join(tests)})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
