"""Packed FP8 / MXFP4 weights: the NumPy dequantizers against independent decodings of every
code, and each packed RawKernel against its NumPy twin on fresh random inputs (GPU tests).

GPU tolerance: both sides accumulate exact products in fp32, in different orders, so
|gpu - twin| <= 1e-4 * (|W| @ |x|) element-wise; the bf16 slabs must match bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.backend import cuda_available
from ds4.kernels import packed as P
from ds4.kernels import widen

RTOL = 1e-4


@pytest.fixture
def rng():
    return np.random.default_rng(11)


def fp8_codes(rng, *shape):
    """Random E4M3 codes without the two NaN codes."""
    c = rng.integers(0, 256, shape, dtype=np.uint8)
    c[(c & 0x7F) == 0x7F] ^= 0x01
    return c


def scales(rng, *shape, lo=112, hi=132):
    return rng.integers(lo, hi, shape, dtype=np.uint8)


def fp4_codes(rng, *shape):
    return rng.integers(0, 256, shape, dtype=np.uint8)


def test_e4m3_table_matches_ml_dtypes():
    ml = pytest.importorskip("ml_dtypes")
    ref = np.arange(256, dtype=np.uint8).view(ml.float8_e4m3fn).astype(np.float32)
    assert np.array_equal(P.E4M3, ref, equal_nan=True)


def test_e2m1_table_matches_ml_dtypes():
    ml = pytest.importorskip("ml_dtypes")
    ref = np.arange(16, dtype=np.uint8).view(ml.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(P.E2M1, ref)


def test_e4m3_and_e2m1_hand_values():
    hand = {0x00: 0.0, 0x01: 2.0 ** -9, 0x07: 7 * 2.0 ** -9, 0x08: 2.0 ** -6, 0x38: 1.0,
            0x3C: 1.5, 0x40: 2.0, 0x7E: 448.0, 0xFE: -448.0, 0xB8: -1.0, 0x80: -0.0}
    for code, value in hand.items():
        assert P.E4M3[code] == value, hex(code)
    assert np.isnan(P.E4M3[0x7F]) and np.isnan(P.E4M3[0xFF])
    assert np.isnan(P.E4M3).sum() == 2
    assert list(P.E2M1[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert list(P.E2M1[8:]) == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def test_e8m0_scales_and_their_codes():
    assert P.E8M0[127] == 1.0 and P.E8M0[128] == 2.0 and P.E8M0[0] == 2.0 ** -127
    assert np.isnan(P.E8M0[255])
    s = np.array([[0.5, 4.0], [2.0 ** -20, 1.0]], np.float32)
    assert np.array_equal(P.scale_values(P.e8m0_codes(s)), s)
    with pytest.raises(ValueError, match="powers of two"):
        P.e8m0_codes(np.array([0.3], np.float32))


@pytest.mark.parametrize("rows,cols,block", [(300, 200, 128), (256, 384, 128), (40, 24, 16)])
def test_dequant_fp8_matches_the_definition(rng, rows, cols, block):
    codes = fp8_codes(rng, rows, cols)
    sc = scales(rng, -(-rows // block), -(-cols // block), lo=100, hi=150)
    w = P.dequant_fp8(codes, sc, block)
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    ref = P.E4M3[codes].astype(np.float64) * 2.0 ** (sc[r // block, c // block].astype(int) - 127)
    assert w.dtype == np.float32 and np.array_equal(w, ref)
    # float32 scales (the -Base checkpoint) give the same matrix
    assert np.array_equal(P.dequant_fp8(codes, P.scale_values(sc), block), w)


def test_dequant_fp8_rejects_short_scales(rng):
    with pytest.raises(ValueError, match="too small"):
        P.dequant_fp8(fp8_codes(rng, 256, 256), scales(rng, 1, 2), 128)


def test_dequant_fp4_nibble_order_and_scale(rng):
    packed = np.zeros((2, 16), np.uint8)
    packed[0, 0] = 0x21  # column 0 = code 1 (0.5), column 1 = code 2 (1.0)
    packed[1, 15] = 0xF9  # column 30 = code 9 (-0.5), column 31 = code 15 (-6)
    sc = np.array([[128], [125]], np.uint8)
    w = P.dequant_fp4(packed, sc)
    assert w.shape == (2, 32)
    assert w[0, 0] == 1.0 and w[0, 1] == 2.0 and not w[0, 2:].any()
    assert w[1, 30] == -0.125 and w[1, 31] == -1.5 and not w[1, :30].any()


def test_dequant_fp4_matches_the_definition_on_stacked_experts(rng):
    packed = fp4_codes(rng, 3, 5, 32).view(np.int8)  # the checkpoint's I8 dtype
    sc = scales(rng, 3, 5, 2, lo=90, hi=160)
    w = P.dequant_fp4(packed, sc)
    u = packed.view(np.uint8)
    codes = np.stack([u & 15, u >> 4], axis=-1).reshape(3, 5, 64)
    ref = P.E2M1[codes] * np.repeat(2.0 ** (sc.astype(int) - 127), 32, axis=-1)
    assert np.array_equal(w, ref)


def test_numpy_twins_of_gemv_batch_and_groups(rng):
    codes, sc = fp8_codes(rng, 256, 128), scales(rng, 2, 1)
    w = P.dequant_fp8(codes, sc, 128).astype(np.float64)
    x = rng.standard_normal((3, 2 * 128)).astype(np.float32)
    out = np.zeros((3, 256), np.float32)
    P.gemv_fp8_numpy(codes, sc, 128, x, out, rows_per_group=128)
    for b in range(3):
        ref = np.concatenate([w[:128] @ x[b, :128], w[128:] @ x[b, 128:]])
        assert np.allclose(out[b], ref, rtol=1e-5, atol=1e-5 * np.abs(w).sum(1).max())


def test_numpy_bf16_slab_is_the_dequantized_rows(rng):
    codes, sc = fp8_codes(rng, 300, 256), scales(rng, 3, 2)
    out = np.empty((100, 256), np.uint16)
    P.dequant_fp8_bf16_numpy(codes, sc, 128, out, row0=150)
    assert np.array_equal(widen(out), P.dequant_fp8(codes, sc, 128)[150:250])
    packed, s4 = fp4_codes(rng, 40, 64), scales(rng, 40, 4)
    out4 = np.empty((9, 128), np.uint16)
    P.dequant_fp4_bf16_numpy(packed, s4, out4, row0=31)
    assert np.array_equal(widen(out4), P.dequant_fp4(packed, s4)[31:])


# ---- GPU: each launcher against its twin -------------------------------------------------------


def on_gpu(test):
    """Mark a test as needing CuPy and a CUDA device."""
    skip = pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")
    return pytest.mark.gpu(skip(test))


@pytest.fixture
def cp():
    import cupy

    return cupy


def check(cp, got, want, bound):
    """Every element written, finite and within RTOL of sum |w||x| of the twin's value."""
    got = cp.asnumpy(got).astype(np.float64)
    assert np.isfinite(got).all()
    err = np.abs(got - want)
    assert (err <= RTOL * bound + 1e-30).all(), float((err / (bound + 1e-30)).max())


