"""Re-placement driven by routing counts: the scheduler's policy moves hot experts onto the
device when the counts say it pays, keeps the tokens, and leaves uniform counts alone (on NumPy
both memories are RAM, so this is the GPU's placement logic)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_dummy import half_budget_gib, logits_of, small_packed, write_config
from test_jobs_support import Recorder, StepClock

from ds4.engine import Engine
from ds4.jobs.events import JobRequest, SamplingOptions
from ds4.jobs.placement_policy import ReplacementPolicy
from ds4.jobs.scheduler import Scheduler, SchedulerConfig
from ds4.jobs.stats import SchedulerStats
from ds4.model.placement import ReplacementRule


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("policy") / "m", small_packed())


def placed(model: Path) -> Engine:
    return Engine.open(model, backend="numpy", load_format="dummy", seed=3,
                       gpu_memory_gib=half_budget_gib(small_packed()))


def set_counts(engine: Engine, counts: np.ndarray) -> None:
    """Picks as decode steps would have counted them."""
    for bank, row in zip(engine.model.weights.experts, counts):
        bank.counts[...] = row


def due(policy: ReplacementPolicy) -> SchedulerStats:
    """Stats of a scheduler that generated enough tokens for the policy to look."""
    return SchedulerStats(generated_tokens=policy.seen + policy.every_tokens)


def test_skewed_counts_move_the_hot_experts_onto_the_device(model: Path) -> None:
    engine = placed(model)
    placement = engine.model.weights.placement
    before = placement.resident().copy()
    L, E = before.shape
    counts = np.ones((L, E), dtype=np.int64)
    hot = np.nonzero(~before[0])[0][:3]  # three host experts of every layer get the picks
    counts[:, hot] = 50
    set_counts(engine, counts)
    policy = ReplacementPolicy(engine, every_tokens=8)
    stats = due(policy)
    assert policy.after_turn(stats) == 2 * 3 * L
    resident = placement.resident()
    assert resident[:, hot].all() and (resident.sum(axis=1) == before.sum(axis=1)).all()
    assert stats.expert_replacements == 1 and stats.experts_moved == 2 * 3 * L
    assert stats.expert_host_read_share < 0.1  # the hot ones read the device now
    assert (placement.pending() == 0).all()  # the counters restart for the next window


def test_one_look_moves_at_most_max_swaps_the_largest_gains_first(model: Path) -> None:
    """A bounded pause: with max_swaps 2 only the two hottest host experts move this look
    (the others at the next one)."""
    engine = placed(model)
    placement = engine.model.weights.placement
    before = placement.resident().copy()
    L, E = before.shape
    counts = np.zeros((L, E), dtype=np.int64)
    host0 = np.nonzero(~before[0])[0]
    counts[0, host0[:3]] = [30, 90, 60]  # layer 0: three hot host experts
    counts[1, np.nonzero(~before[1])[0][0]] = 10
    set_counts(engine, counts)
    policy = ReplacementPolicy(engine, every_tokens=8, rule=ReplacementRule(max_swaps=2))
    assert policy.after_turn(due(policy)) == 4
    now = placement.resident()
    assert now[0, host0[1]] and now[0, host0[2]] and not now[0, host0[0]]
    assert (now[1:] == before[1:]).all()
    assert policy.after_turn(due(policy)) == 4  # the next look: layer 0's third, layer 1's one
    assert placement.resident()[0, host0[:3]].all()


def test_uniform_counts_never_re_place(model: Path) -> None:
    engine = placed(model)
    placement = engine.model.weights.placement
    before = placement.resident().copy()
    set_counts(engine, np.full(before.shape, 7))
    policy = ReplacementPolicy(engine, every_tokens=8, rule=ReplacementRule())  # any gain
    stats = due(policy)
    assert policy.after_turn(stats) == 0
    assert (placement.resident() == before).all() and stats.expert_replacements == 0
    assert stats.expert_host_read_share == pytest.approx((~before).sum() / before.size)


def test_the_spread_of_uniform_routing_moves_nothing(model: Path) -> None:
    """Routing drawn uniformly (2 of 8 experts per token, 256 tokens): the counts differ by
    chance only, and the default policy keeps the placement."""
    engine = placed(model)
    placement = engine.model.weights.placement
    before = placement.resident().copy()
    rng = np.random.default_rng(0)
    L, E = before.shape
    picks = np.array([[rng.choice(E, 2, replace=False) for _ in range(256)] for _ in range(L)])
    set_counts(engine, np.stack([np.bincount(p.ravel(), minlength=E) for p in picks]))
    policy = ReplacementPolicy(engine, every_tokens=256)
    assert policy.after_turn(due(policy)) == 0
    assert (placement.resident() == before).all()


def test_a_small_gain_stays_under_the_threshold(model: Path) -> None:
    engine = placed(model)
    resident = engine.model.weights.placement.resident()
    counts = np.full(resident.shape, 10)
    counts[0, np.nonzero(~resident[0])[0][0]] = 14  # one host expert a bit hotter
    set_counts(engine, counts)
    policy = ReplacementPolicy(engine, every_tokens=8,
                               rule=ReplacementRule(min_cut=0.2, margin=0.25))
    assert policy.after_turn(due(policy)) == 0


def test_old_counts_decay_so_the_placement_follows_the_workload(model: Path) -> None:
    engine = placed(model)
    placement = engine.model.weights.placement
    L, E = placement.resident().shape
    first = np.zeros((L, E), dtype=np.int64)
    first[:, E - 1] = 100
    set_counts(engine, first)
    policy = ReplacementPolicy(engine, every_tokens=8, half_life_tokens=2)
    policy.after_turn(due(policy))
    assert placement.resident()[:, E - 1].all()
    later = np.zeros((L, E), dtype=np.int64)
    later[:, E - 2] = 20  # a new workload: after 8 tokens at half-life 2 the old 100 is 6.25
    set_counts(engine, later)
    policy.after_turn(due(policy))
    assert placement.resident()[:, E - 2].all()
    assert placement.heat[0, E - 1] == pytest.approx(100 / 16)


def test_the_scheduler_re_places_while_serving_and_the_tokens_stay(model: Path) -> None:
    """A greedy job through the scheduler with the policy looking every 8 tokens: experts move
    to follow its routing, fewer of its picks read the host than under the start-up placement,
    and its tokens are the all-resident engine's."""
    def serve(engine: Engine) -> tuple[Scheduler, list[int]]:
        sched = Scheduler(engine, SchedulerConfig(parallel=1, ctx_size=256),
                          clock=StepClock(0.001))
        sched.replacement.every_tokens = 8
        sched.replacement.rule = ReplacementRule()
        rec = Recorder()
        sched.submit(JobRequest(prompt_tokens=[0, 3, 9, 27, 81], max_tokens=48,
                                sampling=SamplingOptions(temperature=0.0)), rec)
        while sched.run_turn():
            pass
        return sched, rec.tokens()

    engine = placed(model)
    start = engine.model.weights.placement.resident().copy()
    sched, tokens = serve(engine)
    whole = Engine.open(model, backend="numpy", load_format="dummy", seed=3)
    assert not ReplacementPolicy(whole).enabled  # nothing in host memory: nothing to move
    assert tokens == serve(whole)[1] and len(tokens) == 48
    placement = engine.model.weights.placement
    assert sched.stats.expert_replacements >= 1
    heat = placement.counts()
    assert heat[~placement.resident()].sum() < heat[~start].sum()


