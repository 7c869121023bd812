"""MTP speculation through the scheduler, HTTP, /metrics and the CLI: greedy streams equal a
plain server's, alone and interleaved; sampled ones decode normally; bursts count tokens."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import pytest
from test_jobs_support import Recorder, StepClock
from test_mtp import plain_greedy
from test_server_support import GREEDY, live_server

from ds4.engine import Engine, default_model_dir
from ds4.jobs.events import JobRequest, SamplingOptions, TokenEvents
from ds4.jobs.scheduler import Scheduler, SchedulerConfig
from ds4.jobs.speculative import DraftOracle

PROMPTS = ["Tell me a story about a fox.", "List three prime numbers and explain."]


def chat(url: str, prompt: str, max_tokens: int = 24, **extra) -> str:
    body = {"model": GREEDY, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def metric(url: str, name: str) -> float:
    lines = httpx.get(url + "/metrics").text.splitlines()
    return next(float(ln.split()[-1]) for ln in lines if ln.startswith(name + " "))


@pytest.fixture(scope="module")
def plain():
    with live_server(parallel=2, ctx=1024) as (url, _):
        yield url


@pytest.fixture(scope="module")
def mtp():
    with live_server(parallel=2, ctx=1024, mtp=True, mtp_draft=3) as (url, _):
        yield url


def test_greedy_chats_equal_a_plain_server(plain, mtp):
    before = metric(mtp, "ds4_mtp_draft_tokens_total")
    for p in PROMPTS:
        assert chat(mtp, p) == chat(plain, p)
    assert metric(mtp, "ds4_mtp_draft_tokens_total") > before


def test_two_interleaved_greedy_sessions_equal_a_plain_server(plain, mtp):
    expected = [chat(plain, p, 40) for p in PROMPTS]
    out: dict[int, str] = {}
    start = threading.Barrier(2)

    def client(i: int) -> None:
        start.wait()
        out[i] = chat(mtp, PROMPTS[i], 40)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [out[0], out[1]] == expected


def test_sampled_requests_decode_as_on_a_plain_server(plain, mtp):
    before = metric(mtp, "ds4_mtp_draft_tokens_total")
    sampled = {"temperature": 0.8, "seed": 7}
    assert chat(mtp, PROMPTS[0], **sampled) == chat(plain, PROMPTS[0], **sampled)
    assert metric(mtp, "ds4_mtp_draft_tokens_total") == before


def test_metrics_are_consistent(mtp):
    chat(mtp, PROMPTS[1])
    rounds = metric(mtp, "ds4_mtp_verify_rounds_total")
    drafted = metric(mtp, "ds4_mtp_draft_tokens_total")
    accepted = metric(mtp, "ds4_mtp_accepted_tokens_total")
    assert rounds > 0 and 0 <= accepted <= drafted <= 3 * rounds
    assert metric(mtp, "ds4_mtp_acceptance_rate") == pytest.approx(accepted / drafted)
    assert metric(mtp, "ds4_mtp_tokens_per_round") == pytest.approx((rounds + accepted) / rounds)


@pytest.fixture(scope="module")
def engine():
    return Engine.open(default_model_dir(), backend="numpy", prefill_chunk=16, mtp=True)


def test_forced_acceptance_bursts_count_emitted_tokens_and_speculators_decode_alone(engine):
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    refs = [plain_greedy(engine, p, 20) for p in ids]
    cfg = SchedulerConfig(parallel=2, ctx_size=512, decode_tokens=4, mtp_draft=3)
    sched = Scheduler(engine, cfg, clock=StepClock(0.001))
    sched.speculator.oracle = DraftOracle([p + r for p, r in zip(ids, refs)])
    steps: list[int] = []
    sched.lockstep.observers.append(steps.append)
    recs = [Recorder(), Recorder()]
    for p, rec in zip(ids, recs):
        sched.submit(JobRequest(prompt_tokens=p, sampling=SamplingOptions(temperature=0.0),
                                max_tokens=20), rec)
    per_turn, seen = [], 0
    while sched.run_turn():
        now = sum(len(r.of(TokenEvents)) for r in recs)
        per_turn.append(now - seen)
        seen = now
    assert [r.tokens() for r in recs] == refs
    assert max(per_turn) == 4  # a burst of 4 tokens, 1 + 3 accepted drafts
    st = sched.stats.speculation
    assert st.acceptance_rate == 1.0 and st.tokens_per_round == pytest.approx(4.0)
    assert set(steps) == {1}  # never batched


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds4", "generate", "--backend", "numpy",
                           "-p", "Hello there", "-n", "10", *args],
                          capture_output=True, text=True, timeout=300)


def test_generate_with_mtp_prints_the_same_text_and_a_summary():
    plain, mtp = run_cli(), run_cli("--mtp", "--mtp-draft", "2")
    assert plain.returncode == mtp.returncode == 0, mtp.stderr
    assert mtp.stdout == plain.stdout
    assert "mtp:" in mtp.stderr and "tokens per verify round" in mtp.stderr
    assert "mtp:" not in plain.stderr


@pytest.mark.parametrize("flag", [["--mtp-draft", "0"], ["--mtp-draft", "17"],
                                  ["--mtp-margin", "-1"]])
def test_bad_mtp_flags_exit_2(flag):
    r = run_cli("--mtp", *flag)
    assert r.returncode == 2 and "--mtp-" in r.stderr
