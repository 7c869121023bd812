"""What ds4-replay shows: the first divergence of a job, the recorded-vs-replayed latency
tables, the --report JSON and the --plot timeline."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ds4.jobs.latency import JobTiming, summary

AROUND = 8  # tokens of context shown on each side of a divergence
Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class Divergence:
    """Where a replayed job's tokens first differ from the recorded ones."""

    seq: int
    position: int
    expected: int | None  # None: the recorded tokens ended here
    got: int | None  # None: the replayed tokens ended here
    expected_text: str
    got_text: str

    def lines(self) -> list[str]:
        """The report's lines for this divergence."""
        return [f"job {self.seq}: diverges at token {self.position}: expected "
                f"{self.expected}, got {self.got}",
                f"  expected: {self.expected_text!r}", f"  got:      {self.got_text!r}"]

    def as_dict(self) -> dict:
        """The JSON form."""
        return {"position": self.position, "expected": self.expected, "got": self.got,
                "expected_text": self.expected_text, "got_text": self.got_text}


def first_difference(want: list[int], got: list[int]) -> int | None:
    """Index of the first token that differs (or where one list ends first); None if equal."""
    for i, (w, g) in enumerate(zip(want, got)):
        if w != g:
            return i
    return None if len(want) == len(got) else min(len(want), len(got))


def around(tokens: list[int], i: int, decode: Decode) -> str:
    """The text around token i, the token itself in [brackets] (empty past the end)."""
    here = decode(tokens[i:i + 1]) if i < len(tokens) else ""
    return (decode(tokens[max(0, i - AROUND):i]) + "[" + here + "]"
            + decode(tokens[i + 1:i + 1 + AROUND]))


def divergence(seq: int, want: list[int], got: list[int], decode: Decode) -> Divergence | None:
    """The first divergence of a replayed job from its record, or None when token-exact."""
    i = first_difference(want, got)
    if i is None:
        return None
    pick = lambda ids: ids[i] if i < len(ids) else None  # noqa: E731
    return Divergence(seq, i, pick(want), pick(got), around(want, i, decode),
                      around(got, i, decode))


def ms(value: float | None) -> str:
    """Seconds as milliseconds for a table cell ("-" when unknown)."""
    return "-" if value is None else f"{value * 1000:.1f}"


STAT_ROWS = (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("TPOT", "tpot_s"), ("E2EL", "e2el_s"))


def aggregate_table(recorded: dict, replayed: dict) -> list[str]:
    """Rows of metric, statistic, recorded and replayed (milliseconds and rates)."""
    rows = [f"| {'metric':22} | {'recorded':>10} | {'replayed':>10} |",
            f"|{'-' * 24}|{'-' * 11}:|{'-' * 11}:|"]
    for name, key in STAT_ROWS:
        for stat in ("mean", "p50", "p90", "p99"):
            a, b = ((s.get(key) or {}).get(stat) for s in (recorded, replayed))
            rows.append(f"| {name + ' ' + stat + ' (ms)':22} | {ms(a):>10} | {ms(b):>10} |")
    for label, key in (("requests/s", "request_throughput"),
                       ("output tokens/s", "token_throughput"), ("duration (s)", "duration_s")):
        a, b = (s.get(key) for s in (recorded, replayed))
        cells = [f"{v:.2f}" if v is not None else "-" for v in (a, b)]
        rows.append(f"| {label:22} | {cells[0]:>10} | {cells[1]:>10} |")
    return rows


@dataclass
class JobRow:
    """One job in the report: its outcome and both timings."""

    seq: int
    outcome: str  # token-exact | diverged (in-process); text-exact | differs | timed | failed
    recorded: JobTiming
    replayed: JobTiming | None
    slot: int | None = None
    recorded_slot: int | None = None
    divergence: Divergence | None = None

    def cells(self) -> str:
        """The per-job table row."""
        rep = self.replayed or JobTiming(0.0)
        pairs = ((self.recorded.ttft, rep.ttft), (self.recorded.itl_mean, rep.itl_mean),
                 (self.recorded.tpot, rep.tpot), (self.recorded.latency, rep.latency))
        nums = " | ".join(f"{ms(a):>8} {ms(b):>8}" for a, b in pairs)
        return f"| {self.seq:>4} | {self.recorded.tokens:>6} | {nums} | {self.outcome:12} |"

    def as_dict(self) -> dict:
        """The JSON form."""
        out = {"seq": self.seq, "outcome": self.outcome, "slot": self.slot,
               "recorded_slot": self.recorded_slot, "recorded": self.recorded.per_job(),
               "replayed": self.replayed.per_job() if self.replayed else None}
        if self.divergence:
            out["divergence"] = self.divergence.as_dict()
        return out


def job_table(rows: list[JobRow]) -> list[str]:
    """Per job: tokens, then TTFT, mean ITL, TPOT and E2EL (ms) recorded and replayed, and
    the outcome."""
    names = ("TTFT", "ITL", "TPOT", "E2EL")
    head = " | ".join(f"{n + ' rec':>8} {n + ' rep':>8}" for n in names)
    return [f"| {'job':>4} | {'tokens':>6} | {head} | {'outcome':12} |",
            f"|{'-' * 6}|{'-' * 8}|" + f"{'-' * 19}|" * len(names) + f"{'-' * 14}|",
            *(r.cells() for r in rows)]


def report(rows: list[JobRow], mode: str) -> dict:
    """The --report JSON: per job and aggregated, recorded and replayed side by side."""
    return {"mode": mode, "jobs": [r.as_dict() for r in rows],
            "aggregate": {"recorded": summary([r.recorded for r in rows]),
                          "replayed": summary([r.replayed for r in rows if r.replayed])}}


def print_tables(data: dict, rows: list[JobRow]) -> None:
    """The stdout report: per-job table, then the aggregates."""
    print("\n".join(job_table(rows)))
    print()
    print("\n".join(aggregate_table(data["aggregate"]["recorded"],
                                    data["aggregate"]["replayed"])))


def write_report(path: str | Path, data: dict) -> None:
    """Write the --report JSON file."""
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
