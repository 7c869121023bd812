"""`ds4-replay` against a live server: jobs streamed, timed from their chunks (TTFT, ITL,
TPOT) and compared text-exactly or timed only, reasoning and tool calls compared, and a trace
never replayed into the server that writes it nor into a server of another model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_server_support import GREEDY, live_server

from ds4.cli.replay import recorded_view, replay, returned_view
from ds4.cli.replay_http import check_server_model
from ds4.jobs.trace import read_trace

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
HI = [{"role": "user", "content": "Hi"}]
JOBS = [  # one job per protocol, greedy or seeded, and one that cannot be compared
    ("/v1/chat/completions", {"model": GREEDY, "messages": HI, "max_tokens": 6,
                              "temperature": 0}),
    ("/v1/chat/completions", {"model": "deepseek-reasoner", "messages": HI, "max_tokens": 6,
                              "seed": 5}),
    ("/v1/messages", {"model": GREEDY, "messages": HI, "max_tokens": 6, "temperature": 0}),
    ("/v1/responses", {"model": GREEDY, "input": "Hi", "max_output_tokens": 6,
                       "temperature": 0}),
    ("/v1/completions", {"model": GREEDY, "prompt": "Once", "max_tokens": 6, "temperature": 0}),
    ("/v1/chat/completions", {"model": GREEDY, "messages": HI, "max_tokens": 6,
                              "temperature": 1.0}),
]
CALL = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A server writing `trace`, and the records of the JOBS it ran."""
    trace = tmp_path_factory.mktemp("replay") / "jobs.jsonl"
    with live_server(parallel=1, ctx=2048, trace=str(trace)) as (url, _runtime):
        for path, body in JOBS:
            assert httpx.post(url + path, json=body, timeout=60).status_code == 200
        deadline = time.monotonic() + 10
        while len(read_trace(trace)) < len(JOBS):  # a record follows its reply
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield url, trace, read_trace(trace)


def replay_command(*args: str) -> subprocess.CompletedProcess:
    """`ds4-replay ARGS` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "ds4.cli.replay", *args], env=ENV,
                          capture_output=True, text=True, timeout=60)


def copy_of(trace: Path, tmp_path: Path, **header: object) -> Path:
    """A copy of the server's trace (its header changed by `header`): one it does not write."""
    lines = trace.read_text().splitlines()
    first = json.dumps({**json.loads(lines[0]), **header})
    copy = tmp_path / "copy.jsonl"
    copy.write_text("".join(line + "\n" for line in [first, *lines[1:]]))
    return copy


def test_a_copy_replays_streamed_with_its_latencies_side_by_side(live, tmp_path):
    url, trace, _records = live
    report = tmp_path / "report.json"
    result = replay_command(str(copy_of(trace, tmp_path)), "--url", url, "--report", str(report))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "ds4-replay: 5 job(s) compared, 1 skipped (not " \
        "greedy or seeded: timed only), 0 problem(s) (compared text-exactly: token ids do not " \
        "cross HTTP)"
    jobs = json.loads(report.read_text())["jobs"]
    assert [j["outcome"] for j in jobs] == ["text-exact"] * 5 + ["timed"]
    for job in jobs:  # TTFT and ITL come from the stream's chunks, as they did when recorded
        rec, rep = job["recorded"], job["replayed"]
        assert rep["tokens"] == rec["tokens"] == 6
        assert 0 < rep["ttft_s"] <= rep["e2el_s"] and 0 < rec["ttft_s"] <= rec["e2el_s"]
        assert rep["itl_s"] > 0 and rep["tpot_s"] > 0 and rec["itl_s"] > 0
    agg = json.loads(report.read_text())["aggregate"]["replayed"]
    assert agg["output_tokens"] == 36 and set(agg["itl_s"]) == {"mean", "p50", "p90", "p99"}
    assert "ITL rec  ITL rep" in result.stdout and "| ITL p99 (ms)" in result.stdout


