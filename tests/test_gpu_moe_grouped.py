"""Grouped prefill experts (ds4/model/gpu_moe.py) equal the engine's per-expert loop; run with
NumPy here, on CuPy by the engine's GPU prefill (tests/test_engine_cupy.py, tests/test_gpu_engine.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ds4.model.gpu_moe import routed_grouped
from ds4.model.moe import _routed_many


def test_grouped_experts_match_the_loop():
    rng = np.random.default_rng(3)
    E, k, inter, D, S = 16, 3, 24, 40, 37
    cfg = SimpleNamespace(moe_intermediate_size=inter, swiglu_limit=10.0)
    gate_up = rng.standard_normal((E, 2 * inter, D)).astype(np.float32)
    down = rng.standard_normal((E, D, inter)).astype(np.float32) * 0.1
    bank = SimpleNamespace(stacked=(gate_up, down), expert=lambda e: (gate_up[e], down[e]))
    x = rng.standard_normal((S, D)).astype(np.float32)
    ids = rng.integers(0, E, (S, k))
    ids[0] = [5, 5, 2]  # a token picking one expert twice adds both weights
    weights = rng.random((S, k)).astype(np.float32)
    want = _routed_many(np, cfg, bank, x, ids, weights, ids)
    got = routed_grouped(np, cfg, bank, x, ids, weights)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_skewed_routing_falls_back():
    cfg = SimpleNamespace(moe_intermediate_size=4, swiglu_limit=10.0)
    stack = (np.zeros((64, 8, 8), np.float32), np.zeros((64, 8, 4), np.float32))
    ids = np.zeros((10, 2), dtype=np.int64)  # every pick on expert 0: 64 x 20 padded rows
    out = routed_grouped(np, cfg, SimpleNamespace(stacked=stack), np.ones((10, 8), np.float32),
                         ids, np.ones((10, 2), np.float32))
    assert out is None
