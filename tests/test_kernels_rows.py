"""Batched tensor-core products (ds4/kernels/rows.py): the code-to-bf16 bit moves, the NumPy
twins against the dequantized references on CPU, and on the GPU each kernel against its twin at
V4-Flash shapes, row b of a batch bitwise equal to the row alone (the MoE's:
test_kernels_rows_moe.py)."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.backend import cuda_available
from ds4.kernels import packed as P
from ds4.kernels import rows as R
from ds4.kernels import to_bf16, widen
from ds4.model.packed import FP4, FP8, PackedMatrix

TOL = 1e-5  # of |W| |x|: the hi + lo split keeps 16 bits of x


def fp8_matrix(rng, shape, block=128, lo=112, hi=132) -> PackedMatrix:
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3F  # no NaN codes
    rows, cols = shape[-2:]
    sshape = (*shape[:-2], -(-rows // block), -(-cols // block))
    return PackedMatrix(FP8, codes, rng.integers(lo, hi, sshape, dtype=np.uint8), cols,
                        (block, block))


def fp4_matrix(rng, shape, lo=112, hi=132) -> PackedMatrix:
    *lead, rows, cols = shape
    codes = rng.integers(0, 256, (*lead, rows, cols // 2), dtype=np.uint8)
    return PackedMatrix(FP4, codes, rng.integers(lo, hi, (*lead, rows, cols // 32),
                                                 dtype=np.uint8), cols)


def bf16_matrix(rng, shape) -> np.ndarray:
    return to_bf16(rng.standard_normal(shape, dtype=np.float32) * 0.05).reshape(shape)


MAKERS = {FP8: fp8_matrix, FP4: fp4_matrix, "bf16": lambda rng, s: bf16_matrix(rng, s)}


def gpu_test(fn):
    """A test that needs CuPy and a CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not cuda_available(),
                                              reason="needs CuPy and a CUDA device")(fn))


def bound(wd: np.ndarray, x: np.ndarray) -> np.ndarray:
    """TOL of |W| |x| per output: what a 16-bit x and fp32 sums can promise."""
    return TOL * (np.abs(x) @ np.abs(wd).T) + 1e-30


