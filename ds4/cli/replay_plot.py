"""`ds4-replay --plot`: each job's queue, prefill and decode on a time axis, grouped by slot,
recorded beside replayed (matplotlib, the optional `ds4[plot]` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ds4.cli.replay_report import JobRow
from ds4.jobs.latency import JobTiming

PHASES = (("queue", "#bbbbbb"), ("prefill", "#e69f00"), ("decode", "#0072b2"))


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def pyplot() -> Any:
    """matplotlib's pyplot on a file-only backend, or PlotUnavailable saying how to get it."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'ds4[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def phases(t: JobTiming) -> list[tuple[float, float]]:
    """(start, width) of queue, prefill and decode; a phase with unknown ends is empty."""
    start = t.started if t.started is not None else t.arrived
    first = t.token_times[0] if t.token_times else start
    end = t.arrived + t.latency if t.latency is not None else first
    return [(t.arrived, start - t.arrived), (start, first - start), (first, end - first)]


def draw(ax: Any, rows: list[tuple[str, JobTiming]], title: str) -> None:
    """One panel: a bar per job, one colour per phase."""
    for y, (_label, timing) in enumerate(rows):
        for (left, width), (name, colour) in zip(phases(timing), PHASES):
            ax.barh(y, width, left=left, color=colour, label=name if y == 0 else None)
    ax.set_yticks(range(len(rows)), [label for label, _t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the first arrival")
    ax.set_title(title)


def lane(rows: list[JobRow], replayed: bool) -> list[tuple[str, JobTiming]]:
    """Jobs by slot, then arrival, labelled with both."""
    picked = [(r.slot if replayed else r.recorded_slot, r.seq,
               r.replayed if replayed else r.recorded) for r in rows]
    picked = [p for p in picked if p[2] is not None]
    picked.sort(key=lambda p: (p[0] if p[0] is not None else -1, p[1]))
    return [(f"slot {s if s is not None else '?'} · job {seq}", t) for s, seq, t in picked]


def plot(rows: list[JobRow], path: str | Path) -> None:
    """Write the timeline PNG."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(14, 1.5 + 0.35 * len(rows)), sharex=True)
    draw(axes[0], lane(rows, False), "recorded")
    draw(axes[1], lane(rows, True), "replayed")
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
