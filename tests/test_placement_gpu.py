"""On the GPU: experts placed in pinned, device-mapped host memory give the all-resident
logits through the decode CUDA graph, before and after a re-placement; batched decode over them
reads each distinct expert once for the batch and equals single steps bitwise, counting the
picks of live members only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_dummy import PROMPT, half_budget_gib, small_packed, write_config

from ds4.backend import cuda_available
from ds4.engine import Engine
from ds4.model import gpu_moe

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]
STEPS = [11, 12, 13, 14, 15, 16, 17, 18]  # step 1 eager, step 2 captured, then replays


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("gpu_placed") / "m", small_packed())


def decode_logits(session, steps) -> np.ndarray:
    return np.stack([np.asarray(session.decode(t)) for t in steps])


def step_pairs(placed, resident, steps) -> tuple[np.ndarray, np.ndarray]:
    """(placed, resident) logits of each step taken from one state: the resident session's,
    restored into the placed one first. The two decode the placed experts through different
    kernels (placed.cu, the rows kernels), which round apart by ~1e-5; over a run of steps a
    router near-tie can turn that into another expert, so each step starts level."""
    got, want = [], []
    for t in steps:
        placed.restore(resident.snapshot())
        got.append(np.asarray(placed.decode(t)))
        want.append(np.asarray(resident.decode(t)))
    return np.stack(got), np.stack(want)


def engines(model: Path) -> tuple[Engine, Engine]:
    resident = Engine.open(model, backend="cupy", load_format="dummy", seed=5)
    placed = Engine.open(model, backend="cupy", load_format="dummy", seed=5,
                         gpu_memory_gib=half_budget_gib(small_packed()))
    return resident, placed


def test_half_the_experts_in_host_memory_give_the_resident_logits(model: Path) -> None:
    resident, placed = engines(model)
    assert placed.model.weights.placement is not None
    assert "host experts per layer: 4,4,4,4,4,4" in placed.memory_report()["expert_placement"]
    assert placed.model.kernel_decoder is not None  # the decode CUDA graph runs them
    import cupy  # the embedding went to mapped host memory first; prefill and graph read it there

    embed = placed.model.weights["model.embed_tokens.weight"]
    assert cupy.cuda.runtime.pointerGetAttributes(embed.data.ptr).type == 1  # host
    assert placed.memory_report()["host_tensor_bytes"] == embed.nbytes
    a, b = resident.new_session(256), placed.new_session(256)
    np.testing.assert_allclose(b.sync(PROMPT), a.sync(PROMPT), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(*step_pairs(b, a, STEPS), rtol=0, atol=5e-4)
    assert placed.model.weights.placement.counts().sum() == len(STEPS) * 2 * 6


def test_replacement_between_graph_replays_keeps_the_logits(model: Path) -> None:
    resident, placed = engines(model)
    a, b = resident.new_session(256), placed.new_session(256)
    a.sync(PROMPT), b.sync(PROMPT)
    decode_logits(a, STEPS), decode_logits(b, STEPS)
    assert placed.replace_experts() > 0
    more = [21, 22, 23, 24]  # the same session's captured graph, tables rewritten in place
    np.testing.assert_allclose(*step_pairs(b, a, more), rtol=1e-4, atol=1e-4)


def test_the_policy_re_places_from_graph_counted_picks_and_keeps_the_logits(model: Path) -> None:
    """The scheduler's policy on picks the decode graph counted (skewed by hand on top):
    the hot experts move to the device, the counters restart in place, and the same
    session's captured graph keeps giving the resident logits."""
    from ds4.jobs.placement_policy import ReplacementPolicy
    from ds4.jobs.stats import SchedulerStats

    resident, placed = engines(model)
    a, b = resident.new_session(256), placed.new_session(256)
    a.sync(PROMPT), b.sync(PROMPT)
    decode_logits(a, STEPS), decode_logits(b, STEPS)
    placement = placed.model.weights.placement
    start = placement.resident().copy()
    hot = np.nonzero(~start[0])[0][:2]
    for bank in placement.banks:
        bank.counts[hot.tolist()] += 100
    policy = ReplacementPolicy(placed, every_tokens=1)
    stats = SchedulerStats(generated_tokens=1)
    assert policy.after_turn(stats) > 0 and stats.expert_replacements == 1
    assert placement.resident()[:, hot].all() and (placement.pending() == 0).all()
    more = [21, 22, 23, 24]
    np.testing.assert_allclose(*step_pairs(b, a, more), rtol=1e-4, atol=1e-4)
    assert placement.pending().sum() == len(more) * 2 * 6  # the graph counts into them again


@pytest.mark.parametrize("through_rows", [False, True])
def test_a_placed_batch_equals_its_single_steps_bitwise_and_counts_live_picks(
        model: Path, monkeypatch, through_rows: bool) -> None:
    """Batches of 2, 3 (the B=4 graph, one idle member) and 5 (B=8, three idle) over half the
    experts in mapped host memory: each member's logits are bitwise its own single step's, and
    the placement counts exactly what the single steps count (idle members' picks count
    nowhere); after a re-placement rewrites the tables the captured graphs still agree. Both
    decode paths of placed experts: per member (the default) and rows_moe's tables."""
    monkeypatch.setattr(gpu_moe, "ROWS_READ_PLACED", through_rows)
    _, placed = engines(model)
    placement, k, layers = placed.model.weights.placement, 2, 6
    for n in (2, 3, 5):
        single, batched = ([placed.new_session(256) for _ in range(n)] for _ in range(2))
        for group in (single, batched):
            for i, s in enumerate(group):
                s.sync(PROMPT[:4 + i])
        for step in range(5):  # eager, captured, replays; a re-placement before the last two
            if step == 3:
                hot = int(np.nonzero(~placement.resident()[0])[0][0])  # beats unbumped ones
                for bank in placement.banks:
                    bank.counts[hot] += 1000
                assert placed.replace_experts() > 0 and placement.resident()[:, hot].all()
            toks = [20 + 3 * i + step for i in range(n)]
            placement.observe()
            alone = [s.decode(t) for s, t in zip(single, toks)]
            counted = placement.pending()
            placement.observe()
            together = placed.decode_batch(batched, toks)
            assert np.array_equal(placement.pending(), counted), (n, step)
            assert counted.sum() == n * k * layers
            for a, b in zip(alone, together):
                assert np.array_equal(np.asarray(a), np.asarray(b)), (n, step)
    graphs = placed.model.kernel_decoder.decoder.graphs
    assert {1, 2, 4, 8} <= set(graphs)


