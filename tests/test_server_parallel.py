"""Several clients at once over real HTTP: interleaved streams equal isolated runs, a client
that disconnects frees its slot, queued streams get keep-alives, and a trace replays."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from test_server_support import GREEDY, busy_slots, live_server, wait_idle

from ds4.cli.replay import deterministic, recorded_view, replay, replayable
from ds4.cli.replay import main as replay_main
from ds4.jobs.trace import read_trace

PROMPTS = ["Tell me a story about a fox.", "List three prime numbers and explain."]


@pytest.fixture(scope="module")
def live():
    with live_server(parallel=2, ctx=4096) as (url, runtime):
        yield url, runtime


def stream_text(url: str, prompt: str, max_tokens: int) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    chunks = client.chat.completions.create(
        model=GREEDY, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_two_streaming_clients_each_equal_their_isolated_greedy_run(live):
    url, _ = live
    isolated = [stream_text(url, p, 40) for p in PROMPTS]
    together: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(
        i, stream_text(url, PROMPTS[i], 40))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [together[0], together[1]] == isolated
    assert isolated[0] != isolated[1]


def test_disconnect_mid_stream_frees_the_slot(live):
    url, _ = live
    body = {"model": GREEDY, "messages": [{"role": "user", "content": "Count forever"}],
            "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        while sum('"content"' in next(lines) for _ in range(2)) == 0:
            pass
        assert busy_slots(url) != []
    # closing the response drops the connection; 3000 tokens take far longer than this wait,
    # so only the cancel can free the slot in time
    assert wait_idle(url) == []
    assert stream_text(url, PROMPTS[0], 3)  # the server keeps serving


def generated_total(url: str) -> float:
    lines = httpx.get(url + "/metrics").text.splitlines()
    return sum(float(ln.split()[-1]) for ln in lines if ln.startswith("ds4_generated_tokens_total"))


def test_tokens_of_a_cancelled_stream_are_counted_in_metrics(live):
    url, _ = live
    before = generated_total(url)
    body = {"model": GREEDY, "messages": [{"role": "user", "content": "Count on"}],
            "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        seen = 0
        while seen < 3:
            seen += '"content"' in next(lines)
    assert wait_idle(url) == []
    assert generated_total(url) - before >= 3  # the engine's work, whoever stayed to read it


def test_non_streamed_client_that_gives_up_frees_the_slot(live):
    url, _ = live
    body = {"model": GREEDY, "messages": [{"role": "user", "content": "Write a book"}],
            "max_tokens": 3000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json=body, timeout=1.0)
    assert wait_idle(url) == []


def test_queued_streams_get_keep_alive_pings():
    with live_server(parallel=1, ctx=4096, ping_interval_s=0.2) as (url, _):
        long = {"model": GREEDY, "messages": [{"role": "user", "content": "Go on"}],
                "max_tokens": 3000, "temperature": 0, "stream": True}
        short = {"model": GREEDY, "max_tokens": 4, "temperature": 0, "stream": True,
                 "messages": [{"role": "user", "content": "Hi"}]}
        with httpx.stream("POST", url + "/v1/chat/completions", json=long) as first:
            first_lines = first.iter_lines()  # kept: a dropped iterator closes the connection
            next(first_lines)
            with httpx.stream("POST", url + "/v1/chat/completions", json=short) as queued:
                lines = queued.iter_lines()
                assert json.loads(next(lines)[6:])["choices"][0]["delta"] == {"role": "assistant"}
                assert [next(lines) for _ in range(2)] == ["", ": ping"]
            with httpx.stream("POST", url + "/v1/messages", json=short) as queued:
                # message_start waits for a slot (it reports the cache split); pings meanwhile
                lines = queued.iter_lines()
                frames = [next(lines) for _ in range(6)]
                assert frames[::3] == ["event: ping", "event: ping"]
            responses = {"model": GREEDY, "input": "Hi", "max_output_tokens": 4,
                         "temperature": 0, "stream": True}
            with httpx.stream("POST", url + "/v1/responses", json=responses) as queued:
                lines = (ln for ln in queued.iter_lines() if ln)
                frames = [(next(lines), next(lines)) for _ in range(3)]
                events = [json.loads(data[6:]) for _, data in frames]
                assert [name[7:] for name, _ in frames] == [e["type"] for e in events]
            # real events, not comments: Codex times a stream out on parsed events only
            assert [e["type"] for e in events] == ["response.created", "response.in_progress",
                                                   "response.in_progress"]
            assert [e["sequence_number"] for e in events] == [0, 1, 2]


def test_trace_replays_with_the_same_text(tmp_path, capsys):
    trace = tmp_path / "jobs.jsonl"
    with live_server(parallel=2, ctx=4096, trace=str(trace)) as (url, _runtime):
        texts = [stream_text(url, prompt, n) for prompt in PROMPTS for n in (6, 12)]
        wait_idle(url)
        records = [r for r in read_trace(trace) if replayable(r)]
        assert [recorded_view(r).content for r in records] == texts
        assert all(deterministic(r) for r in records)
        assert {r["endpoint"] for r in records} == {"/v1/chat/completions"}
        copy = tmp_path / "copy.jsonl"  # the server writes `trace` itself: ds4-replay refuses it
        copy.write_text("".join(json.dumps(r) + "\n" for r in records))
        assert replay_main([str(copy), "--url", url]) == 0
        assert f"{len(records)} job(s) compared, 0 skipped" in capsys.readouterr().out
        tampered = dict(records[0], text="something else")
        assert len(replay([tampered], url).problems) == 1
