"""`ds4-replay`: run the jobs of a --trace file again and compare them with the recording.

Without --url the model is loaded here and the jobs run through the real scheduler from their
recorded prompt token ids, seeds and sampling settings: every job that ended on its own,
greedy or sampled, must reproduce its recorded tokens exactly. With --url the recorded
requests are streamed to a running server of the same model (greedy and seeded jobs compared
text-exactly, the others timed). Either way a table puts the recorded and replayed latencies
(TTFT, ITL, TPOT, end-to-end) side by side.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

import httpx
from tqdm import tqdm

from ds4.cli.flags import ShowDefaults, add_version
from ds4.cli.replay_http import (  # noqa: F401  (the public names of the HTTP replay)
    ForeignModel,
    OwnTrace,
    Report,
    deterministic,
    recorded_view,
    replay,
    replayable,
    returned_view,
)
from ds4.cli.replay_plot import PlotUnavailable, plot, pyplot
from ds4.cli.replay_report import JobRow, divergence, print_tables, report, write_report
from ds4.jobs.latency import recorded_timing
from ds4.jobs.trace import FORMAT, Trace, TraceError, model_fingerprint, read_trace_file

if TYPE_CHECKING:  # the scheduler (and the engine behind it) loads only for in-process runs
    from ds4.jobs.scheduler import SchedulerConfig


SCHED_ENV = {"prefill_ms": "DS4_SERVER_SCHED_PREFILL_MS",
             "decode_tokens": "DS4_SERVER_SCHED_DECODE_TOKENS"}


class Refused(Exception):
    """A trace this replay will not run (another model, a newer format); exit 2."""


def seq_list(text: str) -> set[int]:
    """--jobs: comma-separated job numbers."""
    try:
        return {int(s) for s in text.split(",") if s.strip()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of job numbers: "
                                         f"{text!r}") from None


def positive(text: str) -> int:
    """A whole number of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    """The command line of ds4-replay."""
    p = argparse.ArgumentParser(prog="ds4-replay", description=__doc__.splitlines()[0],
                                formatter_class=ShowDefaults)
    add_version(p)
    p.add_argument("trace", help="a file written by ds4-server --trace")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--model", help="replay in-process on this model directory (default: "
                       "the built-in tiny model)")
    where.add_argument("--url", help="send the requests to the server at this base URL")
    p.add_argument("--api-key", help="the server's --api-key, if it has one (with --url)")
    p.add_argument("--force", action="store_true", help="with --url, replay even when the "
                   "server's model fingerprint is not the trace's")
    p.add_argument("--parallel", type=positive, help="slots in-process, requests in flight "
                   "over HTTP (default: the trace's --parallel, else 1)")
    p.add_argument("--ctx", type=positive, help="context tokens per slot, in-process "
                   "(default: the trace's --ctx)")
    p.add_argument("--backend", choices=["auto", "numpy", "cupy"],
                   help="array backend, in-process (default: the trace's, else auto)")
    p.add_argument("--timing", choices=["original", "asap"], default="asap",
                   help="original: the recorded arrival gaps; asap: as fast as slots allow")
    p.add_argument("--report", metavar="FILE.json", help="write the per-job and aggregated "
                   "figures as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw each job's queue, prefill and "
                   "decode per slot (needs ds4[plot])")
    p.add_argument("--jobs", type=seq_list, metavar="SEQ,...", help="replay only these jobs")
    return p


def check_format(trace: Trace, path: str) -> None:
    """Refuse a trace of a newer format than this replay reads."""
    version = trace.header.get("ds4_trace", FORMAT)
    if not isinstance(version, int) or version > FORMAT:
        raise Refused(f"{path}: trace format {version!r} is newer than this ds4-replay "
                      f"reads ({FORMAT})")


def check_model(trace: Trace, path: str, model_dir: str) -> None:
    """Refuse a trace recorded with another model than the one in `model_dir`."""
    from ds4.engine import model_path  # a shipped config's name resolves to its directory

    want = trace.header.get("model_fingerprint")
    if want is None:
        print(f"ds4-replay: {path} has no header line (an older server): the model is not "
              "checked", file=sys.stderr)
    elif want != (have := model_fingerprint(model_path(model_dir))):
        raise Refused(f"{path} was recorded with another model (fingerprint {want}); "
                      f"{model_dir} is {have}")


def progress(total: int) -> tqdm:
    """A progress bar on a terminal, nothing otherwise."""
    return tqdm(total=total, unit="job", desc="ds4-replay", disable=not sys.stderr.isatty())


def scheduler_config(a: argparse.Namespace, header: dict) -> SchedulerConfig:
    """The recorded server's slots and timeslices; --parallel, --ctx and a DS4_SERVER_SCHED_*
    variable that is set win over the trace's header."""
    from ds4.jobs.scheduler import SchedulerConfig

    recorded = {key: header[key] for key, env in SCHED_ENV.items()
                if key in header and not os.environ.get(env)}
    return replace(SchedulerConfig.from_env(), **recorded,
                   parallel=a.parallel or header.get("parallel", 1),
                   ctx_size=a.ctx or header.get("ctx", 32768))


