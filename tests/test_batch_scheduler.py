"""Lock-step decode turns of the scheduler: every decoding job advances in one engine step.

On the tiny model with scheduler doubles of nothing but the clock; each job's tokens are
compared with the same request run alone on a one-slot scheduler (where no batch forms).
"""

from __future__ import annotations

from collections import Counter

import pytest
from test_jobs_scheduler import PROMPTS, alone, assert_all_idle, drain, prompt, request, scheduler
from test_jobs_support import Recorder, StepClock, tiny_engine

from ds4.jobs.events import Progress, SamplingOptions, Started, TokenEvents
from ds4.jobs.job import Job


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def watched(sched) -> list[int]:
    """The size of every engine decode step the scheduler runs from now on."""
    sizes: list[int] = []
    sched.lockstep.observers.append(sizes.append)
    return sizes


@pytest.fixture
def decode_rounds(monkeypatch) -> Counter:
    """How many decode_round transitions each job fired (the condition runs once per fire)."""
    fired: Counter = Counter()
    over = Job.decode_over

    def counting(self, event=None):
        fired[self.seq] += 1
        return over(self, event)
    monkeypatch.setattr(Job, "decode_over", counting)
    return fired


@pytest.mark.parametrize("parallel", [2, 3, 4])
def test_decoding_jobs_share_each_engine_step_and_keep_their_tokens(engine, parallel,
                                                                    decode_rounds):
    reqs = [request(prompt(engine, t), max_tokens=8) for t in PROMPTS[:parallel]]
    expected = [alone(engine, r) for r in reqs]
    decode_rounds.clear()
    sched = scheduler(engine, parallel=parallel, decode_tokens=4)
    sizes = watched(sched)
    recs = [Recorder() for _ in reqs]
    jobs = [sched.submit(r, rec) for r, rec in zip(reqs, recs)]
    drain(sched)
    assert [rec.tokens() for rec in recs] == expected
    assert sizes.count(parallel) >= 4  # the burst after the last prefill ran as one step each
    assert sum(sizes) == 8 * parallel  # every token evaluated exactly once
    assert all(decode_rounds[j.seq] == 2 for j in jobs)  # 8 tokens = two bursts of 4 per job
    assert_all_idle(sched)


def test_jobs_join_and_leave_the_batch_mid_way(engine):
    long_a, short_b, late_c = (request(prompt(engine, PROMPTS[0]), max_tokens=24),
                               request(prompt(engine, PROMPTS[1]), max_tokens=5),
                               request(prompt(engine, PROMPTS[2]), max_tokens=10))
    expected = [alone(engine, r) for r in (long_a, short_b, late_c)]
    sched = scheduler(engine, parallel=3, decode_tokens=2)
    sizes = watched(sched)
    a, b, c = Recorder(), Recorder(), Recorder()
    sched.submit(long_a, a)
    sched.submit(short_b, b)
    while len(a.tokens()) < 8:  # b has finished by now: a decodes alone
        sched.run_turn()
    assert b.finished().finish_reason == "length"
    joined_at = len(sizes)
    sched.submit(late_c, c)
    drain(sched)
    assert [a.tokens(), b.tokens(), c.tokens()] == expected
    assert 2 in sizes[:joined_at] and 1 in sizes[:joined_at]  # b left, then a went on alone
    assert 2 in sizes[joined_at:]  # c joined a's steps
    assert sizes[-1] == 1  # c outlived a's batch
    assert_all_idle(sched)


def test_a_cancel_inside_a_batch_ends_that_job_only(engine):
    reqs = [request(prompt(engine, t), max_tokens=16) for t in PROMPTS[:3]]
    expected = [alone(engine, r) for r in reqs]
    sched = scheduler(engine, parallel=3, decode_tokens=3)
    sizes = watched(sched)
    recs = [Recorder() for _ in reqs]
    jobs = [sched.submit(r, rec) for r, rec in zip(reqs, recs)]
    while len(recs[1].tokens()) < 4 or sizes[-1] != 3:
        sched.run_turn()
    sched.cancel(jobs[1])
    cancelled_at = len(sizes)
    drain(sched)
    assert recs[1].finished().finish_reason == "cancelled"
    assert recs[1].tokens() == expected[1][: len(recs[1].tokens())]
    assert len(recs[1].tokens()) < 16
    assert [recs[0].tokens(), recs[2].tokens()] == [expected[0], expected[2]]
    assert max(sizes[cancelled_at + 3:]) == 2  # it left the batch at the next step
    assert_all_idle(sched)


