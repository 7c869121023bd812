"""Cancellation, failures, shutdown, the background thread, traces and configuration."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from test_jobs_support import Recorder, StepClock, tiny_engine

from ds4.jobs.events import (
    Failed,
    JobRequest,
    Progress,
    SamplingOptions,
    Started,
)
from ds4.jobs.scheduler import Scheduler, SchedulerConfig, refuse_ssd_streaming_on_gpu
from ds4.jobs.trace import read_trace

GREEDY = SamplingOptions(temperature=0.0)
TEXT = "Once upon a time in a land far away, " * 6


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def request(engine, text=TEXT, max_tokens=8, **kw) -> JobRequest:
    return JobRequest(prompt_tokens=engine.tokenizer.encode(text), sampling=GREEDY,
                      max_tokens=max_tokens, **kw)


def scheduler(engine, parallel=1, **kw) -> Scheduler:
    clock = kw.pop("clock", StepClock(0.001))
    cfg = SchedulerConfig(parallel=parallel, ctx_size=kw.pop("ctx_size", 512), **kw)
    return Scheduler(engine, cfg, clock=clock)


def drain(sched, limit=5000):
    for _ in range(limit):
        if not sched.run_turn():
            return
    raise AssertionError("scheduler never went idle")


def assert_all_idle(sched):
    assert not any(s["busy"] for s in sched.slots_info())
    assert sched.stats.queue_depth == 0 and sched.stats.busy_slots == 0


def test_cancel_while_queued_never_touches_a_slot(engine):
    sched = scheduler(engine)
    running, queued = Recorder(), Recorder()
    sched.submit(request(engine), running)
    job = sched.submit(request(engine, "Another prompt"), queued)
    sched.run_turn()
    sched.cancel(job)
    drain(sched)
    assert queued.finished().finish_reason == "cancelled"
    assert not queued.of(Started) and not queued.tokens()
    assert running.finished().finish_reason == "length" and len(running.tokens()) == 8
    assert sched.stats.jobs_cancelled == 1
    assert_all_idle(sched)


def test_cancel_while_prefilling_keeps_only_evaluated_chunks(engine):
    clock = StepClock(0.001)
    sched = scheduler(engine, clock=lambda: (armed and sched.cancel(job), clock())[1])
    rec = Recorder()
    req = request(engine)
    armed = False
    job = sched.submit(req, rec)
    sched.run_turn()  # begin
    armed = True  # the cancel arrives while the prefill slice runs
    drain(sched)
    end = rec.finished()
    assert end.finish_reason == "cancelled" and end.usage.completion_tokens == 0
    held = sched.slots[0].session.tokens
    assert 0 < len(held) < len(req.prompt_tokens)  # stopped at a chunk boundary
    assert held == req.prompt_tokens[: len(held)]
    assert rec.of(Progress)[-1].done_tokens == len(held)
    assert_all_idle(sched)


def test_cancel_while_decoding_stops_at_the_next_token(engine):
    sched = scheduler(engine, decode_tokens=6)
    rec = Recorder()
    req = request(engine, max_tokens=50)
    holder = {}

    def sink(event):
        rec(event)
        if len(rec.tokens()) == 3 and "job" in holder:
            sched.cancel(holder["job"])

    holder["job"] = sched.submit(req, sink)
    drain(sched)
    end = rec.finished()
    assert end.finish_reason == "cancelled"
    assert len(rec.tokens()) == 3 and end.usage.completion_tokens == 3
    assert sched.slots[0].session.tokens == req.prompt_tokens + rec.tokens()
    assert_all_idle(sched)


def test_context_overflow_fails_with_400_and_the_slot_serves_the_next_job(engine):
    sched = scheduler(engine, ctx_size=16)
    bad, good = Recorder(), Recorder()
    sched.submit(request(engine), bad)
    sched.submit(request(engine, "Short one", max_tokens=4), good)
    drain(sched)
    failed = bad.final()
    assert isinstance(failed, Failed) and failed.status == 400
    assert failed.kind == "context_overflow"
    assert len(good.tokens()) == 4 and good.finished().finish_reason == "length"
    assert sched.stats.jobs_failed == 1 and sched.stats.jobs_finished == 1
    assert_all_idle(sched)


def test_generation_stops_with_length_when_the_context_is_full(engine):
    sched = scheduler(engine, ctx_size=40)
    rec = Recorder()
    req = request(engine, "Short one", max_tokens=1000)
    sched.submit(req, rec)
    drain(sched)
    assert rec.finished().finish_reason == "length"
    assert len(rec.tokens()) == 40 - len(req.prompt_tokens)


def test_a_job_that_raises_ends_failed_and_leaves_its_slot_usable(engine):
    sched = scheduler(engine)
    bad = Recorder()
    sched.submit(JobRequest(prompt_tokens=[5, 10**9, 7], sampling=GREEDY), bad)  # no such id
    drain(sched)
    failed = bad.final()
    assert isinstance(failed, Failed) and failed.status == 500
    assert failed.kind == "server_error" and "1000000000" in failed.message
    rec = Recorder()
    req = request(engine, max_tokens=3)
    sched.submit(req, rec)
    drain(sched)
    assert rec.of(Started)[0].cached_tokens == 0  # nothing of the failed prompt is trusted
    assert len(rec.tokens()) == 3
    assert sched.slots[0].session.tokens == req.prompt_tokens + rec.tokens()
    assert_all_idle(sched)


def test_a_sink_that_raises_fails_only_its_own_job(engine):
    sched = scheduler(engine)
    seen = []

    def broken(event):
        seen.append(event)
        if len(seen) == 2:  # Queued, then Started
            raise RuntimeError("sink broke")

    sched.submit(request(engine), broken)
    rec = Recorder()
    sched.submit(request(engine, max_tokens=3), rec)
    drain(sched)
    assert isinstance(seen[-1], Failed) and "sink broke" in seen[-1].message
    assert len(rec.tokens()) == 3
    assert_all_idle(sched)


def test_trace_has_one_whole_line_per_job(engine, tmp_path):
    path = tmp_path / "trace.jsonl"
    sched = scheduler(engine, parallel=2, trace_path=str(path), decode_tokens=1)
    recs = [Recorder() for _ in range(3)]
    for i, rec in enumerate(recs):
        sched.submit(request(engine, f"prompt number {i}", max_tokens=5,
                             endpoint="/v1/completions"), rec)
    drain(sched)
    sched.stop()
    records = read_trace(path)
    assert sorted(r["seq"] for r in records) == [1, 2, 3]
    for r in records:
        rec = recs[r["seq"] - 1]
        assert r["generated_tokens"] == rec.tokens()
        assert r["finish_reason"] == "length" and r["endpoint"] == "/v1/completions"
        assert r["slot"] == rec.of(Started)[0].slot
        assert len(r["token_times_s"]) == 5 and r["first_token_s"] == r["token_times_s"][0]
        assert r["sampling"]["temperature"] == 0.0


def test_background_thread_runs_jobs_and_stop_ends_the_rest(engine):
    sched = Scheduler(engine, SchedulerConfig(parallel=2, ctx_size=512))
    sched.start()
    recs = [Recorder() for _ in range(2)]
    for i, rec in enumerate(recs):
        sched.submit(request(engine, f"thread job {i}", max_tokens=4), rec)
    for rec in recs:
        assert rec.ended.wait(60)
    sched.stop()
    assert all(len(r.tokens()) == 4 for r in recs)
    late = Recorder()
    sched.submit(request(engine), late)
    assert isinstance(late.final(), Failed) and late.final().status == 503
    assert_all_idle(sched)


def test_jobs_from_many_threads_all_end_once_and_leak_nothing(engine):
    sched = Scheduler(engine, SchedulerConfig(parallel=2, ctx_size=512, decode_tokens=2))
    sched.start()
    recs = [Recorder() for _ in range(8)]

    def client(i):
        doomed = i % 3 == 0  # long enough that the cancel always comes first
        job = sched.submit(request(engine, f"client {i} says hello",
                                   max_tokens=400 if doomed else 6), recs[i])
        if doomed:
            sched.cancel(job)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rec in recs:
        assert rec.ended.wait(60)
    sched.stop()
    for i, rec in enumerate(recs):
        end = rec.finished()  # exactly one final event each
        assert end.finish_reason == ("cancelled" if i % 3 == 0 else "length")
        assert len(rec.tokens()) == end.usage.completion_tokens
    assert sched.stats.jobs_finished + sched.stats.jobs_cancelled == 8
    assert_all_idle(sched)


def test_stop_ends_running_and_queued_jobs_with_503(engine):
    sched = scheduler(engine)
    running, queued = Recorder(), Recorder()
    sched.submit(request(engine, max_tokens=100), running)
    sched.submit(request(engine), queued)
    for _ in range(4):
        sched.run_turn()
    sched.stop()
    assert running.tokens() and running.final() == Failed("shutdown requested", 503)
    assert queued.final() == Failed("server shutting down", 503)
    assert_all_idle(sched)


def test_config_reads_the_two_timeslices_from_the_environment():
    env = {"DS4_SERVER_SCHED_PREFILL_MS": "250", "DS4_SERVER_SCHED_DECODE_TOKENS": "3"}
    cfg = SchedulerConfig.from_env(env, parallel=2)
    assert (cfg.prefill_ms, cfg.decode_tokens, cfg.parallel) == (250.0, 3, 2)
    assert SchedulerConfig.from_env({}).decode_tokens == 6
    assert SchedulerConfig.from_env(env, decode_tokens=9).decode_tokens == 9


def test_ssd_streaming_refuses_parallel_slots():
    with pytest.raises(ValueError, match="--ssd-streaming"):
        SchedulerConfig(parallel=2, ssd_streaming=True)
    assert SchedulerConfig(parallel=1, ssd_streaming=True).ssd_streaming


def test_ssd_streaming_is_refused_on_the_gpu_backend():
    gpu = SimpleNamespace(backend=SimpleNamespace(name="cupy"))
    with pytest.raises(ValueError, match="CuPy"):
        refuse_ssd_streaming_on_gpu(gpu, SchedulerConfig(ssd_streaming=True))
    refuse_ssd_streaming_on_gpu(gpu, SchedulerConfig())  # without the flag: fine
