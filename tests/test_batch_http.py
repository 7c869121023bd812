"""Concurrent streams over real HTTP decode in shared engine steps and keep their isolated text.

The streams ask for different lengths, so shorter ones leave the batch while longer ones go on;
/metrics counts the steps by batch size and /slots shows which slots shared the last one.
"""

from __future__ import annotations

import threading

import httpx
import pytest
from test_server_parallel import stream_text
from test_server_support import GREEDY, live_server, wait_idle

PROMPTS = ["Tell me a story about a fox.", "List three prime numbers and explain.",
           "Write a haiku about rain.", "What is the capital of France?"]
LENGTHS = [24, 40, 32, 48]


@pytest.fixture(scope="module")
def url():
    with live_server(parallel=4, ctx=2048) as (base, _runtime):
        yield base


def batch_steps(url: str) -> tuple[float, float]:
    """(engine decode steps, steps with one session) from /metrics."""
    lines = httpx.get(url + "/metrics").text.splitlines()

    def value(prefix: str) -> float:
        return next(float(ln.split()[-1]) for ln in lines if ln.startswith(prefix))
    return value("ds4_decode_batch_size_count"), value('ds4_decode_batch_size_bucket{le="1.0"}')


def together(url: str, n: int) -> list[str]:
    """The first n prompts streamed at once, started together."""
    out: dict[int, str] = {}
    start = threading.Barrier(n)

    def client(i: int) -> None:
        start.wait()
        out[i] = stream_text(url, PROMPTS[i], LENGTHS[i])
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return [out[i] for i in range(n)]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_concurrent_greedy_streams_equal_their_isolated_runs(url, n):
    isolated = [stream_text(url, PROMPTS[i], LENGTHS[i]) for i in range(n)]
    steps, alone = batch_steps(url)
    assert together(url, n) == isolated
    steps_after, alone_after = batch_steps(url)
    assert steps_after - steps > alone_after - alone  # some steps decoded several streams
    assert len(set(isolated)) == n
    slots = httpx.get(url + "/slots").json()["slots"]
    assert any(len(s["decode_batch"]) >= 2 for s in slots)  # a shorter stream's last step
    assert wait_idle(url) == []


def test_a_stream_that_hangs_up_inside_a_batch_leaves_it(url):
    isolated = stream_text(url, PROMPTS[1], LENGTHS[3])
    body = {"model": GREEDY, "messages": [{"role": "user", "content": "Count forever"}],
            "max_tokens": 3000, "temperature": 0, "stream": True}
    result: dict[str, str] = {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        while sum('"content"' in next(lines) for _ in range(2)) == 0:
            pass
        other = threading.Thread(target=lambda: result.setdefault(
            "text", stream_text(url, PROMPTS[1], LENGTHS[3])))
        other.start()
        for _ in range(40):  # keep reading while the newcomer joins the long stream's steps
            next(lines)
    other.join(timeout=120)
    assert result["text"] == isolated
    assert wait_idle(url) == []
