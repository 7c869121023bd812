"""Packed-weight kernels (ds4/kernels/packed.cu): FP8 E4M3 with E8M0 block scales and MXFP4
E2M1 with per-32 E8M0 scales, read in place, and their NumPy twins.

Formats, as the official checkpoint stores them:
- FP8: codes uint8 [out, in], scales uint8 [ceil(out/B), ceil(in/B)] (B = weight_block_size);
  W[r, c] = e4m3(codes[r, c]) * 2^(scales[r // B, c // B] - 127).
- FP4: packed uint8/int8 [out, in/2], two codes per byte (low nibble = even column), scales
  uint8 [out, in/32]; W[r, c] = e2m1(code) * 2^(scales[r, c // 32] - 127).
Stacked experts add a leading [E] axis to both arrays.

Decode launchers (gemv_*, moe_*) allocate nothing and use RawKernels only, so they can be
captured in a CUDA graph; the prefill launchers widen a slab of rows into bf16 words for the
cuBLAS GEMMs. Every launcher has a `*_numpy` twin with the same signature.
"""

from __future__ import annotations

import functools

import numpy as np

from ds4 import kernels
from ds4.kernels import f32, i32, kernel, launch, ptr, to_bf16
from ds4.kernels.moe import _swiglu

WARPS_PER_BLOCK = 8  # fixed: packed.cu sizes each warp's shared-memory slice for 8 warps
TARGET_WARPS = 4096  # warps x splits that keep every SM streaming (as for the bf16 GEMV)
MIN_CHUNKS = 32  # 16-byte chunks per lane-row of a split: fewer leave lanes idle
MAX_BATCH = 8  # vectors per batched GEMV launch
ROWS_PER_WARP = {"fp8": 4, "fp4": 1}  # GEMV rows per warp: best on the H200 (bench_packed)
ROWS_PER_WARP_MOE = 1  # expert kernels: best on the H200 (tools/bench_packed.py)
CHUNK_CODES = {"fp8": 16, "fp4": 32}  # codes in one 16-byte load


