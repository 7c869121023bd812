"""`ds4-replay` against a live server: jobs compared and skipped, reasoning and tool calls
compared, and a trace never replayed into the server that writes it."""

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


def test_a_copy_replays_and_the_summary_counts_compared_and_skipped(live, tmp_path):
    url, _trace, records = live
    copy = tmp_path / "copy.jsonl"
    copy.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = replay_command(str(copy), "--url", url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == \
        "ds4-replay: 5 job(s) compared, 1 skipped (not greedy or seeded), 0 problem(s)"


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
