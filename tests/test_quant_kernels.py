"""The decode step's FP8 / FP4 simulation kernels (ds4/kernels/quant.cu): NumPy twins equal the
model's own simulation (ds4/model/quant.py) on CPU; the kernels equal their twins on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.backend import cuda_available
from ds4.kernels import quant as qk
from ds4.model import quant

RNG = np.random.default_rng(5)


def _rows(n: int, width: int) -> np.ndarray:
    return (RNG.standard_normal((n, width)) * RNG.uniform(0.01, 20, (n, 1))).astype(np.float32)


@pytest.mark.parametrize("width, rope", [(512, 64), (64, 8)])
def test_kv_twins_round_the_one_row_the_model_rounds(width, rope):
    rows = _rows(8, width)
    want = rows.copy()
    want[5] = quant.kv_fp8_simulation(np, rows[5:6], rope)[0]  # pos 13 % 8 = slot 5
    got = qk.kv_fp8_slot_numpy(rows.copy(), width - rope, np.array([13], np.int32))
    np.testing.assert_array_equal(got, want)
    want = rows.copy()
    want[3] = quant.kv_fp8_simulation(np, rows[3:4], rope)[0]  # pos 15 closes row 3 (ratio 4)
    np.testing.assert_array_equal(
        qk.kv_fp8_closed_numpy(rows.copy(), width - rope, np.array([15], np.int32), 4), want)
    untouched = qk.kv_fp8_closed_numpy(rows.copy(), width - rope, np.array([14], np.int32), 4)
    np.testing.assert_array_equal(untouched, rows)


@pytest.mark.parametrize("width, rope", [(512, 64), (64, 8)])
def test_kv_rows_twin_rounds_every_row_as_the_model_does(width, rope):
    rows = _rows(7, width)
    want = quant.kv_fp8_simulation(np, rows, rope)
    np.testing.assert_array_equal(qk.kv_fp8_rows_numpy(rows.copy(), width - rope), want)


@pytest.mark.parametrize("width", [128, 16])
def test_hadamard_twin_is_the_indexer_simulation(width):
    rows = _rows(6, width)
    want = quant.indexer_fp4_simulation(np, rows, quant.hadamard(width))
    got = qk.hadamard_fp4_numpy(rows.copy(), np.array([0], np.int32))
    np.testing.assert_allclose(got, want, atol=1e-6 * np.abs(want).max())
    one = qk.hadamard_fp4_numpy(rows.copy(), np.array([7], np.int32), 4)  # closes row 1
    np.testing.assert_array_equal(one[[0, 2, 3, 4, 5]], rows[[0, 2, 3, 4, 5]])
    np.testing.assert_allclose(one[1], want[1], atol=1e-6 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")
def test_quant_kernels_equal_their_twins():
    import cupy as cp

    for width, nope in ((512, 448), (64, 56)):
        rows = _rows(8, width)
        for pos, ratio in ((13, 0), (15, 4), (14, 4)):
            p = np.array([pos], np.int32)
            want = (qk.kv_fp8_closed_numpy(rows.copy(), nope, p, ratio) if ratio
                    else qk.kv_fp8_slot_numpy(rows.copy(), nope, p))
            got = cp.asarray(rows)
            if ratio:
                qk.kv_fp8_closed(got, nope, cp.asarray(p), ratio)
            else:
                qk.kv_fp8_slot(got, nope, cp.asarray(p))
            np.testing.assert_array_equal(cp.asnumpy(got), want)
    for width in (128, 32):
        rows = _rows(9, width)
        for pos, ratio in ((0, 0), (7, 4)):
            p = np.array([pos], np.int32)
            want = qk.hadamard_fp4_numpy(rows.copy(), p, ratio)
            got = cp.asarray(rows)
            qk.hadamard_fp4(got, cp.asarray(p), ratio)
            got = cp.asnumpy(got)
            # the transform's summation order differs from a matmul's: a value within float
            # noise of an FP4 boundary may land on the other side (one step of its block)
            close = np.isclose(got, want, atol=1e-5 * np.abs(want).max())
            assert close.mean() > 0.995, close.mean()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")
@pytest.mark.parametrize("width, rope", [(512, 64), (64, 8)])
def test_prefill_kv_rounding_on_the_gpu_is_the_models_bit_for_bit(width, rope):
    """Prefill's KV rows go through kv_fp8_rows on CuPy: every bit as the NumPy simulation."""
    import cupy as cp

    rows = _rows(300, width).reshape(3, 100, width)
    want = quant.kv_fp8_simulation(np, rows, rope)
    got = quant.kv_fp8_simulation(cp, cp.asarray(rows), rope)
    np.testing.assert_array_equal(cp.asnumpy(got), want)
