"""Disk KV checkpoints through the HTTP server: a prefix survives a restart and slot reuse, a
changed middle still finds the frontier before it, every protocol reports restored tokens, and
the output equals a cold run token for token (greedy, tiny model)."""

from __future__ import annotations

import threading

import httpx
import pytest
from test_server_support import GREEDY, live_server

from ds4.chat import render_completion

INTERVAL = 32
KV = {"kv_disk_interval": INTERVAL, "kv_disk_min_tokens": INTERVAL, "ctx": 2048,
      "prefill_chunk": 64}
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega").split()


def long_text(seed: int, words: int = 80) -> str:
    """A prompt of some hundred tokens, different for each seed."""
    return " ".join(f"{WORDS[(seed * 7 + i * 5) % len(WORDS)]}{(seed + i) % 10}"
                    for i in range(words))


def complete(url: str, prompt: str, max_tokens: int = 8) -> dict:
    body = {"model": GREEDY, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def tokens_of(runtime, prompt: str) -> list[int]:
    return runtime.engine.tokenizer.encode(render_completion(prompt))


def aligned_common(runtime, old: str, new: str) -> int:
    """The last aligned frontier of `old` that is also a prefix of `new`."""
    a, b = tokens_of(runtime, old), tokens_of(runtime, new)
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return common // INTERVAL * INTERVAL


def stored_common(runtime, old: str, new: str) -> int:
    """The longest checkpoint of a finished `old` prompt that `new` starts with: the whole of
    `old` when its tokens are a prefix of `new`'s, else its last aligned frontier before they
    part."""
    a, b = tokens_of(runtime, old), tokens_of(runtime, new)
    return len(a) if b[:len(a)] == a else aligned_common(runtime, old, new)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def slot_sources(url: str) -> list[str]:
    return [s["prefix_source"] for s in httpx.get(url + "/slots").json()["slots"]]


@pytest.fixture(scope="module")
def cold():
    """A server without a disk store: the reference outputs."""
    with live_server(parallel=1, ctx=2048, prefill_chunk=64) as (url, runtime):
        yield url, runtime


def test_restart_restores_the_prefix_and_matches_a_cold_run(tmp_path, cold):
    prompt = long_text(1)
    grown = prompt + " and then the story went on for a while"
    with live_server(kv_disk_dir=str(tmp_path), **KV) as (url, _):
        first = complete(url, prompt)
        assert cached(first) == 0
    with live_server(kv_disk_dir=str(tmp_path), **KV) as (url, runtime):
        expect = stored_common(runtime, prompt, grown)
        assert expect >= 3 * INTERVAL
        reply = complete(url, grown)
        assert cached(reply) == expect
        assert slot_sources(url) == ["disk"]
        assert metric(url, "ds4_kv_disk_hits_total") == 1
        assert metric(url, "ds4_kv_disk_restored_tokens_total") == expect
        assert metric(url, "ds4_kv_disk_bytes") > 0
    reference = complete(cold[0], grown)
    assert cached(reference) == 0
    assert reply["choices"][0]["text"] == reference["choices"][0]["text"]
    assert reply["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"] == 8


def test_a_changed_middle_restores_the_last_frontier_before_it(tmp_path, cold):
    head, tail = long_text(2, 60), long_text(3, 60)
    old, new = f"{head} the old block {tail}", f"{head} a rewritten block {tail}"
    with live_server(kv_disk_dir=str(tmp_path), **KV) as (url, runtime):
        complete(url, old, max_tokens=1)
        complete(url, long_text(4), max_tokens=1)  # the one slot moves to another prompt
        expect = aligned_common(runtime, old, new)
        assert 0 < expect < len(tokens_of(runtime, new)) - INTERVAL
        reply = complete(url, new)
        assert cached(reply) == expect
        assert slot_sources(url) == ["disk"]
    assert reply["choices"][0]["text"] == complete(cold[0], new)["choices"][0]["text"]


def test_two_conversations_alternating_on_one_slot_both_hit(tmp_path, cold):
    convs = [long_text(5), long_text(6)]
    with live_server(kv_disk_dir=str(tmp_path), parallel=1, **KV) as (url, runtime):
        for text in convs:
            assert cached(complete(url, text, max_tokens=2)) == 0
        replies = []
        for text in convs:
            grown = text + " and one more question about it"
            replies.append((grown, complete(url, grown)))
            assert cached(replies[-1][1]) == stored_common(runtime, text, grown) > 0
            assert slot_sources(url) == ["disk"]
        assert metric(url, "ds4_kv_disk_hits_total") == 2
    for grown, reply in replies:
        assert reply["choices"][0]["text"] == complete(cold[0], grown)["choices"][0]["text"]


def test_three_conversations_on_two_slots_all_hit(tmp_path):
    convs = [long_text(7), long_text(8), long_text(9)]
    with live_server(kv_disk_dir=str(tmp_path), parallel=2, **KV) as (url, runtime):
        for text in convs:
            complete(url, text, max_tokens=1)
        for text in convs:  # each slot's session now holds some other conversation
            grown = text + " tell me more"
            expect = stored_common(runtime, text, grown)
            got = cached(complete(url, grown, max_tokens=1))
            assert got >= expect > 0


def test_interleaved_prefill_slices_checkpoint_and_restore_exactly(tmp_path, cold,
                                                                    monkeypatch):
    monkeypatch.setenv("DS4_SERVER_SCHED_PREFILL_MS", "1")  # preempt at every frontier
    convs = [long_text(13), long_text(14)]
    grown = [text + " and what happened next" for text in convs]
    with live_server(kv_disk_dir=str(tmp_path), parallel=2, **KV) as (url, _):
        threads = [threading.Thread(target=complete, args=(url, text, 2)) for text in convs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    with live_server(kv_disk_dir=str(tmp_path), parallel=2, **KV) as (url, runtime):
        replies = [complete(url, text) for text in grown]
        for text, more, reply in zip(convs, grown, replies):
            assert cached(reply) == stored_common(runtime, text, more) > 0
    for more, reply in zip(grown, replies):
        assert reply["choices"][0]["text"] == complete(cold[0], more)["choices"][0]["text"]


def test_every_protocol_reports_restored_tokens(tmp_path):
    text = long_text(10)
    more = text + " please go on"
    user = [{"role": "user", "content": more}]
    with live_server(kv_disk_dir=str(tmp_path), parallel=1, **KV) as (url, _):
        def after_another_prompt(path: str, body: dict) -> dict:
            complete(url, long_text(11), max_tokens=1)  # the slot moves on: disk must serve
            reply = httpx.post(url + path, timeout=120, json={
                "model": GREEDY, "temperature": 0, **body}).json()
            assert slot_sources(url) == ["disk"]
            return reply["usage"]

        httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": GREEDY, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": text}]})
        chat = after_another_prompt("/v1/chat/completions", {"max_tokens": 1, "messages": user})
        restored = chat["prompt_tokens_details"]["cached_tokens"]
        assert restored > 0 and restored % INTERVAL == 0
        claude = after_another_prompt("/v1/messages", {"max_tokens": 1, "messages": user})
        assert claude["cache_read_input_tokens"] >= restored
        assert claude["input_tokens"] + claude["cache_read_input_tokens"] == chat["prompt_tokens"]
        resp = after_another_prompt("/v1/responses", {"max_output_tokens": 16, "input": more})
        assert resp["input_tokens_details"]["cached_tokens"] >= restored
