"""`ds4-replay TRACE` in-process: a trace of concurrent greedy, seeded and unseeded sampled
jobs comes out token-exact; an edited, truncated or foreign trace is reported and refused;
--timing original keeps the recorded arrival gaps, in-process and over HTTP; the same trace
replays over HTTP too, its greedy and seeded jobs text-exact with TTFT and ITL from the
stream."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_server_support import GREEDY, live_server

from ds4.cli.replay import main as replay_main
from ds4.jobs.trace import read_trace_file

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
HI = [{"role": "user", "content": "Hi there"}]
GAP_S = 0.3  # between arrivals: jobs overlap on two slots, and the gaps are measurable
JOBS = [
    ("/v1/chat/completions", {"model": GREEDY, "messages": HI, "max_tokens": 10,
                              "temperature": 0}),
    ("/v1/chat/completions", {"model": GREEDY, "messages": HI, "max_tokens": 10,
                              "temperature": 1.0, "seed": 7}),
    ("/v1/chat/completions", {"model": GREEDY, "messages": HI, "max_tokens": 10,
                              "temperature": 1.0}),
    ("/v1/completions", {"model": GREEDY, "prompt": "Once upon", "max_tokens": 10,
                         "temperature": 0.8, "top_p": 0.9}),
    ("/v1/messages", {"model": "deepseek-reasoner", "messages": HI, "max_tokens": 10}),
]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A --parallel 2 server's trace of the JOBS sent concurrently, and the server's URL."""
    trace = tmp_path_factory.mktemp("inprocess") / "jobs.jsonl"
    with live_server(parallel=2, ctx=1024, trace=str(trace)) as (url, _runtime):
        statuses: list[int] = []
        threads = [threading.Thread(target=lambda p=p, b=b: statuses.append(
            httpx.post(url + p, json=b, timeout=120).status_code)) for p, b in JOBS]
        for thread in threads:
            thread.start()
            time.sleep(GAP_S)
        for thread in threads:
            thread.join()
        assert statuses == [200] * len(JOBS)
        deadline = time.monotonic() + 10
        while len(read_trace_file(trace).records) < len(JOBS):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        copy = trace.with_name("copy.jsonl")  # the server's own file is refused over HTTP
        copy.write_text(trace.read_text())
        yield copy, url


def lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines()


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def replay_command(*args: str) -> subprocess.CompletedProcess:
    """`ds4-replay ARGS` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "ds4.cli.replay", *args], env=ENV,
                          capture_output=True, text=True, timeout=120)


def test_the_trace_has_a_header_and_overlapping_sampled_jobs(recorded):
    trace = read_trace_file(recorded[0])
    assert trace.header["ds4_trace"] == 1 and len(trace.header["model_fingerprint"]) == 32
    assert trace.header["parallel"] == 2
    assert {r["slot"] for r in trace.records} == {0, 1}
    unseeded = [r for r in trace.records if r["sampling"]["temperature"] > 0
                and r["sampling"]["seed"] is None]
    assert len(unseeded) >= 2 and all(isinstance(r["seed"], int) for r in unseeded)


def test_every_job_replays_token_exact_in_process(recorded, tmp_path):
    report = tmp_path / "report.json"
    result = replay_command(str(recorded[0]), "--report", str(report))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == (
        "ds4-replay: 5 job(s) replayed in-process, 5 token-exact, 0 diverged or failed, "
        "0 not replayed (cancelled or failed when recorded)")
    data = json.loads(report.read_text())
    assert [j["outcome"] for j in data["jobs"]] == ["token-exact"] * 5
    assert all(j["replayed"]["tokens"] == 10 for j in data["jobs"])
    for side in ("recorded", "replayed"):
        agg = data["aggregate"][side]
        assert agg["requests"] == 5 and agg["output_tokens"] == 50
        assert set(agg["ttft_s"]) == {"mean", "p50", "p90", "p99"}
        assert 0 < agg["ttft_s"]["p50"] <= agg["e2el_s"]["p50"]
        assert agg["itl_s"]["mean"] > 0 and agg["request_throughput"] > 0
    assert "| TTFT p99 (ms)" in result.stdout and "| requests/s" in result.stdout


def test_an_edited_token_is_reported_with_its_job_and_position(recorded, tmp_path, capsys):
    lines = lines_of(recorded[0])
    record = json.loads(lines[3])
    want = record["generated_tokens"]
    got = want[4]
    want[4] = (got + 1) % 1000
    edited = write(tmp_path / "edited.jsonl", lines[:3] + [json.dumps(record)] + lines[4:])
    assert replay_main([str(edited), "--jobs", str(record["seq"])]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"job {record['seq']}: diverges at token 4: expected {want[4]}, got {got}"
    quotes = ("'", '"')  # repr() quotes text holding a ' with "
    assert out[1].startswith(tuple("  expected: " + q for q in quotes))
    assert out[2].startswith(tuple("  got:      " + q for q in quotes))
    assert out[1] != out[2] and "[" in out[1]
    assert "0 token-exact, 1 diverged or failed" in out[-1]


def test_a_truncated_line_is_named_and_exits_2(recorded, tmp_path):
    lines = lines_of(recorded[0])
    cut = write(tmp_path / "cut.jsonl", lines[:3] + [lines[3][: len(lines[3]) // 2]])
    result = replay_command(str(cut))
    assert result.returncode == 2
    assert result.stderr.startswith(f"ds4-replay: {cut}:4: not a JSON line")
    assert "Traceback" not in result.stderr
    missing = write(tmp_path / "missing.jsonl", lines[:1] + ['{"seq": 1}'])
    result = replay_command(str(missing))
    assert result.returncode == 2 and f"{missing}:2: not a ds4 job record" in result.stderr


def test_a_foreign_models_trace_is_refused(recorded, tmp_path):
    lines = lines_of(recorded[0])
    header = dict(json.loads(lines[0]), model_fingerprint="f" * 32)
    foreign = write(tmp_path / "foreign.jsonl", [json.dumps(header)] + lines[1:])
    result = replay_command(str(foreign))
    assert result.returncode == 2
    assert f"{foreign} was recorded with another model (fingerprint {'f' * 32})" in \
        result.stderr


def test_a_trace_without_header_still_replays(recorded, tmp_path, capsys):
    old = write(tmp_path / "old.jsonl", lines_of(recorded[0])[1:3])
    assert replay_main([str(old)]) == 0
    assert "has no header line (an older server): the model is not checked" in \
        capsys.readouterr().err


@pytest.mark.parametrize("where", ["in-process", "http"])
def test_original_timing_keeps_the_arrival_gaps(recorded, tmp_path, where):
    report = tmp_path / "timed.json"
    trace, url = recorded
    over = ["--url", url, "--parallel", "2"] if where == "http" else []
    assert replay_main([str(trace), *over, "--timing", "original", "--report", str(report)]) == 0
    jobs = json.loads(report.read_text())["jobs"]
    recorded_at = [j["recorded"]["arrived_s"] for j in jobs]
    replayed_at = [j["replayed"]["arrived_s"] - jobs[0]["replayed"]["arrived_s"] for j in jobs]
    assert recorded_at[-1] >= (len(JOBS) - 1) * GAP_S * 0.9
    assert all(abs(a - b) <= 0.05 for a, b in zip(recorded_at, replayed_at)), \
        (recorded_at, replayed_at)


def test_the_same_trace_replays_against_the_live_server(recorded, tmp_path, capsys):
    trace, url = recorded
    report = tmp_path / "http.json"
    assert replay_main([str(trace), "--url", url, "--parallel", "2", "--report",
                        str(report)]) == 0
    jobs = json.loads(report.read_text())["jobs"]
    greedy_or_seeded = [j for j in jobs if j["outcome"] == "text-exact"]
    assert len(greedy_or_seeded) == 2 and all(j["outcome"] in ("text-exact", "timed")
                                              for j in jobs)
    assert all(j["replayed"]["ttft_s"] > 0 and j["replayed"]["itl_s"] > 0 for j in jobs)
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "ds4-replay: 2 job(s) compared, 3 skipped (not greedy or seeded: timed " \
        "only), 0 problem(s) (compared text-exactly: token ids do not cross HTTP)"
    assert any(line.startswith("| E2EL p50 (ms)") for line in out)


def test_plot_draws_a_png(recorded, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    assert replay_main([str(recorded[0]), "--jobs", "1,2", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_get_it(recorded, tmp_path):
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = {**ENV, "PYTHONPATH": f"{fake.parent}{os.pathsep}{ROOT}"}
    result = subprocess.run([sys.executable, "-m", "ds4.cli.replay", str(recorded[0]),
                             "--plot", str(tmp_path / "t.png")], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == "ds4-replay: --plot needs matplotlib: pip install 'ds4[plot]'\n"
