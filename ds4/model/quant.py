"""FP8/FP4 rounding (docs/MODEL.md, Quantization simulation) and FP8/FP4 weight decoding."""

from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _round_float(xp, x, mantissa_bits: int, min_exponent: int, max_value: float):
    """Nearest value of a small float format (ties to even), saturating at max_value."""
    mag = xp.minimum(xp.abs(x), max_value)
    _, exp = xp.frexp(mag)  # mag = m * 2**exp with m in [0.5, 1)
    exp = xp.maximum(exp - 1, min_exponent)
    step = xp.ldexp(xp.ones_like(mag), exp - mantissa_bits)
    rounded = xp.minimum(xp.rint(mag / step) * step, max_value)
    return xp.copysign(rounded, x).astype(x.dtype)


def round_e4m3(xp, x):
    """Round to the nearest FP8 E4M3 value (clamped to +-448)."""
    return _round_float(xp, x, 3, -6, E4M3_MAX)


def round_e2m1(xp, x):
    """Round to the nearest FP4 E2M1 value {0,.5,1,1.5,2,3,4,6} (clamped to +-6)."""
    return _round_float(xp, x, 1, 0, E2M1_MAX)


def _block_scale(xp, amax, max_value: float):
    """Power-of-two scale 2^ceil(log2(amax / max_value)), as the official kernels pick it."""
    return xp.exp2(xp.ceil(xp.log2(amax / max_value)))


def _round_blocks(xp, x, block: int, rounder, max_value: float, floor: float):
    """Round trip of the last axis in blocks of `block` channels, each scaled by a power of two
    so its largest magnitude (at least `floor`) fits the format's max_value."""
    shape = x.shape
    blocks = x.reshape(*shape[:-1], shape[-1] // block, block)
    amax = xp.maximum(xp.abs(blocks).max(axis=-1, keepdims=True), floor)
    scale = _block_scale(xp, amax, max_value).astype(x.dtype)
    return (rounder(xp, blocks / scale) * scale).reshape(shape)


def fp8_round_blocks(xp, x, block: int = 64):
    """FP8 round trip of the last axis in blocks of `block` channels (official KV rounding)."""
    return _round_blocks(xp, x, block, round_e4m3, E4M3_MAX, 1e-4)


def fp4_round_blocks(xp, x, block: int = 32):
    """FP4 round trip of the last axis in blocks of `block` channels (indexer QAT)."""
    return _round_blocks(xp, x, block, round_e2m1, E2M1_MAX, 1e-30)


def hadamard(n: int) -> np.ndarray:
    """Normalised Sylvester Hadamard matrix of order n (a power of two), fp32."""
    if n & (n - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {n}")
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def kv_fp8_simulation(xp, rows, rope_dim: int):
    """Official KV rounding: FP8 round trip of the non-rope channels, rope slice untouched."""
    nope = rows.shape[-1] - rope_dim
    if xp is not np and nope <= 1024:  # one kernel, the same float ops (ds4/kernels/quant.cu)
        from ds4.kernels.quant import kv_fp8_rows

        out = xp.array(rows, dtype=xp.float32, order="C")
        kv_fp8_rows(out.reshape(-1, out.shape[-1]), nope)
        return out
    out = rows.copy()
    out[..., :nope] = fp8_round_blocks(xp, rows[..., :nope], 64 if nope % 64 == 0 else nope)
    return out


def indexer_fp4_simulation(xp, rows, hadamard_matrix):
    """Official indexer QAT: Hadamard rotation, then FP4 round trip in 32-blocks.

    On CuPy one kernel does both (the decode graph's hadamard_fp4, a fast Walsh-Hadamard
    transform of the same Sylvester matrix): the matmul and ~15 array passes over a prefill
    chunk's [tokens, heads, dim] queries held 0.33 s of a 16k prompt (docs/PERF.md). Its sums
    run in another order, so a value within float noise of an FP4 boundary may round the
    other way, as between the decode graph and NumPy already."""
    width = rows.shape[-1]
    if xp is not np and width == hadamard_matrix.shape[0] and width <= 1024:
        from ds4.kernels.quant import hadamard_fp4

        out = xp.array(rows, dtype=xp.float32, order="C")
        hadamard_fp4(out.reshape(-1, width), None)
        return out
    rotated = rows @ hadamard_matrix
    block = 32 if rows.shape[-1] % 32 == 0 else rows.shape[-1]
    return fp4_round_blocks(xp, rotated, block)


# ---- checkpoint weight formats (host NumPy; weights are decoded once at load or per use)

def _e4m3_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    normal = (1 + man / 8.0) * np.exp2(exp - 7.0)
    sub = (man / 8.0) * np.exp2(-6.0)
    value = sign * np.where(exp == 0, sub, normal)
    value[(codes & 0x7F) == 0x7F] = np.nan
    return value.astype(np.float32)


E4M3_TABLE = _e4m3_table()
FP4_TABLE = np.array(FP4_VALUES + tuple(-v for v in FP4_VALUES), dtype=np.float32)


def e8m0_to_float(codes: np.ndarray) -> np.ndarray:
    """F8_E8M0 scale bytes to their power-of-two values 2^(byte-127)."""
    return np.exp2(codes.astype(np.float32) - 127.0)


def dequant_fp8_weight(codes: np.ndarray, scale: np.ndarray, block=128) -> np.ndarray:
    """W[r,c] = e4m3(code[r,c]) * scale[r//br, c//bc] as fp32 (block: br = bc, or (br, bc))."""
    br, bc = (block, block) if isinstance(block, int) else block
    w = E4M3_TABLE[codes.view(np.uint8)]
    s = scale if scale.dtype == np.float32 else e8m0_to_float(scale.view(np.uint8))
    s = np.repeat(np.repeat(s, br, axis=0), bc, axis=1)[: w.shape[0], : w.shape[1]]
    return w * s


def dequant_fp4_weight(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Two E2M1 codes per byte (low nibble = even column) times a per-32-column scale."""
    b = packed.view(np.uint8)
    w = np.empty((b.shape[0], b.shape[1] * 2), dtype=np.float32)
    w[:, 0::2] = FP4_TABLE[b & 0xF]
    w[:, 1::2] = FP4_TABLE[b >> 4]
    s = scale if scale.dtype == np.float32 else e8m0_to_float(scale.view(np.uint8))
    return w * np.repeat(s, w.shape[1] // s.shape[1], axis=1)