def in_process(a: argparse.Namespace, trace: Trace, records: list[dict]) -> list[JobRow]:
    """Load the model, run the records through a scheduler, compare every job's tokens."""
    from ds4.jobs.replay import ENDED_ON_ITS_OWN, TraceRun
    from ds4.server.config import ServerConfig
    from ds4.server.runtime import open_engine

    header = trace.header
    cfg = ServerConfig(model_dir=a.model, backend=a.backend or header.get("backend", "auto"),
                       prefill_chunk=header.get("prefill_chunk", 2048))
    engine = open_engine(a.model, cfg)
    sched = scheduler_config(a, header)
    runnable = [r for r in records if r.get("finish_reason") in ENDED_ON_ITS_OWN]
    with progress(len(runnable)) as bar:
        replayed = TraceRun(engine, sched, a.timing, bar.update).run(runnable)
    origin = min(r.get("arrived_at", 0.0) for r in runnable) if runnable else 0.0
    decode = engine.tokenizer.decode
    rows = []
    for record, out in zip(sorted(runnable, key=lambda r: r["seq"]), replayed):
        div = divergence(out.seq, record["generated_tokens"], out.tokens, decode)
        outcome = "failed" if out.error else ("diverged" if div else "token-exact")
        rows.append(JobRow(out.seq, outcome, recorded_timing(record, origin), out.timing,
                           out.slot, record.get("slot"), div))
    return rows


def over_http(a: argparse.Namespace, trace: Trace, records: list[dict]
              ) -> tuple[list[JobRow], Report]:
    """Stream the records to the server at --url; rows carry the streams' times."""
    runnable = [r for r in records if replayable(r)]
    with progress(len(runnable)) as bar:
        rep = replay(runnable, a.url, a.api_key, trace=a.trace,
                     parallel=a.parallel or trace.header.get("parallel", 1),
                     timing=a.timing, on_done=lambda _s: bar.update(),
                     fingerprint=trace.header.get("model_fingerprint"), force=a.force)
    rep.not_sent = len(records) - len(runnable)
    origin = min(r.get("arrived_at", 0.0) for r in runnable) if runnable else 0.0
    rows = [JobRow(r["seq"], rep.outcomes.get(r["seq"], "failed"), recorded_timing(r, origin),
                   rep.timings.get(r["seq"]), None, r.get("slot"))
            for r in sorted(runnable, key=lambda r: r["seq"])]
    return rows, rep


def finish(a: argparse.Namespace, rows: list[JobRow], mode: str) -> None:
    """Print the tables; write --report and --plot."""
    data = report(rows, mode)
    print_tables(data, rows)
    if a.report:
        write_report(a.report, data)
    if a.plot:
        plot(rows, a.plot)


def run_in_process(a: argparse.Namespace, trace: Trace, records: list[dict]) -> int:
    """The in-process replay; exit 1 when a job diverged or failed."""
    rows = in_process(a, trace, records)
    for row in rows:
        if row.divergence:
            print("\n".join(row.divergence.lines()))
    finish(a, rows, "in-process")
    exact = sum(r.outcome == "token-exact" for r in rows)
    bad = len(rows) - exact
    print(f"ds4-replay: {len(rows)} job(s) replayed in-process, {exact} token-exact, "
          f"{bad} diverged or failed, {len(records) - len(rows)} not replayed (cancelled or "
          "failed when recorded)")
    return 1 if bad else 0


def run_over_http(a: argparse.Namespace, trace: Trace, records: list[dict]) -> int:
    """The HTTP replay; exit 1 when a compared job differs or a request fails."""
    rows, rep = over_http(a, trace, records)
    for line in rep.problems:
        print(line)
    finish(a, rows, "http")
    print(rep.summary())
    return 1 if rep.problems else 0


def load(a: argparse.Namespace) -> tuple[Trace, list[dict]]:
    """The trace and the records selected by --jobs; the model checked in-process (over
    HTTP against the server's, once it answers)."""
    trace = read_trace_file(a.trace)
    check_format(trace, a.trace)
    records = [r for r in trace.records if a.jobs is None or r["seq"] in a.jobs]
    if a.jobs and (unknown := a.jobs - {r["seq"] for r in records}):
        raise Refused(f"{a.trace} has no job {', '.join(map(str, sorted(unknown)))}")
    if a.url is None:
        if a.model is None:
            from ds4.engine import default_model_dir

            a.model = str(default_model_dir())
        check_model(trace, a.trace, a.model)
    return trace, records


def main(argv: list[str] | None = None) -> int:
    """Entry point of ds4-replay: 0 when all matched, 1 on a divergence or failed request,
    2 for a trace it will not read or run."""
    a = parser().parse_args(argv)
    try:
        if a.plot:
            pyplot()  # a missing matplotlib is said before the replay, not after
        trace, records = load(a)
        if a.url is None:
            return run_in_process(a, trace, records)
        return run_over_http(a, trace, records)
    except (TraceError, Refused, OwnTrace, ForeignModel, PlotUnavailable) as exc:
        print(f"ds4-replay: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"ds4-replay: {a.url}: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError, RuntimeError) as exc:  # no such trace, a model that won't load
        print(f"ds4-replay: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, (OSError, UnicodeDecodeError)) else 1


if __name__ == "__main__":
    sys.exit(main())