def packed_matrix(rng, fmt, rows, cols, block=128):
    """(codes or packed bytes, E8M0 scales, float32 W) of a random matrix."""
    if fmt == "fp8":
        w, sc = fp8_codes(rng, rows, cols), scales(rng, -(-rows // block), -(-cols // block))
        return w, sc, P.dequant_fp8(w, sc, block)
    w, sc = fp4_codes(rng, rows, cols // 2), scales(rng, rows, cols // 32)
    return w, sc, P.dequant_fp4(w, sc)


def run_gemv(cp, fmt, rng, rows, cols, x, out, **kw):
    """(gpu out, twin out, bound) of gemv_fp8 / gemv_fp4 on a fresh random matrix."""
    w, sc, wf = packed_matrix(rng, fmt, rows, cols)
    fn, twin = (P.gemv_fp8, P.gemv_fp8_numpy) if fmt == "fp8" else (P.gemv_fp4, P.gemv_fp4_numpy)
    extra = (128,) if fmt == "fp8" else ()
    dev = cp.asarray(out)
    fn(cp.asarray(w), cp.asarray(sc), *extra, cp.asarray(x), dev, **kw)
    host = out.copy()
    twin(w, sc, *extra, x, host, **kw)
    group = kw.get("rows_per_group") or rows
    xs = np.abs(x).astype(np.float64).reshape(-1, rows // group, cols)
    bound = np.einsum("grc,bgc->bgr", np.abs(wf).reshape(rows // group, group, cols), xs)
    base = 0 if not kw.get("accumulate") else np.abs(out)
    return dev, host, bound.reshape(host.shape) + base


@on_gpu
@pytest.mark.parametrize("per_warp", [1, 2, 4])
@pytest.mark.parametrize("rows,cols,splits", [(301, 1024, None), (256, 4096, 4), (64, 512, 1)])
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_gemv_packed(cp, rng, fmt, rows, cols, splits, per_warp):
    x = rng.standard_normal(cols).astype(np.float32)
    out = np.full(rows, np.nan, np.float32)  # poison: every row must be written
    check(cp, *run_gemv(cp, fmt, rng, rows, cols, x, out, splits=splits, rows_per_warp=per_warp))


@on_gpu
@pytest.mark.parametrize("fmt,groups", [("fp8", 8), ("fp4", 1)])
def test_gemv_packed_groups_and_accumulate(cp, rng, fmt, groups):
    rows, cols = 1024, 512  # FP8: 8 groups of 128 rows, each with its own x slice
    x = rng.standard_normal(groups * cols).astype(np.float32)
    out = rng.standard_normal(rows).astype(np.float32)
    group = rows // groups if groups > 1 else None
    check(cp, *run_gemv(cp, fmt, rng, rows, cols, x, out, rows_per_group=group,
                        accumulate=True, splits=2))


@on_gpu
@pytest.mark.parametrize("nb", [2, 3, 8])
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_gemv_packed_batched(cp, rng, fmt, nb):
    rows, cols = 258, 2048
    x = rng.standard_normal((nb, cols)).astype(np.float32)
    out = np.full((nb, rows), np.nan, np.float32)
    check(cp, *run_gemv(cp, fmt, rng, rows, cols, x, out))



@on_gpu
def test_gemv_many_fp8_runs_several_projections_in_one_launch(cp, rng):
    cols = 1024
    mats = [packed_matrix(rng, "fp8", rows, cols) for rows in (512, 64, 129, 1)]
    x = rng.standard_normal(cols).astype(np.float32)
    outs = [cp.full(m[0].shape[0], np.nan, cp.float32) for m in mats]
    codes, scs = [cp.asarray(m[0]) for m in mats], [cp.asarray(m[1]) for m in mats]
    table = P.gemv_table_fp8(cp, codes, scs, outs)
    P.gemv_many_fp8(table, codes, scs, 128, cp.asarray(x), outs)
    want = [np.empty(m[0].shape[0], np.float32) for m in mats]
    P.gemv_many_fp8_numpy(None, [m[0] for m in mats], [m[1] for m in mats], 128, x, want)
    for got, w, m in zip(outs, want, mats):
        check(cp, got, w, np.abs(m[2]).astype(np.float64) @ np.abs(x))

def experts(rng, fmt, n, rows, cols):
    """Stacked experts [n, rows, ...] as (weights, scales)."""
    parts = [packed_matrix(rng, fmt, rows, cols)[:2] for _ in range(n)]
    return np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])


def moe_bound(fn, weights, x):
    """sum |w||x| per output, the scale of the fp32 rounding of one expert product."""
    return np.abs(fn(*weights)).astype(np.float64) @ np.abs(x).astype(np.float64)


@on_gpu
@pytest.mark.parametrize("limit", [10.0, 0.0])
@pytest.mark.parametrize("per_warp", [1, 2, 4])
def test_moe_fp4_routed_experts(cp, rng, limit, per_warp):
    E, inter, cols = 8, 192, 1024
    gate, gate_s = experts(rng, "fp4", E, inter, cols)
    up, up_s = experts(rng, "fp4", E, inter, cols)
    down, down_s = experts(rng, "fp4", E, cols, inter)
    idx = np.array([5, 0, 7], np.int32)
    wts = rng.random(3).astype(np.float32)
    x = rng.standard_normal(cols).astype(np.float32) * 8
    act = np.full((3, inter), np.nan, np.float32)
    dev = [cp.asarray(a) for a in (gate, gate_s, up, up_s, idx, wts, x, act)]
    P.moe_gate_up_fp4(*dev, limit, rows_per_warp=per_warp)
    P.moe_gate_up_fp4_numpy(gate, gate_s, up, up_s, idx, wts, x, act, limit)
    got = cp.asnumpy(dev[-1])
    assert np.isfinite(got).all()
    # |d act| <= wts (1.1 |u| |dg| + (|g| + 1) |du|), |dg| <= RTOL sum|w||x| (likewise du)
    g = np.stack([P.dequant_fp4(gate[e], gate_s[e]) @ x for e in idx])
    u = np.stack([P.dequant_fp4(up[e], up_s[e]) @ x for e in idx])
    g_b = np.stack([moe_bound(P.dequant_fp4, (gate[e], gate_s[e]), x) for e in idx])
    u_b = np.stack([moe_bound(P.dequant_fp4, (up[e], up_s[e]), x) for e in idx])
    bound = wts[:, None] * (1.1 * np.abs(u) * g_b + (np.abs(g) + 1) * u_b)
    assert (np.abs(got - act) <= RTOL * bound).all()
    y = np.full(cols, np.nan, np.float32)
    dy = cp.asarray(y)
    P.moe_down_fp4(cp.asarray(down), cp.asarray(down_s), dev[4], cp.asarray(act), dy,
                   rows_per_warp=per_warp)
    P.moe_down_fp4_numpy(down, down_s, idx, act, y)
    bound = sum(moe_bound(P.dequant_fp4, (down[e], down_s[e]), act[k]) for k, e in enumerate(idx))
    check(cp, dy, y, bound)


@on_gpu
def test_moe_fp8_shared_expert_adds_to_routed_sum(cp, rng):
    inter, cols = 256, 512
    g, gs, _ = packed_matrix(rng, "fp8", inter, cols)
    u, us, _ = packed_matrix(rng, "fp8", inter, cols)
    d, ds, dw = packed_matrix(rng, "fp8", cols, inter)
    x = rng.standard_normal(cols).astype(np.float32)
    act = np.full((4, inter), np.nan, np.float32)  # rows 0..2 routed, row 3 the shared expert
    dact = cp.asarray(act)
    P.moe_gate_up_fp8(*[cp.asarray(a) for a in (g, gs, u, us)], 128, None, None, cp.asarray(x),
                      dact[3:], 10.0)
    P.moe_gate_up_fp8_numpy(g, gs, u, us, 128, None, None, x, act[3:], 10.0)
    got = cp.asnumpy(dact[3])
    assert np.isnan(got).sum() == 0 and np.isnan(cp.asnumpy(dact[:3])).all()
    assert np.allclose(got, act[3], rtol=1e-4, atol=1e-4 * np.abs(act[3]).max())
    y0 = rng.standard_normal(cols).astype(np.float32)
    dy = cp.asarray(y0)
    P.moe_down_fp8(cp.asarray(d), cp.asarray(ds), 128, None, dact[3:], dy, accumulate=True)
    y = y0.copy()
    P.moe_down_fp8_numpy(d, ds, 128, None, act[3:], y, accumulate=True)
    check(cp, dy, y, np.abs(dw).astype(np.float64) @ np.abs(act[3]) + np.abs(y0))


@on_gpu
def test_dequant_slabs_are_exact_bf16(cp, rng):
    codes, sc, _ = packed_matrix(rng, "fp8", 300, 512)
    out = cp.full((100, 512), 0xFFFF, cp.uint16)
    P.dequant_fp8_bf16(cp.asarray(codes), cp.asarray(sc), 128, out, row0=150)
    want = np.empty((100, 512), np.uint16)
    P.dequant_fp8_bf16_numpy(codes, sc, 128, want, row0=150)
    assert np.array_equal(cp.asnumpy(out), want)
    packed, s4 = experts(rng, "fp4", 3, 64, 256)
    out4 = cp.full((57, 256), 0xFFFF, cp.uint16)
    dp, ds = cp.asarray(packed), cp.asarray(s4)
    P.dequant_fp4_bf16(dp[2], ds[2], out4, row0=7)  # one expert of a stacked tensor
    want4 = np.empty((57, 256), np.uint16)
    P.dequant_fp4_bf16_numpy(packed[2], s4[2], want4, row0=7)
    assert np.array_equal(cp.asnumpy(out4), want4)
    assert np.array_equal(widen(want4), P.dequant_fp4(packed[2], s4[2])[7:])


@on_gpu
def test_packed_kernels_replay_in_a_cuda_graph(cp, rng):
    rows, cols = 512, 2048
    w, sc, _ = packed_matrix(rng, "fp4", rows, cols)
    w8, sc8, _ = packed_matrix(rng, "fp8", rows, cols)
    dw, dsc, dw8, dsc8 = (cp.asarray(a) for a in (w, sc, w8, sc8))
    x = cp.asarray(rng.standard_normal(cols).astype(np.float32))
    y, y8 = cp.zeros(rows, cp.float32), cp.zeros(rows, cp.float32)

    def step():
        P.gemv_fp4(dw, dsc, x, y)
        P.gemv_fp8(dw8, dsc8, 128, x, y8)

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        step()  # eager first: compiles and loads the kernels
        eager = (y.copy(), y8.copy())
        y.fill(0)
        y8.fill(0)
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        x[...] = x * 2
        graph.launch(stream)
    stream.synchronize()
    for got, first in ((y, eager[0]), (y8, eager[1])):
        assert cp.allclose(got, 2 * first, rtol=1e-5, atol=1e-5 * float(cp.abs(first).max()))
