"""The committed diagrams in statecharts/ must match the job machine's table."""

from __future__ import annotations

import html
import shutil
from pathlib import Path

import pytest

from ds4.jobs import statechart
from ds4.jobs.machine import STATES, TRANSITIONS

CHARTS = Path(__file__).resolve().parents[1] / "statecharts"
FIX = "refresh with: python -m ds4.jobs.statechart"


def test_mermaid_export_matches_table():
    assert (CHARTS / "job.mmd").read_text() == statechart.mermaid_text(), FIX


def test_dot_export_matches_table():
    assert (CHARTS / "job.dot").read_text() == statechart.dot_text(), FIX


def test_svg_shows_every_state_and_trigger():
    svg = html.unescape((CHARTS / "job.svg").read_text())
    for state in STATES:
        assert f">{state['name']}<" in svg, (state["name"], FIX)
    for row in TRANSITIONS:
        assert row["trigger"] in svg, (row["trigger"], FIX)


def test_every_transition_appears_in_the_mermaid_text():
    text = statechart.mermaid_text()
    for row in TRANSITIONS:
        sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
        for source in sources:
            edge = [line for line in text.splitlines()
                    if line.strip().startswith(f"{source} --> {row['dest']}:")]
            assert edge and row["trigger"] in edge[0], (source, row)


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` binary not installed")
def test_svg_export_writes_a_drawing(tmp_path):
    out = statechart.export("svg", tmp_path / "job.svg")
    assert out.read_text().lstrip().startswith(("<?xml", "<svg"))


def test_unknown_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="mermaid, dot, svg"):
        statechart.export("png", tmp_path / "job.png")