def x_bytes(fmt: str, chunks: int) -> int:
    """Shared memory that stages x for this many chunks (padded: conflict-free reads)."""
    return chunks * (CHUNK_CODES[fmt] // 4 + 1) * 16


@functools.cache
def resident_blocks(name: str, shared: int) -> int:
    """Blocks of kernel `name` that fit on the GPU at once (registers and shared memory): the
    size of a persistent grid."""
    return kernels.resident_blocks(kernel("packed", name), 32 * WARPS_PER_BLOCK, shared)


def _e4m3_table() -> np.ndarray:
    """float32 value of each E4M3 (fn) code: bias 7, no infinities, 0x7f/0xff are NaN."""
    c = np.arange(256)
    exp, man = (c >> 3) & 15, c & 7
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = np.where(c & 0x80, -mag, mag)
    val[(c & 0x7F) == 0x7F] = np.nan
    return val.astype(np.float32)


def _e2m1_table() -> np.ndarray:
    """float32 value of each E2M1 code: bias 1, 0.5 the one subnormal."""
    c = np.arange(16)
    exp, man = (c >> 1) & 3, c & 1
    mag = np.where(exp == 0, man * 0.5, (1 + man / 2.0) * 2.0 ** (exp - 1.0))
    return np.where(c & 8, -mag, mag).astype(np.float32)


E4M3 = _e4m3_table()
E2M1 = _e2m1_table()
E8M0 = np.append(np.ldexp(1.0, np.arange(255) - 127), np.nan).astype(np.float32)  # 0: 2^-127


def scale_values(scales) -> np.ndarray:
    """Scales as float32 factors: E8M0 bytes decoded, float32 scales (the -Base file) as is."""
    s = np.asarray(scales)
    if s.dtype == np.float32:
        return s
    return E8M0[s.view(np.uint8)]


def e8m0_codes(scales: np.ndarray) -> np.ndarray:
    """E8M0 bytes of float32 power-of-two scales (what the kernels read); other values raise."""
    s = np.asarray(scales)
    if s.dtype == np.uint8:
        return s
    mant, exp = np.frexp(s.astype(np.float32))
    if not (np.all(mant == 0.5) and np.all((exp >= -126) & (exp <= 128))):
        raise ValueError("scales are not powers of two in the E8M0 range")
    return (exp - 1 + 127).astype(np.uint8)


def dequant_fp8(codes, scales, block: int) -> np.ndarray:
    """float32 W [..., out, in] of E4M3 codes with E8M0 (or float32) scales per block x block."""
    w = E4M3[np.asarray(codes).view(np.uint8)]
    rows, cols = w.shape[-2:]
    need = (-(-rows // block), -(-cols // block))
    s = scale_values(scales)
    if s.shape[-2] < need[0] or s.shape[-1] < need[1]:
        raise ValueError(f"FP8 scales {s.shape} too small for {w.shape} in {block}-blocks")
    s = s[..., :need[0], :need[1]]
    if rows % block == 0 and cols % block == 0:
        lead = w.shape[:-2]
        blocks = w.reshape(*lead, rows // block, block, cols // block, block)
        blocks *= s[..., :, None, :, None]
        return w
    full = np.repeat(np.repeat(s, block, axis=-2)[..., :rows, :], block, axis=-1)[..., :cols]
    w *= full
    return w


def dequant_fp4(packed, scales) -> np.ndarray:
    """float32 W [..., out, in] of MXFP4 bytes [..., out, in/2] with scales [..., out, in/32]."""
    p = np.asarray(packed).view(np.uint8)
    w = np.empty(p.shape[:-1] + (2 * p.shape[-1],), np.float32)
    w[..., 0::2] = E2M1[p & 15]
    w[..., 1::2] = E2M1[p >> 4]
    blocks = w.reshape(*w.shape[:-1], -1, 32)
    blocks *= scale_values(scales)[..., None]
    return w


def _shift(block: int) -> int:
    assert block >= 16 and block & (block - 1) == 0, "the GPU kernels need a power-of-two block"
    return block.bit_length() - 1


def pick_splits(warps: int, chunks: int) -> int:
    """Column splits so short matrices still fill the GPU; each split >= MIN_CHUNKS per lane."""
    splits = 1
    while (warps * splits < TARGET_WARPS and chunks % (2 * splits) == 0
           and chunks // (2 * splits) >= MIN_CHUNKS):
        splits *= 2
    return splits


def _gemv(fmt: str, w, s, sc_ld: int, shift: int, cols: int, x, out, rows_per_group,
          splits, rows_per_warp, accumulate: bool):
    rows = w.shape[0]
    codes = CHUNK_CODES[fmt]
    assert cols % codes == 0 and w.flags.c_contiguous and s.flags.c_contiguous
    nb = 1 if x.ndim == 1 else x.shape[0]
    assert nb <= MAX_BATCH, f"at most {MAX_BATCH} vectors per batched GEMV"
    per_warp = ROWS_PER_WARP[fmt] if nb == 1 else 2
    per_warp = per_warp if rows_per_warp is None else rows_per_warp
    group = rows if rows_per_group is None else rows_per_group
    assert rows_per_group is None or (group % per_warp == 0 and rows % group == 0)
    warps = (rows + per_warp - 1) // per_warp
    splits = pick_splits(warps, cols // codes) if splits is None else splits
    assert (cols // codes) % splits == 0
    if splits > 1 and not accumulate:
        out.fill(0)
    name = f"gemv_{fmt}_r{per_warp}" if nb == 1 else f"gemv_{fmt}_b8"
    if nb > 1:
        assert per_warp == 2, "the batched kernel takes 2 rows per warp"
    x_ld = x.shape[-1]
    blocks, shared = (warps + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK, 0
    if fmt == "fp4" and nb == 1:  # x staged per block, blocks loop over row tiles
        assert rows_per_group is None, "grouped rows are an FP8 (output projection) feature"
        shared = x_bytes(fmt, cols // codes // splits)
        blocks = min(blocks, max(1, resident_blocks(name, shared) // splits))
    args = (ptr(w), ptr(s), i32(rows), i32(cols), i32(sc_ld), i32(shift), ptr(x), np.int64(x_ld),
            i32(group), ptr(out), np.int64(rows), i32(nb), i32(splits), i32(int(accumulate)))
    launch("packed", name, (blocks, splits), (32 * WARPS_PER_BLOCK,), args, shared=shared)
    return out


def gemv_fp8(codes, scales, block: int, x, out, rows_per_group: int | None = None,
             splits: int | None = None, rows_per_warp: int | None = None,
             accumulate: bool = False):
    """out (+)= W x for FP8 W [rows, cols]; x [cols] -> out [rows], or x [nb <= 8, cols] ->
    out [nb, rows]. Row r reads x[..., (r // rows_per_group) * cols:] (grouped projection)."""
    cols = codes.shape[1]
    return _gemv("fp8", codes, scales, scales.shape[-1], _shift(block), cols, x, out,
                 rows_per_group, splits, rows_per_warp, accumulate)


def _gemv_numpy(w, x, out, rows_per_group, accumulate: bool):
    rows, cols = w.shape
    group = rows if rows_per_group is None else rows_per_group
    xs = np.asarray(x, np.float32).reshape(-1, rows // group, cols)
    y = np.einsum("grc,bgc->bgr", w.reshape(rows // group, group, cols), xs).reshape(-1, rows)
    y = y.reshape(out.shape)
    out[...] = out + y if accumulate else y
    return out


def gemv_fp8_numpy(codes, scales, block: int, x, out, rows_per_group: int | None = None,
                   splits: int | None = None, rows_per_warp: int | None = None,
                   accumulate: bool = False):
    """NumPy twin of gemv_fp8."""
    return _gemv_numpy(dequant_fp8(codes, scales, block), x, out, rows_per_group, accumulate)


def gemv_fp4(packed, scales, x, out, rows_per_group: int | None = None,
             splits: int | None = None, rows_per_warp: int | None = None,
             accumulate: bool = False):
    """out (+)= W x for MXFP4 W [rows, cols] (packed [rows, cols/2]); x as in gemv_fp8."""
    cols = 2 * packed.shape[1]
    return _gemv("fp4", packed, scales, scales.shape[-1], 0, cols, x, out, rows_per_group,
                 splits, rows_per_warp, accumulate)


def gemv_fp4_numpy(packed, scales, x, out, rows_per_group: int | None = None,
                   splits: int | None = None, rows_per_warp: int | None = None,
                   accumulate: bool = False):
    """NumPy twin of gemv_fp4."""
    return _gemv_numpy(dequant_fp4(packed, scales), x, out, rows_per_group, accumulate)



def gemv_table_fp8(xp, codes: list, scales: list, outs: list):
    """The device table gemv_many_fp8 reads: (codes, scales, y, rows) per matrix, built once."""
    rows = [c.shape[0] for c in codes]
    entries = [[int(ptr(c)), int(ptr(s)), int(ptr(y)), r]
               for c, s, y, r in zip(codes, scales, outs, rows)]
    return xp.asarray(np.array(entries, dtype=np.int64).reshape(-1))


def gemv_many_fp8(table, codes: list, scales: list, block: int, x, outs: list):
    """outs[m] = W_m x for FP8 matrices of one column count, in one launch (decode's small
    projections of one input). table: gemv_table_fp8(xp, codes, scales, outs)."""
    cols = codes[0].shape[1]
    assert cols % CHUNK_CODES["fp8"] == 0 and all(c.shape[1] == cols for c in codes)
    assert all(s.shape[-1] == -(-cols // block) for s in scales)
    warps = sum((c.shape[0] + 1) // 2 for c in codes)
    grid = ((warps + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK,)
    launch("packed", "gemv_many_fp8", grid, (32 * WARPS_PER_BLOCK,),
           (ptr(table), i32(len(codes)), ptr(x), i32(cols), i32(_shift(block))))
    return outs


def gemv_many_fp8_numpy(table, codes: list, scales: list, block: int, x, outs: list):
    """NumPy twin of gemv_many_fp8 (the table is unused)."""
    for c, s, y in zip(codes, scales, outs):
        y[...] = dequant_fp8(c, s, block) @ x
    return outs

def _stride(a) -> int:
    """Bytes from one stacked expert to the next (0 for a single matrix)."""
    return a.strides[0] if a.ndim == 3 else 0


def _gate_up(fmt: str, gate, gate_s, up, up_s, shift: int, idx, wts, x, act, limit: float,
             rows_per_warp):
    n_rows, inter = act.shape
    cols = x.shape[-1]
    assert cols % CHUNK_CODES[fmt] == 0
    assert _stride(gate) == _stride(up) and _stride(gate_s) == _stride(up_s)
    per_warp = ROWS_PER_WARP_MOE if rows_per_warp is None else rows_per_warp
    name = f"moe_gate_up_{fmt}_r{per_warp}"
    tiles = -(-inter // (per_warp * WARPS_PER_BLOCK))
    shared = x_bytes(fmt, cols // CHUNK_CODES[fmt])
    blocks = min(n_rows * tiles, resident_blocks(name, shared))
    args = (ptr(gate), ptr(gate_s), ptr(up), ptr(up_s), np.int64(_stride(gate)),
            np.int64(_stride(gate_s)), ptr(idx), ptr(wts), ptr(x), ptr(act), i32(inter),
            i32(cols), i32(gate_s.shape[-1]), i32(shift), f32(limit), i32(n_rows))
    launch("packed", name, (blocks,), (32 * WARPS_PER_BLOCK,), args, shared=shared)
    return act


def _down(fmt: str, down, down_s, shift: int, idx, act, out, accumulate: bool, rows_per_warp):
    n_sel, inter = act.shape
    rows = out.shape[0]
    assert inter % CHUNK_CODES[fmt] == 0
    per_warp = ROWS_PER_WARP_MOE if rows_per_warp is None else rows_per_warp
    name = f"moe_down_{fmt}_r{per_warp}"
    tiles = -(-rows // (per_warp * WARPS_PER_BLOCK))
    shared = x_bytes(fmt, n_sel * inter // CHUNK_CODES[fmt])
    blocks = min(tiles, resident_blocks(name, shared))
    args = (ptr(down), ptr(down_s), np.int64(_stride(down)), np.int64(_stride(down_s)),
            ptr(idx), ptr(act), ptr(out), i32(rows), i32(inter), i32(down_s.shape[-1]),
            i32(shift), i32(n_sel), i32(int(accumulate)))
    launch("packed", name, (blocks,), (32 * WARPS_PER_BLOCK,), args, shared=shared)
    return out


def moe_gate_up_fp4(gate, gate_scale, up, up_scale, idx, wts, x, act, limit: float,
                    rows_per_warp: int | None = None):
    """act[k] = silu(min(gate_e x, limit)) * clamp(up_e x, +-limit) * wts[k], e = idx[k], for
    MXFP4 experts gate/up [E, inter, cols/2] (scales [E, inter, cols/32]), or one expert
    [inter, cols/2] with idx None; wts None means weight 1. limit <= 0: no clamps."""
    return _gate_up("fp4", gate, gate_scale, up, up_scale, 0, idx, wts, x, act, limit,
                    rows_per_warp)


def moe_gate_up_fp8(gate, gate_scale, up, up_scale, block: int, idx, wts, x, act,
                    limit: float, rows_per_warp: int | None = None):
    """moe_gate_up_fp4 for FP8 experts [E, inter, cols] or one (the shared expert: idx and wts
    None, act a one-row view such as act[n_sel:])."""
    return _gate_up("fp8", gate, gate_scale, up, up_scale, _shift(block), idx, wts, x, act,
                    limit, rows_per_warp)


def _expert(w, idx, k):
    return w if idx is None else w[int(np.asarray(idx)[k])]


def _gate_up_numpy(widen_one, gate, gate_s, up, up_s, idx, wts, x, act, limit: float):
    for k in range(act.shape[0]):
        g = widen_one(_expert(gate, idx, k), _expert(gate_s, idx, k)) @ x
        u = widen_one(_expert(up, idx, k), _expert(up_s, idx, k)) @ x
        act[k] = _swiglu(g, u, limit) * (1.0 if wts is None else np.asarray(wts)[k])
    return act


def moe_gate_up_fp4_numpy(gate, gate_scale, up, up_scale, idx, wts, x, act, limit: float,
                          rows_per_warp: int | None = None):
    """NumPy twin of moe_gate_up_fp4."""
    return _gate_up_numpy(dequant_fp4, gate, gate_scale, up, up_scale, idx, wts, x, act, limit)


def moe_gate_up_fp8_numpy(gate, gate_scale, up, up_scale, block: int, idx, wts, x, act,
                          limit: float, rows_per_warp: int | None = None):
    """NumPy twin of moe_gate_up_fp8."""
    def widen_one(c, s):
        return dequant_fp8(c, s, block)

    return _gate_up_numpy(widen_one, gate, gate_scale, up, up_scale, idx, wts, x, act, limit)


def moe_down_fp4(down, down_scale, idx, act, out, accumulate: bool = False,
                 rows_per_warp: int | None = None):
    """out (+)= sum_k down_e act[k], e = idx[k], for MXFP4 experts down [E, rows, inter/2]
    (scales [E, rows, inter/32]); the routing weights are already in act (moe_gate_up_fp4)."""
    return _down("fp4", down, down_scale, 0, idx, act, out, accumulate, rows_per_warp)


def moe_down_fp8(down, down_scale, block: int, idx, act, out, accumulate: bool = False,
                 rows_per_warp: int | None = None):
    """moe_down_fp4 for FP8 experts [E, rows, inter] or one (the shared expert: idx None, act
    its one row, accumulate=True to add it to the routed sum)."""
    return _down("fp8", down, down_scale, _shift(block), idx, act, out, accumulate,
                 rows_per_warp)


def _down_numpy(widen_one, down, down_s, idx, act, out, accumulate: bool):
    total = sum(widen_one(_expert(down, idx, k), _expert(down_s, idx, k)) @ act[k]
                for k in range(act.shape[0]))
    out[...] = (out if accumulate else 0) + total
    return out


def moe_down_fp4_numpy(down, down_scale, idx, act, out, accumulate: bool = False,
                       rows_per_warp: int | None = None):
    """NumPy twin of moe_down_fp4."""
    return _down_numpy(dequant_fp4, down, down_scale, idx, act, out, accumulate)


def moe_down_fp8_numpy(down, down_scale, block: int, idx, act, out, accumulate: bool = False,
                       rows_per_warp: int | None = None):
    """NumPy twin of moe_down_fp8."""
    def widen_one(c, s):
        return dequant_fp8(c, s, block)

    return _down_numpy(widen_one, down, down_scale, idx, act, out, accumulate)


def _dequant(fmt: str, w, s, shift: int, cols: int, out, row0: int):
    n = out.shape[0]
    assert out.shape[1] == cols and out.flags.c_contiguous and row0 + n <= w.shape[0]
    chunks = n * cols // CHUNK_CODES[fmt]
    blocks = max(1, min((chunks + 255) // 256, 132 * 16))
    args = (ptr(w), ptr(s), i32(cols), i32(s.shape[-1]), i32(shift), i32(row0), i32(n), ptr(out))
    launch("packed", f"dequant_{fmt}_bf16", (blocks,), (256,), args)
    return out


def dequant_fp8_bf16(codes, scales, block: int, out, row0: int = 0):
    """out [n, cols] = bf16 words of rows row0 .. row0 + n of an FP8 matrix (exact), the
    slab a bf16 GEMM multiplies without a widened copy of the whole layer."""
    return _dequant("fp8", codes, scales, _shift(block), codes.shape[1], out, row0)


def dequant_fp8_bf16_numpy(codes, scales, block: int, out, row0: int = 0):
    """NumPy twin of dequant_fp8_bf16."""
    start, stop = row0 // block * block, row0 + out.shape[0]
    slab = dequant_fp8(codes[start:stop], scales[start // block:], block)
    out[...] = to_bf16(slab[row0 - start:])
    return out


def dequant_fp4_bf16(packed, scales, out, row0: int = 0):
    """out [n, cols] = bf16 words of rows row0 .. row0 + n of an MXFP4 matrix or expert."""
    return _dequant("fp4", packed, scales, 0, 2 * packed.shape[1], out, row0)


def dequant_fp4_bf16_numpy(packed, scales, out, row0: int = 0):
    """NumPy twin of dequant_fp4_bf16."""
    stop = row0 + out.shape[0]
    out[...] = to_bf16(dequant_fp4(packed[row0:stop], scales[row0:stop]))
    return out
