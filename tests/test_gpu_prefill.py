"""The tensor-core prefill paths on the GPU against NumPy fp32 (needs CuPy and a GPU).

Tolerances: the hi + lo split keeps ~16 bits of every activation, so products over K terms
land within ~3e-5 relative of fp32; DS4_GEMM=bf16 (one rounding of the activations) ~3e-3."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.backend import cuda_available
from ds4.kernels import to_bf16, widen

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("shape", [(3, 77, 130), (3, 77, 128), (300, 1, 4096), (1, 5, 4)],
                         ids=["scalar", "quads", "rows", "one-quad"])
def test_split_kernel_equals_its_twin(parts, shape):
    """Both kernels (a group size not a multiple of 4: one value a thread; else quads), in
    linear's [rows, 1, K] layout and chunk attention's one group."""
    import cupy

    from ds4.kernels.split import split_bf16, split_bf16_numpy

    G, R, K = shape
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    got = split_bf16(cupy.asarray(x), cupy.empty((G, R * parts, K), cupy.uint16))
    want = split_bf16_numpy(x, np.empty((G, R * parts, K), np.uint16))
    np.testing.assert_array_equal(cupy.asnumpy(got), want)


@pytest.mark.parametrize("mode,tol", [("bf16x2", 3e-5), ("bf16", 1e-2)])
@pytest.mark.parametrize("rows,n,k", [(1, 512, 4096), (300, 1024, 512), (2048, 256, 1024)])
def test_linear_on_words_matches_fp32(monkeypatch, mode, tol, rows, n, k):
    import cupy

    from ds4.model.linear import batched_linear, grouped_linear, grouped_rows_linear, linear

    monkeypatch.setenv("DS4_GEMM", mode)
    rng = np.random.default_rng(rows)
    w = to_bf16(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    want = x @ widen(w).T
    assert rel_err(cupy.asnumpy(linear(cupy, cupy.asarray(x), cupy.asarray(w))), want) < tol
    ws = np.stack([w, w[::-1]])
    xs = np.stack([x, -x[::-1]])
    got = cupy.asnumpy(batched_linear(cupy, cupy.asarray(xs), cupy.asarray(ws)))
    assert rel_err(got, np.matmul(xs, widen(ws).transpose(0, 2, 1))) < tol
    # o_a's layout: row group g of every row times w[g], strided in place on both sides
    got = cupy.asnumpy(grouped_rows_linear(cupy, cupy.asarray(xs.transpose(1, 0, 2)),
                                           cupy.asarray(ws)))
    assert rel_err(got, np.matmul(xs, widen(ws).transpose(0, 2, 1)).transpose(1, 0, 2)) < tol
    groups = [(1, 0, rows // 3), (0, rows // 3, rows)] if rows > 2 else [(1, 0, rows)]
    got = cupy.asnumpy(grouped_linear(cupy, cupy.asarray(x), cupy.asarray(ws), groups))
    assert rel_err(got, grouped_linear(np, x, ws, groups)) < tol


def test_grouped_experts_on_the_gpu_equal_the_numpy_loop():
    import cupy
    from test_linear import _Bank

    from ds4.model import moe

    rng = np.random.default_rng(3)
    E, D, inter, S, k = 64, 256, 128, 300, 6
    cfg = type("Cfg", (), {"moe_intermediate_size": inter, "swiglu_limit": 10.0})
    gate_up = to_bf16(rng.standard_normal((E, 2 * inter, D)).astype(np.float32) * 0.1)
    down = to_bf16(rng.standard_normal((E, D, inter)).astype(np.float32) * 0.1)
    x = rng.standard_normal((S, D)).astype(np.float32)
    ids = np.argsort(rng.random((S, E)), axis=1)[:, :k]
    weights = rng.random((S, k)).astype(np.float32)
    want = moe._routed_many(np, cfg, _Bank(gate_up, down), x, ids, weights, ids)
    dev = _Bank(cupy.asarray(gate_up), cupy.asarray(down))
    got = moe._routed_grouped(cupy, cfg, dev, cupy.asarray(x), cupy.asarray(ids),
                              cupy.asarray(weights),
                              cupy.asnumpy)
    assert rel_err(cupy.asnumpy(got), want) < 3e-5


def test_hc_weights_of_a_chunk_match_the_array_formula():
    """The one-thread-per-token mHC weights equal the model's xp formula per token."""
    import cupy

    from ds4.model.hyper_connection import hc_weights

    rng = np.random.default_rng(4)
    S, n, D = 700, 4, 64
    fn = rng.standard_normal(((2 + n) * n, n * D)).astype(np.float32) * 0.1
    base = rng.standard_normal((2 + n) * n).astype(np.float32)
    scale = rng.uniform(0.5, 2, 3).astype(np.float32)
    X = rng.standard_normal((S, n, D)).astype(np.float32)
    want = hc_weights(np, fn, base, scale, X, 20, 1e-6, 1e-6)
    got = hc_weights(cupy, *(cupy.asarray(a) for a in (fn, base, scale, X)), 20, 1e-6, 1e-6)
    for g, w in zip(got, want):
        np.testing.assert_allclose(cupy.asnumpy(g), w, rtol=2e-5, atol=1e-6)


def test_rms_norm_and_stream_expansion_match_the_array_formulas():
    """The chunk's RMSNorms and mHC expansion, run as kernels on the GPU, equal NumPy's xp code."""
    import cupy

    from ds4.model.hyper_connection import hc_expand, rms_norm

    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, 64, 512)).astype(np.float32)
    w = rng.standard_normal(512).astype(np.float32)
    for weight in (w, None):
        got = rms_norm(cupy, cupy.asarray(x), None if weight is None else cupy.asarray(weight),
                       1e-6)
        np.testing.assert_allclose(cupy.asnumpy(got), rms_norm(np, x, weight, 1e-6), rtol=2e-5,
                                   atol=1e-6)
    X = rng.standard_normal((300, 4, 256)).astype(np.float32)
    y = rng.standard_normal((300, 256)).astype(np.float32)
    post, comb = rng.random((300, 4)).astype(np.float32), rng.random((300, 4, 4)).astype(np.float32)
    got = hc_expand(cupy, *(cupy.asarray(a) for a in (X, y, post, comb)))
    np.testing.assert_allclose(cupy.asnumpy(got), hc_expand(np, X, y, post, comb), rtol=2e-5,
                               atol=1e-5)
