"""Block-level properties (docs/MODEL.md): YaRN, RoPE, mHC Sinkhorn, compressor windows."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.model.compressor import pool_windows, softmax_pool
from ds4.model.config import RopeSpec
from ds4.model.hyper_connection import hc_weights
from ds4.model.rope import Rope, inverse_frequencies
from ds4.model.state import CompressorState

FLASH_YARN = RopeSpec(theta=160000.0, rope_type="yarn", factor=16.0,
                      original_max_position_embeddings=65536)


def test_flash_yarn_frequencies_follow_the_spec():
    base = 160000.0 ** (-np.arange(0, 64, 2) / 64)
    ratio = inverse_frequencies(FLASH_YARN, 64) / base
    np.testing.assert_allclose(ratio[:16], 1.0)  # pairs below low = 15 keep their frequency
    np.testing.assert_allclose(ratio[25:], 1 / 16)  # pairs from high = 25 on are divided by 16
    assert np.all(np.diff(ratio) <= 1e-12)  # a linear ramp in between
    plain = RopeSpec(theta=10000.0)
    np.testing.assert_allclose(inverse_frequencies(plain, 64),
                               10000.0 ** (-np.arange(0, 64, 2) / 64))


def test_rope_is_relative_and_invertible():
    rope = Rope(np, FLASH_YARN, 8)
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, 32)).astype(np.float32)
    pos = np.array([5, 905, 12, 912])
    cos, sin = rope.cos_sin(pos)
    rq = rope.apply(np.repeat(q, 4, 0), cos, sin)
    rk = rope.apply(np.repeat(k, 4, 0), cos, sin)
    assert abs(rq[1] @ rk[0] - rq[3] @ rk[2]) < 1e-4  # same distance 900 -> same score
    np.testing.assert_array_equal(rq[:, :24], np.repeat(q, 4, 0)[:, :24])  # only the tail rotates
    np.testing.assert_allclose(rope.apply(rq, cos, sin, inverse=True), np.repeat(q, 4, 0),
                               atol=1e-5)


def test_hyper_connection_comb_is_doubly_stochastic():
    rng = np.random.default_rng(1)
    X = rng.standard_normal((3, 4, 16)).astype(np.float32)
    fn = (0.3 * rng.standard_normal((24, 64))).astype(np.float32)
    base = rng.standard_normal(24).astype(np.float32)
    pre, post, comb = hc_weights(np, fn, base, np.array([1.0, 0.8, 1.2], np.float32), X, 20, 1e-6,
                                 1e-6)
    np.testing.assert_allclose(comb.sum(axis=-1), 1.0, atol=1e-3)
    np.testing.assert_allclose(comb.sum(axis=-2), 1.0, atol=1e-5)
    assert np.all((post > 0) & (post < 2)) and np.all(pre > 1e-6)
    assert not np.allclose(comb, comb.transpose(0, 2, 1))  # direction matters (docs/MODEL.md)


@pytest.mark.parametrize("n", [1, 3, 4, 7, 8])
def test_sinkhorn_sums_of_a_long_chunk_keep_numpys_bits(n):
    """A 2048-token chunk's small sums go through explicit adds: the bits of NumPy's own sum."""
    from ds4.model.hyper_connection import _sum_keep

    rng = np.random.default_rng(n)
    comb = (rng.random((2048, n, n)) * 10.0 ** rng.uniform(-4, 4, (2048, n, n))).astype(np.float32)
    for axis in (-1, -2):
        np.testing.assert_array_equal(_sum_keep(np, comb, axis), comb.sum(axis=axis, keepdims=True))


@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False)])
def test_the_pool_kernels_twin_pools_as_the_model_code(ratio, overlap):
    """compressor_pool_windows_numpy (the GPU kernel's twin) gives the model's pooled rows for
    a chunk whose first window pools the overlap carried from the chunk before."""
    from ds4.kernels.compressor import compressor_pool_windows_numpy

    rng = np.random.default_rng(3)
    width, out = (16, 8) if overlap else (8, 8)
    kv = rng.standard_normal((4 * ratio, width)).astype(np.float32)
    score = rng.standard_normal((4 * ratio, width)).astype(np.float32)
    state = CompressorState(np, ratio, width, out, overlap, 16)
    pool_windows(np, state, kv[:ratio], score[:ratio], 0)
    carried = (state.overlap_kv.copy(), state.overlap_score.copy()) if overlap else (None, None)
    want, _ = pool_windows(np, state, kv[ratio:], score[ratio:], ratio)
    got = compressor_pool_windows_numpy(kv[ratio:].reshape(3, ratio, width),
                                        score[ratio:].reshape(3, ratio, width), *carried,
                                        np.empty((3, out), np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False)])
def test_compressor_windows_do_not_depend_on_chunking(ratio, overlap):
    rng = np.random.default_rng(2)
    width, out = (16, 8) if overlap else (8, 8)
    kv = rng.standard_normal((29, width)).astype(np.float32)
    score = rng.standard_normal((29, width)).astype(np.float32)
    whole = CompressorState(np, ratio, width, out, overlap, 16)
    pooled, first = pool_windows(np, whole, kv, score, 0)
    assert first == 0 and pooled.shape == (29 // ratio, out)
    pieces = CompressorState(np, ratio, width, out, overlap, 16)
    got, start = [], 0
    for size in (1, 2, 5, 1, 9, 3, 8):
        p, w = pool_windows(np, pieces, kv[start : start + size], score[start : start + size],
                            start)
        if p is not None:
            assert w == len(got)
            got.extend(p)
        start += size
    np.testing.assert_allclose(np.array(got), pooled, atol=1e-6)
    if overlap:  # window 1 pools window 0's first half with its own second half
        slots_kv = np.concatenate([kv[0:4, :8], kv[4:8, 8:]])
        slots_score = np.concatenate([score[0:4, :8], score[4:8, 8:]])
        np.testing.assert_allclose(pooled[1], softmax_pool(np, slots_kv, slots_score, 0), atol=1e-6)
        np.testing.assert_allclose(pooled[0], softmax_pool(np, kv[0:4, 8:], score[0:4, 8:], 0),
                                   atol=1e-6)