def test_host_reads_off_reads_other_experts_and_restores_the_tables(model: Path) -> None:
    """The benchmark's resident-time switch: while open, host experts' entries point at
    resident ones (other logits); on exit the tables are back and so are the logits."""
    _, placed = engines(model)

    def run() -> np.ndarray:
        s = placed.new_session(256)
        s.sync(PROMPT)
        return decode_logits(s, STEPS[:4])  # eager, captured, replays

    want = run()
    with placed.model.weights.placement.host_reads_off() as on:
        assert on
        other = run()
    np.testing.assert_allclose(run(), want, rtol=1e-5, atol=1e-5)
    assert np.abs(other[1:] - want[1:]).max() > 1e-3


@pytest.mark.parametrize("picks", [[0, 7], [7, 0], [6, 7], [1, 0]])
def test_the_placed_kernel_matches_its_numpy_twin(model: Path, picks: list[int]) -> None:
    """Picks with a host expert last, first, both on the host, both resident: the kernels walk
    host experts first (ds4/kernels/placed.cu) and give the twin's sum."""
    import cupy as cp

    from ds4.kernels import placed as kernels
    from ds4.model.config import ModelConfig
    from ds4.model.dummy import dummy_weights

    cfg = ModelConfig.from_dir(model)
    w = dummy_weights(cfg, cp, seed=1, budget=half_budget_gib(small_packed()) * 2**30)
    bank = w.experts[3]
    gate_up, down = bank.placed_stacks
    I, D, k = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts_per_tok
    rng = np.random.default_rng(0)
    assert k == 2 and gate_up.resident[[0, 1]].all() and not gate_up.resident[[6, 7]].any()
    idx = np.array(picks, dtype=np.int32)
    wts = rng.random(k).astype(np.float32)
    x = rng.standard_normal(D).astype(np.float32)
    y, act = cp.zeros(D, cp.float32), cp.zeros((k, I), cp.float32)
    kernels.moe_placed(gate_up, down, I, cp.asarray(idx), cp.asarray(wts), cp.asarray(x), act,
                       y, cfg.swiglu_limit)
    host = [s for s in (gate_up, down)]
    want = np.zeros(D, np.float32)
    twin_act = np.zeros((k, I), np.float32)
    kernels.moe_placed_numpy(_on_host(host[0]), _on_host(host[1]), I, idx, wts, x, twin_act,
                             want, cfg.swiglu_limit)
    np.testing.assert_allclose(cp.asnumpy(y), want, rtol=1e-4, atol=1e-5)


class _on_host:
    """A PlacedStack read back to NumPy expert by expert (for the twin)."""

    def __init__(self, stack):
        self.stack, self.resident = stack, stack.resident

    def __getitem__(self, e):
        from ds4.model.packed import PackedMatrix

        codes, scale = self.stack.memory_of(int(e))
        return PackedMatrix(self.stack.fmt, codes.get(), scale.get(), self.stack.shape[-1],
                            self.stack.block)


def test_prefill_of_staged_host_experts_is_bitwise_the_in_place_read(model: Path,
                                                                     monkeypatch) -> None:
    """Prefill copies a layer's host experts to the device before multiplying them
    (moe.stage_host): the logits equal those of the kernels reading mapped memory in place,
    bit for bit, and a device without room for the copy falls back to the in-place read. By
    default only a chunk of at least 4 picks an expert stages (8 experts, top-2: 16 tokens)."""
    import cupy

    from ds4.model import moe

    _, placed = engines(model)
    staged = []
    stage = moe.stage_host
    monkeypatch.setattr(moe, "stage_host", lambda *a: staged.append(stage(*a)) or staged[-1])
    for prompt, stages in ((PROMPT, False), (PROMPT + PROMPT[:6], True)):
        staged.clear()
        placed.new_session(256).sync(prompt)
        assert len(staged) == (6 if stages else 0)  # one a layer
    monkeypatch.setattr(moe, "STAGE_PICKS", 0)  # the 10-token prompt stages too
    logits = {}
    for mode in ("staged", "in place", "no room"):
        monkeypatch.setattr(moe, "STAGE_HOST", mode != "in place")
        if mode == "no room":
            def no_room(*_):
                raise cupy.cuda.memory.OutOfMemoryError(1, 0)
            monkeypatch.setattr(moe, "_device_copy", no_room)
        staged.clear()
        logits[mode] = np.asarray(placed.new_session(256).sync(PROMPT))
        # one a layer, begun before its attention (moe.stage_ahead); without room for it
        # then, the MoE tries once more
        assert len(staged) == {"staged": 6, "in place": 0, "no room": 12}[mode]
        assert all((s is None) == (mode == "no room") for s in staged)
    np.testing.assert_array_equal(logits["staged"], logits["in place"])
    np.testing.assert_array_equal(logits["no room"], logits["in place"])