def test_replacement_keeps_the_logits(model: Path) -> None:
    engine = placed(model)
    before = logits_of(engine, steps=list(range(30, 50)))
    assert engine.replace_experts() > 0
    np.testing.assert_array_equal(logits_of(engine, steps=list(range(30, 50))), before)


def test_metrics_expose_the_re_placements_and_the_host_read_share() -> None:
    from ds4.server.metrics import Metrics

    stats = SchedulerStats(expert_replacements=2, experts_moved=12, expert_host_read_share=0.25)
    text = Metrics(lambda: 0, lambda: 0, lambda: stats).exposition().decode()
    assert "ds4_expert_replacements_total 2.0" in text
    assert "ds4_experts_moved_total 12.0" in text
    assert "ds4_expert_host_read_share 0.25" in text


def test_the_cut_is_the_share_of_host_reads_a_plan_moves_onto_the_device(model: Path) -> None:
    engine = placed(model)
    placement = engine.model.weights.placement
    resident = placement.resident()
    counts = np.full(resident.shape, 10)
    hot = np.nonzero(~resident[0])[0][0]
    counts[0, hot] = 50  # one host expert of layer 0 far hotter than every resident one
    set_counts(engine, counts)
    placement.observe()
    plan = placement.plan(ReplacementRule(margin=0.25))
    assert [len(swaps) for swaps in plan] == [1] + [0] * (len(plan) - 1)
    going, coming = plan[0][0]
    assert coming == hot and resident[0, going]
    host = 10 * (~resident).sum() + 40  # the host experts' heat before the swap
    assert placement.cut(plan) == pytest.approx(40 / host)  # 50 comes on, a 10 goes off
