"""Expert placement under a device budget: the choice, its split, and re-placement by routing
counts (on NumPy both memories are RAM, so the same bookkeeping runs here)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_dummy import half_budget_gib, logits_of, small_packed, write_config

from ds4.engine import Engine, default_model_dir
from ds4.model.official_format import write_official
from ds4.model.placement import choose_resident, choose_within_layers
from ds4.model.weights import WeightsError


def test_the_chosen_set_fits_the_budget_and_prefers_hot_experts() -> None:
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 1000, (4, 32))
    sizes = np.array([100, 100, 200, 100])
    mask = choose_resident(3000, sizes, counts)
    assert (mask.sum(axis=1) * sizes).sum() <= 3000
    assert (mask.sum(axis=1) * sizes).sum() > 3000 - 200  # nothing left that would still fit
    assert counts[mask].min() >= counts[~mask].max()  # ranked by counts across layers


def test_hot_experts_win_over_cold_ones() -> None:
    counts = np.zeros((2, 8))
    counts[1, 7] = counts[0, 5] = 10
    mask = choose_resident(2, 1, counts)
    assert mask.sum() == 2 and mask[1, 7] and mask[0, 5]


def test_equal_counts_spread_the_host_experts_evenly() -> None:
    mask = choose_resident(10 * 8 - 12, 1, np.zeros((8, 10)))
    assert sorted((~mask).sum(axis=1).tolist()) == [1, 1, 1, 1, 2, 2, 2, 2]


def test_a_budget_too_small_for_anything_keeps_nothing_resident() -> None:
    assert not choose_resident(-5, 10, np.ones((2, 3))).any()


def test_replacement_keeps_each_layers_quota_and_takes_the_hottest() -> None:
    counts = np.array([[0, 5, 1, 9], [3, 3, 0, 7]])
    mask = choose_within_layers([2, 1], counts)
    assert mask.tolist() == [[False, True, False, True], [False, False, False, True]]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("placed") / "m", small_packed())


def test_a_placed_model_gives_the_all_resident_logits(small_model: Path) -> None:
    budget = half_budget_gib(small_packed())
    resident = Engine.open(small_model, backend="numpy", load_format="dummy", seed=2)
    placed = Engine.open(small_model, backend="numpy", load_format="dummy", seed=2,
                         gpu_memory_gib=budget)
    report = placed.memory_report()
    # the experts overflow, so the embedding went to host memory first (one row a token)
    embed = resident.model.weights["model.embed_tokens.weight"]
    assert report["host_tensor_bytes"] == embed.nbytes
    assert report["weight_bytes"] <= budget * 2**30  # (the device's share only)
    assert "host_tensor_bytes" not in resident.memory_report()
    experts = sum(bank.nbytes for bank in resident.model.weights.experts)
    assert report["host_expert_bytes"] == experts // 2
    assert "host experts per layer: 4,4,4,4,4,4" in report["expert_placement"]
    np.testing.assert_array_equal(logits_of(placed), logits_of(resident))


def test_replace_moves_the_hot_experts_on_and_keeps_the_logits(small_model: Path) -> None:
    placed = Engine.open(small_model, backend="numpy", load_format="dummy", seed=2,
                         gpu_memory_gib=half_budget_gib(small_packed()))
    before = logits_of(placed, steps=list(range(20, 60)))
    placement = placed.model.weights.placement
    counts = placement.counts()
    assert counts.sum() == 40 * 6 * 2  # every decode step's picks, per layer
    moved = placed.replace_experts()
    assert moved > 0
    resident = placement.resident()
    for layer, mask in zip(counts, resident):
        assert mask.sum() == 4
        assert layer[mask].min() >= layer[~mask].max()  # the hottest are on the device now
    np.testing.assert_array_equal(logits_of(placed, steps=list(range(20, 60))), before)
    assert placed.replace_experts() == 0  # counts have not changed which experts are hottest


def test_a_real_packed_checkpoint_places_its_experts_too(tmp_path: Path) -> None:
    packed = write_official(default_model_dir(), tmp_path / "official", block=(32, 32))
    whole = Engine.open(packed, backend="numpy")
    experts = sum(bank.nbytes for bank in whole.model.weights.experts)
    embed = whole.model.weights["model.embed_tokens.weight"].nbytes  # host-side once they spill
    budget = (whole.memory_report()["weight_bytes"] - embed - experts / 2) / 2**30
    placed = Engine.open(packed, backend="numpy", gpu_memory_gib=budget)
    assert placed.memory_report()["host_expert_bytes"] > 0
    assert placed.memory_report()["host_tensor_bytes"] == embed
    np.testing.assert_array_equal(logits_of(placed, prompt=[0, 100, 5000, 70000]),
                                  logits_of(whole, prompt=[0, 100, 5000, 70000]))


def test_the_placed_kernels_twin_computes_the_routed_experts(small_model: Path) -> None:
    """moe_placed_numpy over a PlacedStack (experts in both memories) is the routed-expert sum
    of the model's own MoE math."""
    from ds4.kernels.placed import moe_placed_numpy
    from ds4.model.moe import _routed_one

    placed = Engine.open(small_model, backend="numpy", load_format="dummy", seed=2,
                         gpu_memory_gib=half_budget_gib(small_packed()))
    cfg, bank = placed.config, placed.model.weights.experts[4]
    gate_up, down = bank.placed_stacks
    assert gate_up.resident[[0, 1]].all() and not gate_up.resident[[6, 7]].any()
    rng = np.random.default_rng(1)
    x = rng.standard_normal(cfg.hidden_size).astype(np.float32)
    idx, wts = np.array([1, 6]), np.array([0.7, 0.4], np.float32)
    y = np.empty(cfg.hidden_size, np.float32)
    act = np.empty((2, cfg.moe_intermediate_size), np.float32)
    moe_placed_numpy(gate_up, down, cfg.moe_intermediate_size, idx, wts, x, act, y,
                     cfg.swiglu_limit)
    np.testing.assert_allclose(y, _routed_one(np, cfg, bank, x, idx, wts), rtol=1e-5, atol=1e-6)