def test_the_server_reports_the_fingerprint_its_trace_header_carries(live):
    url, trace, _records = live
    header = json.loads(trace.read_text().splitlines()[0])
    assert httpx.get(url + "/health").json()["model_fingerprint"] == header["model_fingerprint"]


def test_another_models_trace_is_refused_over_http_unless_forced(live, tmp_path):
    url, trace, _records = live
    foreign = copy_of(trace, tmp_path, model_fingerprint="f" * 32)
    jobs = len(read_trace(trace))
    result = replay_command(str(foreign), "--url", url)
    assert result.returncode == 2 and result.stdout == ""
    have = httpx.get(url + "/health").json()["model_fingerprint"]
    assert result.stderr == f"ds4-replay: {foreign} was recorded with another model " \
        f"(fingerprint {'f' * 32}); the server at {url} serves {have} (--force replays it " \
        "anyway)\n"
    assert len(read_trace(trace)) == jobs  # nothing was sent
    forced = replay_command(str(foreign), "--url", url, "--force", "--jobs", "1")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert "replaying it anyway (--force)" in forced.stderr


def test_the_servers_own_trace_is_refused(live, tmp_path):
    url, trace, _records = live
    alias = tmp_path / "alias.jsonl"
    os.link(trace, alias)  # another name of the same file
    lines = trace.read_text()
    for path in (trace, alias):
        result = replay_command(str(path), "--url", url)
        assert result.returncode == 2
        assert result.stderr.startswith(f"ds4-replay: the server at {url} writes its --trace")
    assert trace.read_text() == lines  # nothing was sent


def test_reasoning_that_differs_is_reported(live):
    url, _trace, records = live
    thought = next(r for r in records if r["thinking"])
    assert recorded_view(thought).reasoning  # the seeded job did think
    tampered = dict(thought, text="Other thoughts. " + thought["text"])
    problems = replay([tampered], url).problems
    assert len(problems) == 1 and "the reasoning differs" in problems[0]


def test_a_tool_call_that_differs_is_reported(live):
    url, _trace, records = live
    greedy = records[0]
    assert greedy["endpoint"] == "/v1/chat/completions" and not greedy["thinking"]
    tampered = dict(greedy, text=greedy["text"] + CALL, tools_active=True)
    problems = replay([tampered], url).problems
    assert [p for p in problems if "the tool calls differ" in p], problems
    assert "get_weather" in " ".join(problems)


def test_a_recorded_call_equals_the_item_a_responses_client_sees():
    record = {"endpoint": "/v1/responses", "thinking": False, "tools_active": True,
              "text": "Ok" + CALL.replace('"city"', '"input"'),
              "raw_request": json.dumps({"tools": [{"type": "custom", "name": "get_weather"}]})}
    body = {"output": [
        {"type": "message", "content": [{"type": "output_text", "text": "Ok"}]},
        {"type": "custom_tool_call", "name": "get_weather", "input": "Paris", "call_id": "c"}]}
    want = recorded_view(record)
    assert want.tool_calls == (("custom", "get_weather", "Paris"),)
    assert returned_view("/v1/responses", {}, body) == want


def test_a_server_or_trace_that_does_not_say_its_model_is_replayed_with_a_note(capsys):
    check_server_model({"status": "ok"}, "http://x", "t.jsonl", "a" * 32)
    assert capsys.readouterr().err == "ds4-replay: the server at http://x does not report its " \
        "model fingerprint: the model is not checked\n"
    check_server_model({"model_fingerprint": "a" * 32}, "http://x", "t.jsonl", None)
    assert capsys.readouterr().err == "ds4-replay: t.jsonl has no header line: the model is " \
        "not checked\n"
    check_server_model({"model_fingerprint": "a" * 32}, "http://x", "t.jsonl", "a" * 32)
    assert capsys.readouterr().err == ""
