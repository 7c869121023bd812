"""tools/timeline_decode.py and ds4/kernels/timeline.py on the CPU: the critical-path shares
from synthetic stamps, the stamps' build switch, and the stamped sources compiling for sm_90
(the device run is the tool's: it needs a GPU)."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from test_batch_tools import load_tool

from ds4.backend import KERNEL_DIR
from ds4.kernels import compile_options

LAUNCHES = [("hc_unit", 64, 256), ("rows_many_n1", 96, 256), ("rows_matvec_q", 256, 256)]


def stamps(offset: int) -> list[tuple]:
    """One replay: (reached, released, grid, block) per kernel, in ns."""
    return [(offset + 0, offset + 100, 64, 256), (offset + 50, offset + 1100, 96, 256),
            (offset + 900, offset + 4100, 256, 256)]


def test_shares_are_the_gaps_between_releases_averaged_over_replays():
    tool = load_tool("timeline_decode")
    second = [(a, b + (20 if i == 1 else 0), g, k) for i, (a, b, g, k) in enumerate(stamps(10**6))]
    rows = tool.critical_path(LAUNCHES, stamps(0) + second, replays=2)
    assert [r[0] for r in rows] == ["hc_unit", "rows_many_n1", "rows_matvec_q"]
    assert rows[0][1] == pytest.approx((1000 + 1020) / 2)  # hc_unit ends as rows_many goes
    assert rows[1][1] == pytest.approx((3000 + 2980) / 2)
    assert rows[2][1] is None  # (nothing after the last kernel stamps its end)
    assert [r[2] for r in rows] == pytest.approx([100, (1050 + 1070) / 2, 3200])
    assert [r[3] for r in rows] == [64, 96, 256]  # each launch's blocks
    assert tool.by_kernel(rows)[0] == ("rows_many_n1", pytest.approx(2990), 1)


def test_stamps_take_the_names_of_launches_with_their_grid_and_block():
    tool = load_tool("timeline_decode")
    launches = [("a", 1, 32), ("b", 2, 32), ("c", 1, 32)]
    got = [(0, 0, 2, 32), (0, 0, 1, 32), (0, 0, 1, 32), (0, 0, 9, 32)]  # b ran ahead of a
    assert tool.match(launches, got) == ["b", "a", "c", "?"]


def test_a_kernel_that_waits_again_keeps_its_first_stamp_alone():
    from ds4.kernels import timeline

    entries = [(5, 9, 70, 64 << 32 | 256), (20, 30, 71, 4 << 32 | 256),  # 71 waits per item
               (40, 41, 71, 4 << 32 | 256), (60, 61, 71, 4 << 32 | 256), (62, 90, 72, 1 << 32 | 32)]
    raw = np.array([len(entries)] + [v for e in entries for v in e], np.uint64)
    assert timeline.launch_stamps(raw) == [(5, 9, 64, 256), (20, 30, 4, 256), (62, 90, 1, 32)]


def test_a_launch_counts_its_blocks_over_every_grid_dimension(monkeypatch):
    """A (heads, splits, members) grid is its product of blocks, as the stamps count them, so
    a batch's attention shows 1280 blocks, not its 8 head groups."""
    from ds4.kernels import timeline

    monkeypatch.setattr(timeline, "launches", [])
    timeline.record("attention_partial_m", (8, 20, 8), (256,))
    timeline.record("rows_split", (24,), (256, 1, 1))
    assert timeline.launches == [("attention_partial_m", 1280, 256), ("rows_split", 24, 256)]


def test_the_tool_refuses_to_run_on_kernels_built_without_stamps(monkeypatch, capsys):
    monkeypatch.delenv("DS4_TIMELINE", raising=False)
    with pytest.raises(SystemExit) as stop:
        load_tool("timeline_decode").main(["--layers", "sliding"])
    assert stop.value.code == 2 and "DS4_TIMELINE=1" in capsys.readouterr().err


def test_the_stamps_are_built_in_only_when_asked(monkeypatch):
    monkeypatch.delenv("DS4_TIMELINE", raising=False)
    assert "-DDS4_TIMELINE" not in compile_options()
    monkeypatch.setenv("DS4_TIMELINE", "1")
    assert "-DDS4_TIMELINE" in compile_options()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("family", ["rows", "hc_unit", "attention"])
def test_stamped_kernels_compile_for_sm90(family: str, tmp_path):
    proc = subprocess.run(
        ["nvcc", "-arch=sm_90", "--cubin", "-std=c++17", "-DDS4_TIMELINE", "-I", str(KERNEL_DIR),
         "-o", str(tmp_path / f"{family}.cubin"), str(KERNEL_DIR / f"{family}.cu")],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