def test_the_kernels_walk_host_experts_first() -> None:
    from ds4.kernels.placed import host_first_order

    resident = np.array([True, True, False, True, False])
    assert host_first_order([0, 2, 3, 4], resident) == [1, 3, 0, 2]
    assert host_first_order([1, 0], resident) == [0, 1]  # all resident: as picked


def test_a_bf16_checkpoint_under_a_budget_loads_whole_or_says_why() -> None:
    """Only packed experts can live in host memory: a bf16 model that fits the budget is held
    whole (same logits), one that does not is a load error naming both sizes."""
    model = default_model_dir()
    ids = [0, 5, 17, 42]
    whole = Engine.open(model, backend="numpy")
    budgeted = Engine.open(model, backend="numpy", gpu_memory_gib=1.0)
    assert budgeted.memory_report()["weight_bytes"] == whole.memory_report()["weight_bytes"]
    np.testing.assert_array_equal(logits_of(budgeted, ids), logits_of(whole, ids))
    with pytest.raises(WeightsError, match=r"need \d+\.\d GiB .* budget is 0\.0 GiB; only packed"):
        Engine.open(model, backend="numpy", gpu_memory_gib=0.001)


def test_placed_prefill_runs_each_memory_through_the_grouped_kernels(small_model: Path,
                                                                     monkeypatch) -> None:
    """A chunk's picks over a bank split between the memories: the resident ones through the
    grouped kernels over the device stacks, the host ones over the host stacks (their NumPy
    twins here), summed, equal the model's per-expert prefill loop."""
    from ds4.model.moe import _placed_kernels_fit, _routed_many, _routed_placed

    placed = Engine.open(small_model, backend="numpy", load_format="dummy", seed=2,
                         gpu_memory_gib=half_budget_gib(small_packed()))
    cfg, bank = placed.config, placed.model.weights.experts[4]
    rng = np.random.default_rng(4)
    S, k = 9, cfg.num_experts_per_tok
    x = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
    ids = np.stack([rng.permutation(bank.count)[:k] for _ in range(S)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (S, k)).astype(np.float32)
    assert _placed_kernels_fit(bank, x.shape[1])
    got = _routed_placed(np, cfg, bank, x, ids, weights)
    want = _routed_many(np, cfg, bank, x, ids, weights, ids)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 3e-5 * scale  # bf16 hi + lo words of x and of act
    # the host experts staged (on the GPU: copied to the device first) give the same bits
    from ds4.model import moe

    copies = []
    stage = moe.stage_host
    monkeypatch.setattr(moe, "stage_host", lambda *a: copies.append(stage(*a)) or copies[-1])
    staged = _routed_placed(np, cfg, bank, x, ids, weights, stage=True)
    assert len(copies) == 1 and copies[0][0][0].codes is not bank.placed_stacks[0].host[0]
    np.testing.assert_array_equal(staged, got)
    # copies made before the layer's attention (moe.stage_ahead's) are used, not made again
    copies.clear()
    ahead = stage(np, *bank.placed_stacks)
    again = _routed_placed(np, cfg, bank, x, ids, weights, stage=True, ahead=ahead)
    assert copies == []
    np.testing.assert_array_equal(again, got)


def test_the_weight_budget_is_the_flag_or_the_free_memory_less_the_reserve() -> None:
    from ds4.model.budget import GIB, device_budget

    assert device_budget(100 * GIB, 30 * GIB, None) == 70 * GIB
    assert device_budget(20 * GIB, 30 * GIB, None) == 0  # never negative
    assert device_budget(100 * GIB, 30 * GIB, 12.5) == int(12.5 * GIB)


def test_the_default_budget_leaves_room_for_the_sessions_and_the_scratch() -> None:
    """On a GPU the weights get the free memory (the driver's and CuPy's pool's) less
    `parallel` sessions of `ctx` tokens and the scratch; a budget <= 0 is refused."""
    from types import SimpleNamespace

    from ds4.model.budget import GIB, scratch_estimate, weight_budget
    from ds4.model.config import ModelConfig
    from ds4.model.state import state_bytes

    cfg = ModelConfig.from_dir(default_model_dir())
    xp = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(
        memGetInfo=lambda: (40 * GIB, 80 * GIB))),
        get_default_memory_pool=lambda: SimpleNamespace(free_bytes=lambda: 2 * GIB))
    gpu = SimpleNamespace(is_gpu=True, xp=xp)
    per_token, fixed = state_bytes(cfg)
    want = 42 * GIB - int(3 * (fixed + per_token * 4096)) - scratch_estimate(cfg, 512)
    assert weight_budget(gpu, cfg, None, 3, 4096, 512) == want
    assert weight_budget(SimpleNamespace(is_gpu=False), cfg, None, 3, 4096, 512) is None
    assert weight_budget(gpu, cfg, 7.5, 3, 4096, 512) == int(7.5 * GIB)
    with pytest.raises(ValueError, match="gpu_memory_gib must be > 0"):
        weight_budget(gpu, cfg, 0.0, 3, 4096, 512)