def grouped_dense(wd, x, group):
    rows, cols = wd.shape
    return np.concatenate([x[:, g * cols:(g + 1) * cols] @ wd[g * group:(g + 1) * group].T
                           for g in range(rows // group)], axis=1)


# --- the bit moves (CPU emulation of what rows_formats.cuh does with integers) ---

def test_e2m1_nibble_bits_are_its_value_times_2_pow_minus_126():
    n = np.arange(16, dtype=np.uint32)
    bits = ((n & 8) << 12) | ((n & 7) << 6)
    value = widen(bits.astype(np.uint16)).astype(np.float64)
    assert np.array_equal(value * 2.0 ** 126, P.E2M1.astype(np.float64))


def test_e4m3_byte_bits_are_its_value_times_2_pow_minus_120():
    c = np.arange(256, dtype=np.uint32)
    ok = (c & 0x7F) != 0x7F
    bits = ((c & 0x80) << 8) | ((c & 0x7F) << 4)
    value = widen(bits.astype(np.uint16)).astype(np.float64)
    assert np.array_equal((value * 2.0 ** 120)[ok], P.E4M3[ok].astype(np.float64))


@pytest.mark.parametrize("fmt,bias,table", [(FP4, 94, P.E2M1), (FP8, 88, P.E4M3)])
def test_scaled_code_is_an_exact_bf16_weight_times_2_pow_minus_32(fmt, bias, table):
    """decoded * 2^(s + bias - 127) = code * 2^(s - 127) * 2^-32 and is a bf16 value, for the
    scales a checkpoint can hold (rows_formats.cuh's multiplier)."""
    vals = table[np.isfinite(table)].astype(np.float64)
    for s in range(60, 150):
        w = vals * 2.0 ** (s - 127) * 2.0 ** -32
        assert np.array_equal(widen(to_bf16(w.astype(np.float32))).astype(np.float64), w)
        assert s + bias <= 254


def test_f16_split_keeps_each_k_tile_to_2_pow_minus_23_of_its_largest():
    """FP8H's x (rows.split_f16): a power of two per 64-column k-tile, so tiles 1e-30 and 1e30
    apart keep the same precision; an all-zero tile stays zero."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 64 * 8), dtype=np.float32)
    x *= (10.0 ** rng.integers(-30, 30, (3, 8))).repeat(64, axis=1).astype(np.float32)
    x[1, 64:128] = 0
    got = R.split_f16(x)
    big = np.abs(x).reshape(3, 8, 64).max(-1).repeat(64, axis=1).astype(np.float64)
    assert np.all(np.abs(got - x) <= big * 2.0 ** -23)
    assert np.all(got[1, 64:128] == 0)


# --- twins against the dequantized references ---

@pytest.mark.parametrize("fmt,shape", [(FP8, (100, 192)), (FP8, (48, 512)), (FP8, (40, 80)),
                                       (FP4, (37, 96)), (FP4, (64, 256)), ("bf16", (50, 80))])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_matvec_twin_matches_dequantized_product(fmt, shape, batch):
    rng = np.random.default_rng(shape[0] + batch)
    w = MAKERS[fmt](rng, shape)
    x = rng.standard_normal((batch, shape[1]), dtype=np.float32)
    y = np.zeros((batch, shape[0]), np.float32)
    R.matvec_numpy(w, x, y, batch)
    wd = R.dense(w)
    assert np.all(np.abs(y - x @ wd.T) <= bound(wd, x))


def test_matvec_twin_of_grouped_rows_reads_each_groups_slice():
    rng = np.random.default_rng(1)
    w = fp8_matrix(rng, (256, 128), block=32)
    x = rng.standard_normal((4, 4 * 128), dtype=np.float32)
    y = np.zeros((4, 256), np.float32)
    R.matvec_numpy(w, x, y, 4, rows_per_group=64)
    ref = grouped_dense(R.dense(w), x, 64)
    assert np.allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_fp32_weights_twin_is_the_plain_product():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((40, 64), dtype=np.float32)
    x = rng.standard_normal((2, 64), dtype=np.float32)
    y = np.zeros((2, 40), np.float32)
    R.matvec_numpy(w, x, y, 2)
    assert np.allclose(y, x @ w.T, rtol=1e-6, atol=1e-5)


def test_many_twin_equals_each_matvec():
    rng = np.random.default_rng(3)
    ws = [fp8_matrix(rng, (64, 256)), bf16_matrix(rng, (32, 256)), fp4_matrix(rng, (16, 256))]
    buf = np.zeros((3, 200), np.float32)
    outs = [buf[:, :64], buf[:, 64:96], buf[:, 100:116]]
    plan = R.matvec_plan(np, ws, outs)
    x = rng.standard_normal((3, 256), dtype=np.float32)
    R.matvec_many_numpy(plan, x, 3)
    for w, o in zip(ws, outs):
        one = np.zeros((3, o.shape[1]), np.float32)
        R.matvec_numpy(w, x, one, 3)
        assert np.array_equal(o, one)


# --- GPU: kernels against twins, batch-invariance, graphs ---

V4_MATVEC = {  # name: (format, rows, cols, rows_per_group)
    "q_a": (FP8, 1024, 4096, None), "q_b": (FP8, 32768, 1024, None),
    "kv": (FP8, 512, 4096, None), "o_a": (FP8, 8192, 4096, 1024),
    "o_b": (FP8, 4096, 8192, None), "router": ("bf16", 256, 4096, None),
    "shared_gate": (FP8, 2048, 4096, None), "shared_down": (FP8, 4096, 2048, None),
    "expert_w1": (FP4, 2048, 4096, None), "expert_w2": (FP4, 4096, 2048, None),
    "odd_fp8": (FP8, 100, 192, None), "ragged_fp8": (FP8, 40, 80, None),
    "odd_fp4": (FP4, 37, 96, None),
    "odd_bf16": ("bf16", 50, 80, None),
}


def on_device(cp, w):
    if isinstance(w, PackedMatrix):
        return PackedMatrix(w.fmt, cp.asarray(w.codes), cp.asarray(w.scale), w.shape[-1],
                            w.block)
    return cp.asarray(w)


def device_case(cp, name, seed=0):
    fmt, rows, cols, group = V4_MATVEC[name]
    rng = np.random.default_rng(seed)
    w = MAKERS[fmt](rng, (rows, cols))
    width = cols * (rows // group if group else 1)
    x = rng.standard_normal((8, width), dtype=np.float32)
    return w, on_device(cp, w), x, group


@gpu_test
@pytest.mark.parametrize("name", list(V4_MATVEC))
def test_matvec_kernel_matches_twin_and_reference(name):
    import cupy as cp

    w, wd_dev, x, group = device_case(cp, name)
    rows = w.shape[0]
    wd = R.dense(w)
    ref = grouped_dense(wd, x, group) if group else x @ wd.T
    twin = np.zeros((8, rows), np.float32)
    R.matvec_numpy(w, x, twin, 8, rows_per_group=group)
    scale = (np.abs(x) @ np.abs(wd).T) if not group else grouped_dense(np.abs(wd), np.abs(x),
                                                                       group)
    for batch in (1, 3, 4, 8):
        y = cp.zeros((batch, rows), cp.float32)
        R.matvec(wd_dev, cp.asarray(x[:batch]), y, batch, rows_per_group=group)
        got = y.get()
        assert np.all(np.abs(got - twin[:batch]) <= TOL * scale[:batch] + 1e-30), name
        assert np.all(np.abs(got - ref[:batch]) <= TOL * scale[:batch] + 1e-30), name


@gpu_test
@pytest.mark.parametrize("name", ["q_a", "o_a", "o_b", "router", "expert_w1", "ragged_fp8",
                                  "odd_fp4", "odd_bf16"])
def test_matvec_row_is_bitwise_the_same_in_any_batch(name):
    import cupy as cp

    _, w, x, group = device_case(cp, name, seed=5)
    xd = cp.asarray(x)
    rows = w.shape[0]
    alone = cp.zeros((8, rows), cp.float32)
    for b in range(8):
        R.matvec(w, xd[b:b + 1], alone[b:b + 1], 1, rows_per_group=group)
    for batch in (2, 4, 5, 8):
        y = cp.zeros((batch, rows), cp.float32)
        R.matvec(w, xd[:batch], y, batch, rows_per_group=group)
        assert cp.array_equal(y, alone[:batch]), (name, batch)


@gpu_test
@pytest.mark.parametrize("name", list(V4_MATVEC))
def test_x_split_once_a_block_in_shared_memory_keeps_every_bit(name, monkeypatch):
    """The staged kernels (x split once a block into shared memory) feed the mmas the words
    each warp made for itself before: the same outputs bit for bit, at every batch size (staged
    wherever x fits, not only where the decoder stages it), with a zero k-tile (its power from
    the floor exponent) and x rows wider apart than K."""
    import cupy as cp

    monkeypatch.setattr(R, "STAGE_BATCH", 8)
    _, w, x, group = device_case(cp, name, seed=9)
    x[2, :64] = 0.0
    xd = cp.zeros((8, x.shape[1] + 64), cp.float32)[:, :x.shape[1]]
    xd[...] = cp.asarray(x)
    rows = w.shape[0]
    op = R.operand(w)
    for batch in (1, 3, 5, 8):
        used = R.matvec_kernel(op, batch, group or rows)[3]
        got = {}
        for on in (False, True):
            monkeypatch.setattr(R, "STAGE_X", on)
            got[on] = cp.zeros((batch, rows), cp.float32)
            R.matvec(w, xd, got[on], batch, rows_per_group=group)
        assert cp.array_equal(got[True], got[False]), (name, batch)
        if name in ("q_b", "o_a", "o_b", "router", "ragged_fp8") and batch <= 3:
            assert used > 0, name  # (the staged kernel ran)


@gpu_test
@pytest.mark.parametrize("fmt", [FP8, FP4])
@pytest.mark.parametrize("tiles", [(1, 4), (2, 2), (1, 8), (2, 4), (4, 2)])
def test_every_kernel_variant_matches_twin_and_sums_alike(fmt, tiles):
    """Tiles per warp and k-tiles per stage change the schedule, never a row's sum order."""
    import cupy as cp

    rng = np.random.default_rng(13)
    w = MAKERS[fmt](rng, (1000, 1024))
    x = rng.standard_normal((8, 1024), dtype=np.float32)
    twin = np.zeros((8, 1000), np.float32)
    R.matvec_numpy(w, x, twin, 8)
    wdev, xd = on_device(cp, w), cp.asarray(x)
    for batch in (3, 8):
        y, base = (cp.zeros((batch, 1000), cp.float32) for _ in range(2))
        R.matvec(wdev, xd, y, batch, tiles=tiles, split=2)
        R.matvec(wdev, xd, base, batch, tiles=(1, 4), split=2)
        assert np.all(np.abs(y.get() - twin[:batch]) <= bound(R.dense(w), x[:batch]))
        assert cp.array_equal(y, base)


@gpu_test
@pytest.mark.parametrize("fmt,block", [(FP8, 32), (FP8, 128), (FP4, None)])
def test_decoded_words_are_exact_weights(fmt, block):
    """The integer bit moves and the bf16x2 multiply on the device (subnormal codes too): the
    fed words are the weights times 2^-32, bit for bit, over the whole scale range; FP8 in
    tiles of 128 feeds each code's own value in f16 (cvt.rn.f16x2.e4m3x2), also bit for bit."""
    import cupy as cp

    rng = np.random.default_rng(6)
    w = (fp8_matrix(rng, (256, 512), block=block, lo=60, hi=150) if fmt == FP8
         else fp4_matrix(rng, (256, 512), lo=60, hi=150))
    out = cp.zeros((256, 512), cp.uint16)
    R.decode_words(on_device(cp, w), out)
    want = np.zeros((256, 512), np.uint16)
    R.decode_words_numpy(w, want)
    assert np.array_equal(out.get(), want)


@gpu_test
def test_many_matches_twin_and_single_launches(monkeypatch):
    """One launch for several matrices of one x: each output the matrix's own launch's bits,
    with x split once a block in shared memory (rows_many_n*_sx) or in each warp."""
    import cupy as cp

    rng = np.random.default_rng(7)
    ws = [fp8_matrix(rng, (1024, 4096)), fp8_matrix(rng, (512, 4096)),
          bf16_matrix(rng, (1024, 4096)), bf16_matrix(rng, (64, 4096)),
          rng.standard_normal((48, 4096), dtype=np.float32)]
    dev = [on_device(cp, w) for w in ws]
    x = rng.standard_normal((8, 4096), dtype=np.float32)
    xd = cp.asarray(x)
    for batch in (1, 3, 6):
        buf = cp.zeros((batch, 3000), cp.float32)
        widths = [w.shape[0] for w in ws]
        starts = np.cumsum([0] + widths)
        outs = [buf[:, s:s + n] for s, n in zip(starts, widths)]
        plan = R.matvec_plan(cp, dev, outs)
        monkeypatch.setattr(R, "STAGE_X", False)
        R.matvec_many(plan, xd, batch)
        apart = buf.copy()
        monkeypatch.setattr(R, "STAGE_X", True)
        monkeypatch.setattr(R, "STAGE_BATCH", 8)
        assert plan.staged(batch) > 0 or batch > 4
        R.matvec_many(plan, xd, batch)
        assert cp.array_equal(buf, apart), batch
        for w, wdev, o in zip(ws, dev, outs):
            one = cp.zeros((batch, o.shape[1]), cp.float32)
            R.matvec(wdev, xd[:batch], one, batch)
            assert cp.array_equal(o, one)
            twin = np.zeros((batch, o.shape[1]), np.float32)
            R.matvec_numpy(w, x[:batch], twin, batch)
            wd = R.dense(w)
            assert np.all(np.abs(o.get() - twin) <= bound(wd, x[:batch]))
