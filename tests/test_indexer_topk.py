"""The indexer's prefill scores and top-k pick (ds4/model/indexer.py: index_scores, top_entries):
what each query attends to in a CSA layer's prefill. A brute-force sort is the reference; the
GPU's radix-select kernel (the decode graph's) must give the very same ids, and its one-pass
head sum NumPy's scores within fp32 summation noise."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.backend import cuda_available
from ds4.model.indexer import top_entries


def scores(rows: int, count: int, seed: int) -> np.ndarray:
    """Random scores with many exact ties (few distinct values) and some negatives."""
    rng = np.random.default_rng(seed)
    return (rng.integers(-4, 5, (rows, count)) * 0.25).astype(np.float32)


def brute(total, positions, ratio: int, topk: int) -> np.ndarray:
    """Row by row: sort the seen entries by (score desc, index asc), keep topk, ascending."""
    out = np.full((total.shape[0], topk), -1)
    for t, pos in enumerate(positions):
        seen = (int(pos) + 1) // ratio
        best = sorted(range(seen), key=lambda i: (-float(total[t, i]), i))[:topk]
        out[t, :len(best)] = sorted(best)
    return out


@pytest.mark.parametrize("count,topk", [(40, 8), (9, 8), (300, 64)])
def test_numpy_picks_the_highest_seen_scores_lowest_index_first(count, topk):
    """Ties at the threshold go to the lower index; entries past a query's reach are never
    picked; a query that sees fewer than topk gets them all, then -1."""
    ratio = 4
    positions = np.arange(count * ratio - 37, count * ratio)  # the last rows see every entry
    positions = np.concatenate([[0, 3, 5, 31], positions])
    total = scores(positions.size, count, count)
    got = top_entries(np, total, positions, ratio, topk)
    np.testing.assert_array_equal(got, brute(total, positions, ratio, topk))


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")
@pytest.mark.parametrize("count,topk", [(40, 8), (3000, 512), (4096, 512)])
def test_gpu_picks_equal_numpy(count, topk):
    """The radix select on the device returns NumPy's ids exactly, ties and -1s included."""
    import cupy

    ratio = 4
    rng = np.random.default_rng(count)
    positions = np.sort(rng.integers(0, count * ratio, 257))
    total = scores(positions.size, count, count + 1)
    want = top_entries(np, total, positions, ratio, topk)
    got = top_entries(cupy, cupy.asarray(total), cupy.asarray(positions), ratio, topk)
    np.testing.assert_array_equal(cupy.asnumpy(got), want)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")
@pytest.mark.parametrize("rows,heads,count", [(5, 64, 300), (3, 4, 1), (2, 64, 4096)])
def test_gpu_head_sum_equals_its_twin(rows, heads, count):
    """relu, scale and the weighted head sum in one pass equal the array operations (2e-6 of
    the largest score: the heads are summed in another order)."""
    import cupy

    from ds4.kernels.indexer import indexer_head_sum, indexer_head_sum_numpy

    rng = np.random.default_rng(count)
    dots = rng.standard_normal((rows, heads, count)).astype(np.float32)
    w = rng.standard_normal((rows, heads)).astype(np.float32)
    want = indexer_head_sum_numpy(dots, w, 128 ** -0.5, np.empty((rows, count), np.float32))
    got = indexer_head_sum(cupy.asarray(dots), cupy.asarray(w), 128 ** -0.5,
                           cupy.empty((rows, count), cupy.float32))
    np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=0,
                               atol=2e-6 * float(np.abs(want).max()))


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")
@pytest.mark.parametrize("rows,heads,count", [(7, 64, 300), (2, 4, 1), (33, 64, 4096)])
def test_gpu_fp4_dots_equal_the_fp32_products(rows, heads, count):
    """Prefill's indexer products of FP4-simulated queries and keys as one bf16 GEMM equal the
    fp32 matmul's (every product exact in both; 1e-6 of the largest: the sums' order)."""
    import cupy

    from ds4.model import quant
    from ds4.model.indexer import fp4_dots

    rng = np.random.default_rng(count)
    matrix = quant.hadamard(128)
    q = quant.indexer_fp4_simulation(
        np, (rng.standard_normal((rows, heads, 128)) * 3).astype(np.float32), matrix)
    keys = quant.indexer_fp4_simulation(
        np, rng.standard_normal((count, 128)).astype(np.float32), matrix)
    want = np.matmul(q.astype(np.float64), keys.T.astype(np.float64))
    got = cupy.asnumpy(fp4_dots(cupy, cupy.asarray(q), cupy.asarray(keys)))
    assert got.shape == (rows, heads, count)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * float(np.abs(want).max()))


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")
def test_gpu_indexer_rounding_takes_the_kernel_and_keeps_nearly_every_value():
    """The prefill QAT on CuPy (hadamard_fp4 over [tokens, heads, dim]) equals NumPy's matmul
    and array rounding but for values within float noise of an FP4 boundary."""
    import cupy

    from ds4.model import quant

    rng = np.random.default_rng(3)
    rows = (rng.standard_normal((50, 64, 128)) * rng.uniform(0.01, 20, (50, 64, 1)))
    rows = rows.astype(np.float32)
    want = quant.indexer_fp4_simulation(np, rows, quant.hadamard(128))
    got = quant.indexer_fp4_simulation(cupy, cupy.asarray(rows), cupy.asarray(quant.hadamard(128)))
    assert got.shape == rows.shape
    close = np.isclose(cupy.asnumpy(got), want, atol=1e-5 * np.abs(want).max())
    assert close.mean() > 0.999, close.mean()