def test_jobs_with_different_sampling_settings_batch_together(engine):
    settings = [SamplingOptions(temperature=0.0),
                SamplingOptions(temperature=0.9, top_k=50, seed=7),
                SamplingOptions(temperature=1.2, top_p=0.8, seed=3),
                SamplingOptions(temperature=0.7, min_p=0.05, seed=11)]
    reqs = [request(prompt(engine, t), max_tokens=10) for t in PROMPTS]
    for r, s in zip(reqs, settings):
        r.sampling = s
    expected = [alone(engine, r) for r in reqs]
    sched = scheduler(engine, parallel=4, decode_tokens=5)
    sizes = watched(sched)
    recs = [Recorder() for _ in reqs]
    for r, rec in zip(reqs, recs):
        sched.submit(r, rec)
    drain(sched)
    assert [rec.tokens() for rec in recs] == expected
    assert 4 in sizes
    assert len({tuple(t) for t in expected}) == 4


def test_a_newcomer_prefills_between_batched_turns_in_slices(engine):
    clock = StepClock(1.0)  # every clock read is a second: slices end at the first chance
    sched = scheduler(engine, parallel=3, clock=clock, prefill_ms=1500, decode_tokens=2)
    sizes = watched(sched)
    log = []
    a, b, c = Recorder(), Recorder(), Recorder()
    for who, rec, text in (("a", a, PROMPTS[0]), ("b", b, PROMPTS[1])):
        sched.submit(request(prompt(engine, text), max_tokens=40),
                     lambda e, who=who, rec=rec: (log.append((who, e)), rec(e)))
    while len(a.tokens()) < 4 or len(b.tokens()) < 4:
        sched.run_turn()
    long_prompt = prompt(engine, " ".join(PROMPTS * 4))
    sched.submit(request(long_prompt, max_tokens=5), lambda e: (log.append(("c", e)), c(e)))
    before = len(sizes)
    while not c.tokens():
        sched.run_turn()
    started = next(i for i, (who, e) in enumerate(log) if who == "c" and isinstance(e, Started))
    first = next(i for i, (who, e) in enumerate(log) if who == "c" and isinstance(e, TokenEvents))
    during = log[started:first]
    slices = sum(isinstance(e, Progress) for who, e in during if who == "c")
    assert slices >= 3  # the prompt of ~4 chunks was sliced at chunk boundaries
    assert sizes[before:].count(2) >= 2 * (slices - 1)  # a and b decoded together in between
    drain(sched)
    assert c.tokens() == alone(engine, request(long_prompt, max_tokens=5))
    assert 3 in sizes  # once c decoded, all three shared steps
    assert_all_idle(sched)


def test_one_slot_decodes_one_session_per_step(engine):
    sched = scheduler(engine, parallel=1, decode_tokens=3)
    sizes = watched(sched)
    rec = Recorder()
    sched.submit(request(prompt(engine, PROMPTS[0]), max_tokens=7), rec)
    drain(sched)
    assert sizes == [1] * 7
    assert sched.slots_info()[0]["decode_batch"] == [0]


def test_a_failed_batched_step_fails_its_jobs_only(engine, monkeypatch):
    from ds4.jobs.events import Failed

    reqs = [request(prompt(engine, t), max_tokens=12) for t in PROMPTS[:2]]
    sched = scheduler(engine, parallel=3, decode_tokens=3)
    recs = [Recorder() for _ in reqs]
    for r, rec in zip(reqs, recs):
        sched.submit(r, rec)
    real = type(engine).decode_batch

    def failing(self, sessions, tokens):
        if len(sessions) > 1:
            raise RuntimeError("device lost")
        return real(self, sessions, tokens)
    monkeypatch.setattr(type(engine), "decode_batch", failing)
    drain(sched)
    monkeypatch.undo()
    errors = [rec.of(Failed) for rec in recs]
    assert all(e and e[0].status == 500 and "device lost" in e[0].message for e in errors)
    assert_all_idle(sched)
    later, rec = request(prompt(engine, PROMPTS[3]), max_tokens=4), Recorder()
    sched.submit(later, rec)
    drain(sched)
    assert rec.tokens() == alone(engine, later)


def test_an_engine_without_batched_decode_still_runs_in_lock_step():
    from test_jobs_support import ScriptedEngine

    engine = ScriptedEngine([[10, 11, 12, 13]])  # no decode_batch: sessions one after another
    sched = scheduler(engine, parallel=2, decode_tokens=2)
    sizes = watched(sched)
    recs = [Recorder(), Recorder()]
    for text, rec in zip(PROMPTS, recs):
        sched.submit(request(engine.tokenizer.encode(text), max_tokens=10), rec)
    drain(sched)
    assert [rec.tokens() for rec in recs] == [[10, 11, 12, 13]] * 2
    assert 2 in sizes
