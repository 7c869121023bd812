"""Scheduler behaviour users see: same tokens when interleaved, fair turns, slot choice, cancel."""

from __future__ import annotations

import pytest
from test_jobs_support import Recorder, StepClock, tiny_engine

from ds4.jobs.events import (
    JobRequest,
    Progress,
    Queued,
    SamplingOptions,
    Started,
    TokenEvents,
)
from ds4.jobs.scheduler import Scheduler, SchedulerConfig

GREEDY = SamplingOptions(temperature=0.0)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def prompt(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def request(tokens, max_tokens=12, **kw) -> JobRequest:
    return JobRequest(prompt_tokens=list(tokens), sampling=GREEDY, max_tokens=max_tokens, **kw)


def scheduler(engine, parallel=1, clock=None, **kw) -> Scheduler:
    cfg = SchedulerConfig(parallel=parallel, ctx_size=kw.pop("ctx_size", 512), **kw)
    return Scheduler(engine, cfg, clock=clock or StepClock(0.001))


def drain(sched, limit=5000) -> int:
    """Run turns until the scheduler is idle; returns the number of turns."""
    for n in range(limit):
        if not sched.run_turn():
            return n
    raise AssertionError("scheduler never went idle")


def assert_all_idle(sched):
    assert [s["busy"] for s in sched.slots_info()] == [False] * len(sched.slots)
    assert sched.stats.queue_depth == 0 and sched.stats.busy_slots == 0
    assert len(sched.pending) == 0


def alone(engine, req) -> list[int]:
    """Tokens of a request run by itself on a fresh one-slot scheduler."""
    sched = scheduler(engine)
    rec = Recorder()
    sched.submit(req, rec)
    drain(sched)
    return rec.tokens()


PROMPTS = ["The quick brown fox", "Once upon a time in a land far away",
           "def main():\n    return 42", "Les sanglots longs des violons"]


@pytest.mark.parametrize("parallel", [2, 3])
def test_interleaved_jobs_give_the_tokens_of_isolated_runs(engine, parallel):
    reqs = [request(prompt(engine, t), max_tokens=10) for t in PROMPTS[:parallel]]
    reqs[-1].sampling = SamplingOptions(temperature=0.9, top_k=50, seed=7)  # own rng per job
    expected = [alone(engine, r) for r in reqs]
    sched = scheduler(engine, parallel=parallel, decode_tokens=2)
    log = []
    recs = [Recorder() for _ in reqs]
    for i, (r, rec) in enumerate(zip(reqs, recs)):
        sched.submit(r, lambda e, i=i, rec=rec: (log.append((i, type(e).__name__)), rec(e)))
    drain(sched)
    assert [rec.tokens() for rec in recs] == expected
    assert all(len(t) == 10 for t in expected)
    assert len(sched.stats.ttft) == parallel  # one TTFT and nine gaps per job
    assert len(sched.stats.inter_token) == 9 * parallel
    # really interleaved: the last job streamed before the first one finished
    first_done = log.index((0, "Finished"))
    assert (parallel - 1, "TokenEvents") in log[:first_done]
    assert_all_idle(sched)


def test_newcomer_streams_long_before_a_long_generation_ends(engine):
    clock = StepClock(1.0)  # every clock read is a second: slices end at the first chance
    sched = scheduler(engine, parallel=2, clock=clock, prefill_ms=1500, decode_tokens=4)
    log = []
    a, b = Recorder(), Recorder()
    sched.submit(request(prompt(engine, PROMPTS[0]), max_tokens=300),
                 lambda e: (log.append(("a", e)), a(e)))
    while len(a.tokens()) < 8:
        sched.run_turn()
    long_prompt = prompt(engine, " ".join(PROMPTS * 4))
    sched.submit(request(long_prompt, max_tokens=5), lambda e: (log.append(("b", e)), b(e)))
    turns = 0
    while not b.tokens():
        sched.run_turn()
        turns += 1
    assert len(a.tokens()) < 60, "the newcomer waited for most of the long generation"
    started = next(i for i, (who, e) in enumerate(log) if who == "b" and isinstance(e, Started))
    first = next(i for i, (who, e) in enumerate(log) if who == "b" and isinstance(e, TokenEvents))
    during = log[started:first]
    assert sum(isinstance(e, Progress) for who, e in during if who == "b") >= 2  # sliced
    assert any(who == "a" and isinstance(e, TokenEvents) for who, e in during)
    drain(sched)
    assert len(a.tokens()) == 300 and a.finished().finish_reason == "length"
    assert b.tokens() == alone(engine, request(long_prompt, max_tokens=5))
    assert_all_idle(sched)


def test_no_preemption_when_nobody_waits(engine):
    sched = scheduler(engine, parallel=2, clock=StepClock(10.0), prefill_ms=1)
    rec = Recorder()
    long_prompt = prompt(engine, " ".join(PROMPTS * 4))
    sched.submit(request(long_prompt, max_tokens=3), rec)
    drain(sched)
    assert rec.of(Progress) == [Progress(len(long_prompt), len(long_prompt))]
    assert len(rec.tokens()) == 3


def test_one_slot_runs_the_phases_in_sequential_order(engine):
    sched = scheduler(engine, decode_tokens=3)
    rec = Recorder()
    job = sched.submit(request(prompt(engine, PROMPTS[1]), max_tokens=7), rec)
    fired = []
    while not job.is_terminal:
        before = job.state
        sched.run_turn()
        fired.append((before, job.state))
    assert fired == [("queued", "prefilling"), ("prefilling", "prefilled"),
                     ("prefilled", "decoding"), ("decoding", "decoding"),
                     ("decoding", "decoding"), ("decoding", "decoded"), ("decoded", "done")]
    kinds = [type(e).__name__ for e in rec.events]
    assert kinds == ["Queued", "Started", "Progress"] + ["TokenEvents"] * 7 + ["Finished"]


def test_three_jobs_on_two_slots_wait_in_fifo_order(engine):
    sched = scheduler(engine, parallel=2)
    log = []
    recs = [Recorder() for _ in range(4)]
    for i, rec in enumerate(recs):
        sched.submit(request(prompt(engine, PROMPTS[i]), max_tokens=6),
                     lambda e, i=i, rec=rec: (log.append((i, e)), rec(e)))
    assert [r.of(Queued)[0].position for r in recs] == [0, 1, 2, 3]
    drain(sched)
    starts = [i for i, e in log if isinstance(e, Started)]
    assert starts == [0, 1, 2, 3]
    first_end = min(log.index((i, recs[i].final())) for i in (0, 1))
    assert log.index((2, recs[2].of(Started)[0])) > first_end  # the third waited for a slot
    assert all(len(r.tokens()) == 6 for r in recs)
    assert_all_idle(sched)


def test_follow_up_lands_on_the_slot_holding_its_prefix(engine):
    sched = scheduler(engine, parallel=2)
    other, first = Recorder(), Recorder()
    sched.submit(request(prompt(engine, PROMPTS[2])), other)
    drain(sched)
    p1 = prompt(engine, PROMPTS[0])
    sched.submit(request(p1), first)
    drain(sched)
    slot = first.of(Started)[0].slot
    assert slot != other.of(Started)[0].slot  # least recently used went first
    follow = p1 + first.tokens() + prompt(engine, " and then")
    computed = sched.stats.prompt_tokens_computed
    rec = Recorder()
    sched.submit(request(follow), rec)
    drain(sched)
    started = rec.of(Started)[0]
    assert started.slot == slot  # not the least recently used one
    assert started.cached_tokens == len(p1) + len(first.tokens())
    assert sched.stats.prompt_tokens_computed - computed == len(follow) - started.cached_tokens
    assert rec.tokens() == alone(engine, request(follow))


def test_call_id_routing_wins_over_prefix_length(engine):
    sched = scheduler(engine, parallel=2)
    base = prompt(engine, PROMPTS[1])
    warm = Recorder()
    sched.submit(request(base, max_tokens=4), warm)
    drain(sched)
    prefix_slot = warm.of(Started)[0].slot
    bound = sched.slots[1 - prefix_slot]
    bound.bind_call_ids(["call_abc"])
    assert sched.live_call_ids() == {"call_abc"}
    rec = Recorder()
    sched.submit(request(base + warm.tokens() + base, call_ids=["call_abc"]), rec)
    drain(sched)
    assert rec.of(Started)[0] == Started(bound.index, 2 * len(base) + 4, 0)
    assert sched.live_call_ids() == set()  # the continuation moved that timeline on
    assert_all_idle(sched)


def test_a_bound_slot_is_kept_for_its_continuation(engine):
    sched = scheduler(engine, parallel=2)
    sched.slots[0].bind_call_ids(["call_x"])
    other = Recorder()
    sched.submit(request(prompt(engine, PROMPTS[0]), max_tokens=2), other)
    sched.run_turn()
    assert other.of(Started)[0].slot == 1  # the unrelated job left the bound slot alone
    waiting = sched.submit(request(prompt(engine, PROMPTS[2]), call_ids=["call_x"]), Recorder())
    sched.slots[0].job = other  # pretend the bound slot is busy
    assert sched.picker.pick(waiting, sched.slots) is None  # waits rather than take another
    sched.slots[0].job = None
    assert sched.picker.pick(waiting, sched.slots) is sched.slots[0]
