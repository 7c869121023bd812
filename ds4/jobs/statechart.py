"""Export the job machine's diagram (mermaid, dot, svg) from its table in ds4.jobs.machine.

transitions' GraphMachine draws both text formats (`mermaid` engine; `graphviz` engine, whose
source is dot text and needs only the `graphviz` pip package). svg needs graphviz's `dot`
program, which the `graphviz` pip package does not include: DOT_MISSING says where to get it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from transitions.extensions import GraphMachine

from ds4.jobs.machine import INITIAL, STATES, TRANSITIONS

FORMATS = ("mermaid", "dot", "svg")
TITLE = "ds4 job"
DOT_MISSING = ("svg export needs graphviz's `dot` program, which is not on PATH: install "
               "graphviz (apt-get install graphviz, brew install graphviz or conda install "
               "-c conda-forge graphviz), or export --format dot or mermaid instead")


class _Drawing:
    """A bare model: the diagram needs the table, not a job's callbacks."""


def _machine(engine: str) -> GraphMachine:
    return GraphMachine(model=_Drawing(), states=STATES, transitions=TRANSITIONS,
                        initial=INITIAL, auto_transitions=False, show_conditions=True,
                        graph_engine=engine, title=TITLE)


def mermaid_text() -> str:
    """The machine as a mermaid stateDiagram."""
    return _machine("mermaid").get_graph().source.rstrip("\n") + "\n"


def dot_text() -> str:
    """The machine as graphviz dot source."""
    return _machine("graphviz").get_graph().source.rstrip("\n") + "\n"


def svg_bytes() -> bytes:
    """The machine drawn by graphviz's `dot` (RuntimeError when it is missing)."""
    dot = shutil.which("dot")
    if dot is None:
        raise RuntimeError(DOT_MISSING)
    return subprocess.run([dot, "-Tsvg"], input=dot_text().encode(), check=True,
                          capture_output=True).stdout


def render(fmt: str) -> bytes:
    """The diagram in one of FORMATS."""
    if fmt == "mermaid":
        return mermaid_text().encode()
    if fmt == "dot":
        return dot_text().encode()
    if fmt == "svg":
        return svg_bytes()
    raise ValueError(f"unknown statechart format {fmt!r}; choose one of {', '.join(FORMATS)}")


def export(fmt: str, path: str | Path) -> Path:
    """Write the diagram in `fmt` to `path` (the `ds4 statechart` command)."""
    path = Path(path)
    path.write_bytes(render(fmt))
    return path


if __name__ == "__main__":  # python -m ds4.jobs.statechart: refresh statecharts/
    out = Path(__file__).resolve().parents[2] / "statecharts"
    export("mermaid", out / "job.mmd")
    export("dot", out / "job.dot")
    if shutil.which("dot"):
        export("svg", out / "job.svg")
