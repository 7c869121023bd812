"""x split once per launch (ds4/kernels/rows.py's `split_rows`, rows.cu's rows_split): the
twin's word layout holds exactly the hi + lo of every column on CPU; on the GPU the kernel
writes the twin's words, and the MoE kernels reading them give bitwise what the kernels that
split x themselves give, in any batch (graph replay: tests/test_kernels_rows_moe.py)."""

from __future__ import annotations

import numpy as np
import pytest
from test_kernels_rows_moe import gpu_test, make_moe_case, picks, run_moe

from ds4.kernels import rows as R
from ds4.model.packed import FP4, FP8


@pytest.fixture(scope="module")
def moe_case():
    return make_moe_case()


def columns_of(words: np.ndarray, fmt: str) -> np.ndarray:
    """hi + lo of every column (float64) read back from split words [n, words_ld] through the
    layout's own index arithmetic (rows.cuh: part, k-tile, lane, mma, register)."""
    ld, ch = words.shape[1], R.CHUNK[fmt]
    j = np.arange(ld // 2)
    per = ch // 2
    kt, t, m, r = j // (4 * per), (j // per) % 4, (j % per) >> 1, j & 1
    base = kt * 4 * ch + t * ch
    out = np.zeros((words.shape[0], 2 * (ld // 2)))

    def bf16(u):
        return (u.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    for h in (0, 1):
        col = base + R._xcol(fmt, m, r, h)
        out[:, col] = (bf16((words[:, :ld // 2] >> (16 * h)) & 0xFFFF)
                       + bf16((words[:, ld // 2:] >> (16 * h)) & 0xFFFF))
    return out


@pytest.mark.parametrize("fmt", [FP8, FP4])
@pytest.mark.parametrize("cols", [4096, 200, 96])
def test_split_words_hold_each_columns_hi_and_lo_once(fmt, cols):
    x = np.random.default_rng(cols).standard_normal((3, cols)).astype(np.float32)
    words = np.zeros((3, R.words_ld(fmt, cols)), np.uint32)
    R.split_rows_numpy([(x, 3, cols, fmt, words)])
    back = columns_of(words, fmt)
    assert np.array_equal(back[:, :cols], R.split_x(x, R.X_SHIFT[fmt]))
    assert not back[:, cols:].any()  # past the matrix: zeros


@gpu_test
def test_split_kernel_writes_the_twins_words_for_two_jobs_at_once():
    import cupy as cp

    rng = np.random.default_rng(2)
    wide = cp.asarray(rng.standard_normal((8, 4100)).astype(np.float32))[:, :4096]  # strided
    narrow = cp.asarray(rng.standard_normal((5, 200)).astype(np.float32))
    for jobs in ([(wide, 8, 4096, FP4), (narrow, 5, 200, FP8)], [(narrow, 3, 200, FP4)]):
        outs = [cp.zeros((n, R.words_ld(f, k)), cp.uint32) for _, n, k, f in jobs]
        R.split_rows([(x, n, k, f, o) for (x, n, k, f), o in zip(jobs, outs)])
        for (x, n, k, f), o in zip(jobs, outs):
            want = np.zeros((n, R.words_ld(f, k)), np.uint32)
            R.split_rows_numpy([(x.get(), n, k, f, want)])
            assert np.array_equal(o.get(), want), f


@gpu_test
def test_moe_on_split_x_is_bitwise_the_moe_that_splits_itself(moe_case):
    """The fused FP4 + FP8-shared launches read split words; a scratch without them runs the
    kernels that split x themselves."""
    import cupy as cp

    rng = np.random.default_rng(22)
    idx, wts = picks(rng, 8, 6, 256)
    idx[2, :2] = idx[0, :2]
    x = rng.standard_normal((8, 4096), dtype=np.float32)
    for batch in (1, 4, 8):
        split = run_moe(cp, moe_case, idx, wts, x, batch)
        plain = run_moe(cp, moe_case, idx, wts, x, batch, words=False)
        assert cp.array_equal(split, plain), batch
