"""The GEMM paths behind the prefill (ds4.model.linear, the grouped experts, attention query
blocks) compute the same function as the plain fp32 products they replace. CPU tests; the
tensor-core versions of the same checks are in tests/test_gpu_prefill.py."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.kernels import to_bf16, widen
from ds4.kernels.split import split_bf16_numpy
from ds4.model import attention, moe
from ds4.model.linear import batched_linear, grouped_rows_linear, linear


def test_linear_on_bf16_words_is_the_widened_product():
    rng = np.random.default_rng(0)
    w = to_bf16(rng.standard_normal((48, 64)).astype(np.float32))
    x = rng.standard_normal((3, 5, 64)).astype(np.float32)
    np.testing.assert_array_equal(linear(np, x, w), x @ widen(w).T)
    np.testing.assert_array_equal(linear(np, x, widen(w)), x @ widen(w).T)
    ws = np.stack([w, w[::-1]])
    np.testing.assert_allclose(batched_linear(np, x[:2], ws),
                               np.matmul(x[:2], widen(ws).transpose(0, 2, 1)))
    np.testing.assert_allclose(grouped_rows_linear(np, x[:2].transpose(1, 0, 2), ws),
                               np.matmul(x[:2], widen(ws).transpose(0, 2, 1)).transpose(1, 0, 2))


def test_split_rows_keep_16_bits_of_each_activation():
    """hi + lo reproduces x to 2^-16 relative: what keeps the tensor-core GEMMs fp32-class."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 7,
                              33)) * np.exp(rng.uniform(-20, 20, (2, 7, 33)))).astype(np.float32)
    out = split_bf16_numpy(x, np.empty((2, 14, 33), np.uint16))
    back = widen(out[:, :7]) + widen(out[:, 7:])
    assert float(np.max(np.abs(back - x) / np.abs(x))) <= 2.0 ** -16
    np.testing.assert_array_equal(out[:, :7], to_bf16(x))
    alone = split_bf16_numpy(x, np.empty((2, 7, 33), np.uint16))  # one part: the rounding alone
    np.testing.assert_array_equal(alone, out[:, :7])


class _Bank:
    """Stacked experts as the engine holds them on the GPU (bf16 words)."""

    resident = True

    def __init__(self, gate_up, down):
        self.stacked = (gate_up, down)
        self.count = gate_up.shape[0]

    def expert(self, e: int):
        return widen(self.stacked[0][e]), widen(self.stacked[1][e])


@pytest.mark.parametrize("hashed_duplicates", [False, True])
def test_grouped_experts_equal_one_product_per_expert(hashed_duplicates: bool):
    """Padding every expert's rows to the busiest one and batching is the per-expert loop's sum,
    also when a token picks the same expert twice (hash tables may)."""
    from types import SimpleNamespace

    rng = np.random.default_rng(2)
    E, D, inter, S, k = 8, 32, 16, 37, 3
    cfg = SimpleNamespace(moe_intermediate_size=inter, swiglu_limit=1.5)  # what the experts read
    bank = _Bank(to_bf16(rng.standard_normal((E, 2 * inter, D)).astype(np.float32) * 0.2),
                 to_bf16(rng.standard_normal((E, D, inter)).astype(np.float32) * 0.2))
    x = rng.standard_normal((S, D)).astype(np.float32)
    ids = rng.integers(0, E, (S, k))
    if not hashed_duplicates:
        ids = np.argsort(rng.random((S, E)), axis=1)[:, :k]
    weights = rng.random((S, k)).astype(np.float32)
    want = moe._routed_many(np, cfg, bank, x, ids, weights, ids)
    got = moe._routed_grouped(np, cfg, bank, x, ids, weights, np.asarray)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_attention_query_blocks_do_not_change_the_logits(monkeypatch):
    """A 40-token prefill in query blocks of 8 (window 16/32: later blocks skip the ring) gives
    the logits of one block."""
    from pathlib import Path

    from ds4.engine import Engine

    fixtures = Path(__file__).parent / "fixtures"
    for case in ("v4_csa_hca", "v4_hca8"):
        ids = np.load(fixtures / case / "ref.npz")["ids"].tolist()[:40]
        eng = Engine.open(fixtures / case, backend="numpy", quantize=False)
        want = np.asarray(eng.new_session(ctx_size=128).sync(ids))
        monkeypatch.setattr(attention, "QUERY_BLOCK", 8)
        got = np.asarray(eng.new_session(ctx_size=128).sync(ids))
        monkeypatch.undo()
        np.testing.assert_allclose(got, want, atol=2e-5)
