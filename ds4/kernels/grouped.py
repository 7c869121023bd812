"""Grouped expert GEMMs on packed weights (ds4/kernels/grouped.cu, and grouped_wg.cu on
wgmma where the device is compute capability 9.0), launchers and NumPy twins.

Prefill's routed experts in five launches per layer, whatever the number of experts hit: the
activations as bf16 hi/lo words (split_words), a tile table of the rows grouped by expert
(expert_tiles), gate/up with the clamped SwiGLU and the routing weight (one launch over every
expert's rows), down with the scatter to (token, pick) rows, and the sum of each token's picks
in a fixed order (slot_sum). The weights are read as stored, FP4 or FP8 codes and E8M0 scales.
"""

from __future__ import annotations

import os

import numpy as np

from ds4.kernels import builds_here, f32, i32, launch, ptr, shared_limits, to_bf16, widen
from ds4.kernels.moe import _swiglu
from ds4.kernels.packed import dequant_fp4, dequant_fp8

BK = 128  # columns per stage
UNITS = 64  # 8-byte units of words per row and stage
THREADS = 256
NT = {"fp4": 8, "fp8": 4}  # n8 tiles per warp
STAGES = 3
# Kernel variants besides the default (NT above, STAGES): FP4 only, name suffix -> (n8 tiles per
# warp, stages, m16 tile counts built)
VARIANTS = {"s4": (8, 4, (1, 2))}
# (fmt, pick_mt's m16 tiles) -> (m16 tiles, variant) routed() launches, where measured faster
# than the default shape (tools/bench_grouped.py)
TUNED: dict[tuple[str, int], tuple[int, str]] = {}
MAX_MT = 4  # m16 tiles per block: tiles of up to 64 rows
# E8M0 bytes whose folded bf16 factor stays finite: 2^(s - 127) * 2^126 (FP4), * 2^120 (FP8)
MAX_SCALE = {"fp4": 128, "fp8": 134}
PAIRS = ((0, 4, 1, 5), (2, 6, 3, 7))  # columns (of 8) of a unit's words, per half h
# grouped_wg.cu (wgmma, compute capability 9.0; FP4): 16-byte pieces of one row's words per
# stage (8 k-steps x hi, lo x 2), weight rows per block, dynamic shared memory (3 stages of 64
# tokens' words and the block's FP4 codes); DS4_WGMMA=0 keeps to the mma.sync kernels
WG_PIECES, WG_ROWS = 32, 512
WG_MIN_MT = 2  # routed() takes them from pick_mt 2 (chunk 768+ at full size: measured faster)
WG_SHARED = 3 * (8 * 2 * 2 * 64 * 16 + WG_ROWS * 64)
WGMMA = os.environ.get("DS4_WGMMA", "1") != "0"


def stages(cols: int) -> int:
    """128-column stages covering cols."""
    return -(-cols // BK)


def shape(fmt: str, variant: str = "") -> tuple[int, int]:
    """(n8 tiles per warp, pipeline stages) of a kernel variant."""
    return VARIANTS[variant][:2] if variant else (NT[fmt], STAGES)


def block_rows(fmt: str, variant: str = "") -> int:
    """Weight rows one block multiplies (gate/up: half gate, half up)."""
    return 8 * 8 * shape(fmt, variant)[0]


def shared_bytes(fmt: str, mt: int, variant: str = "") -> int:
    """Dynamic shared memory of a GEMM launch: stages x (activation words + weight codes)."""
    row_bytes = 64 if fmt == "fp4" else 128
    return shape(fmt, variant)[1] * (16 * mt * UNITS * 8 + block_rows(fmt, variant) * row_bytes)


def pick_mt(rows: int, experts: int) -> int:
    """m16 tiles per block: enough for an expert's rows at the mean plus one standard deviation
    of uniform routing (mean 48 at chunk 2048: 4 tiles; 12 at chunk 512: 1), so most experts
    fit one tile and few tiles run nearly empty."""
    mean = rows / max(1, experts)
    return int(min(MAX_MT, max(1, np.ceil((mean + np.sqrt(mean)) / 16))))


def max_tiles(rows: int, experts: int, bm: int) -> int:
    """An upper bound on the table's tiles: every expert hit may end on a partial tile."""
    return max(1, -(-(rows + min(experts, rows) * (bm - 1)) // bm))


def split_words(x, words, parts: int = 2):
    """words [rows, stages * UNITS, 2] (uint32) of x [rows, cols] fp32: hi (and lo) bf16 words
    in the fragments' order, zeros past cols."""
    assert x.shape[1] % 8 == 0
    return _split(("grouped", "split_words"), x, words, parts)


def _split(kernel: tuple[str, str], x, words, parts: int):
    """Launch a split kernel (family, name): one thread per (row, stage, k-step pair)."""
    rows, cols = x.shape
    assert x.flags.c_contiguous and x.dtype == np.float32
    n = rows * stages(cols) * 16
    blocks = max(1, min(-(-n // THREADS), 132 * 32))
    launch(*kernel, (blocks,), (THREADS,),
           (ptr(x), np.int64(cols), i32(rows), i32(cols), i32(stages(cols)), i32(parts),
            ptr(words)))
    return words


def _unit(j: int, h: int, hl: int, t: int) -> int:
    return ((j * 2 + h) * 2 + hl) * 4 + t


def _hi_lo(x, parts: int):
    """bf16 words of x [rows, cols] padded with zeros to whole stages: (hi, lo), lo zeros when
    parts == 1 (what the split kernels write, in column order)."""
    rows, cols = x.shape
    padded = np.zeros((rows, stages(cols) * BK), np.float32)
    padded[:, :cols] = x
    hi = to_bf16(padded)
    return hi, (to_bf16(padded - widen(hi)) if parts == 2 else np.zeros_like(hi))


def split_words_numpy(x, words, parts: int = 2):
    """NumPy twin of split_words."""
    rows = x.shape[0]
    hi, lo = _hi_lo(x, parts)
    out = words.reshape(rows, -1, UNITS, 2)
    for j in range(4):
        for h in range(2):
            for t in range(4):
                c = 32 * t + 8 * j
                for hl, w in enumerate((hi, lo)):
                    for half in range(2):
                        a = PAIRS[h][2 * half]
                        cols_a = w[:, c + a::BK].astype(np.uint32)
                        cols_b = w[:, c + a + 4::BK].astype(np.uint32)
                        out[:, :, _unit(j, h, hl, t), half] = cols_a | (cols_b << 16)
    return words


def words_values(words, cols: int):
    """fp32 [rows, cols] of hi + lo as the GEMMs read them (the inverse of split_words, or of
    split_words_wg for words in wgmma order)."""
    if words.shape[-1] == 4:
        return _wg_values(words, cols)
    w = np.asarray(words).reshape(words.shape[0], -1, UNITS, 2)
    rows, n_st = w.shape[:2]
    total = np.zeros((rows, n_st * BK), np.float32)
    for j in range(4):
        for h in range(2):
            for t in range(4):
                c = 32 * t + 8 * j
                for hl in range(2):
                    for half in range(2):
                        a = PAIRS[h][2 * half]
                        u = w[:, :, _unit(j, h, hl, t), half]
                        total[:, c + a::BK] += widen((u & 0xFFFF).astype(np.uint16))
                        total[:, c + a + 4::BK] += widen((u >> 16).astype(np.uint16))
    return total[:, :cols]


def new_words(xp, rows: int, cols: int, wg: bool = False):
    """An empty words buffer for rows x cols activations: mma.sync order [rows, stages * UNITS,
    2], or wgmma order [rows, stages * WG_PIECES, 4] (wg); the last axis tells them apart."""
    if wg:
        return xp.empty((rows, stages(cols) * WG_PIECES, 4), xp.uint32)
    return xp.empty((rows, stages(cols) * UNITS, 2), xp.uint32)


def _wg_columns() -> np.ndarray:
    """[8, 16]: the stage column of value kk of k-step s = 2 j + h in wgmma order (t, e =
    (kk % 8) // 2, kk % 2: column 32 t + 8 j + 2 h + 4 e, + 1 for kk >= 8), the order the
    FP4 decode leaves A's k index in (grouped_wg.cu)."""
    s, kk = np.arange(8)[:, None], np.arange(16)[None, :]
    return 32 * ((kk & 7) >> 1) + 8 * (s >> 1) + 2 * (s & 1) + (kk >= 8) + 4 * (kk & 1)


WG_COLUMNS = _wg_columns()


def split_words_wg(x, words, parts: int = 2):
    """words [rows, stages * WG_PIECES, 4] (uint32) of x [rows, cols] fp32 in wgmma order: hi
    (and lo) bf16 words, zeros past cols."""
    return _split(("grouped_wg", "split_words_wg"), x, words, parts)


def split_words_wg_numpy(x, words, parts: int = 2):
    """NumPy twin of split_words_wg."""
    rows = x.shape[0]
    hi, lo = _hi_lo(x, parts)
    out = words.reshape(rows, -1, 8, 2, 8)  # [row, stage, step, hl, word of two values]
    for hl, w in enumerate((hi, lo)):
        v = w.reshape(rows, -1, BK)[:, :, WG_COLUMNS].astype(np.uint32)
        out[:, :, :, hl] = v[..., 0::2] | (v[..., 1::2] << 16)
    return words


def _wg_values(words, cols: int):
    """fp32 [rows, cols] of hi + lo of wgmma-order words."""
    w = np.asarray(words).reshape(words.shape[0], -1, 8, 2, 8)
    vals = np.empty(w.shape[:-1] + (16,), np.float32)
    vals[..., 0::2] = widen((w & 0xFFFF).astype(np.uint16))
    vals[..., 1::2] = widen((w >> 16).astype(np.uint16))
    total = np.zeros((w.shape[0], w.shape[1], BK), np.float32)
    total[:, :, WG_COLUMNS] = vals[:, :, :, 0] + vals[:, :, :, 1]
    return total.reshape(w.shape[0], -1)[:, :cols]


def wgmma_ready(m) -> bool:
    """True when packed m's grouped products run on grouped_wg.cu: FP4 on a compute capability
    9.0 device (sm_90a code), DS4_WGMMA not 0."""
    return WGMMA and getattr(m, "fmt", None) == "fp4" and builds_here("grouped_wg")


def expert_tiles(counts, bm: int, tiles, n_tiles):
    """tiles [>= max_tiles, 4] int32 = (expert, first row, rows, m16 tiles they fill) per tile of
    up to bm rows of the rows grouped by expert (counts [E] int64 in expert order); n_tiles [1]
    = entries."""
    launch("grouped", "expert_tiles", (1,), (32,),
           (ptr(counts), i32(counts.shape[0]), i32(bm), ptr(tiles), ptr(n_tiles)))
    return tiles


def expert_tiles_numpy(counts, bm: int, tiles, n_tiles):
    """NumPy twin of expert_tiles."""
    n, row = 0, 0
    for e, c in enumerate(np.asarray(counts).tolist()):
        for r in range(0, c, bm):
            rows = min(bm, c - r)
            tiles[n] = (e, row + r, rows, -(-rows // 16))
            n += 1
        row += c
    n_tiles[0] = n
    return tiles


def slot_sum(rows, k: int, out):
    """out [S, D] = sum over the k picks (in order) of rows [S * k, D]."""
    n = out.size
    blocks = max(1, min(-(-n // THREADS), 132 * 32))
    launch("grouped", "slot_sum", (blocks,), (THREADS,),
           (ptr(rows), i32(out.shape[0]), i32(k), i32(out.shape[1]), ptr(out)))
    return out


def slot_sum_numpy(rows, k: int, out):
    """NumPy twin of slot_sum."""
    picks = np.asarray(rows).reshape(out.shape[0], k, -1)
    out[...] = picks[:, 0]
    for s in range(1, k):
        out += picks[:, s]
    return out


def _shift(m) -> int:
    return 0 if m.fmt == "fp4" else int(m.block[0]).bit_length() - 1


def _gemm(kind: str, m, words, order, k_div: int, wts, tiles, n_tiles, mt: int, parts: int,
          limit: float, out, variant: str = ""):
    """One grouped launch of kind gate_up (act rows) or gemm (scattered rows) over packed m
    [E, rows, cols] (a 2-D m: one expert); words in wgmma order take grouped_wg.cu's kernel."""
    codes, scale = m.codes, m.scale
    rows, cols = m.shape[-2:]
    stacked, wg = codes.ndim == 3, words.shape[-1] == 4
    width = rows // 2 if kind == "gate_up" else rows
    band = (WG_ROWS if wg else block_rows(m.fmt, variant)) // (2 if kind == "gate_up" else 1)
    grid = (-(-width // band), tiles.shape[0])
    args = (ptr(words), np.int64(words.shape[1]), ptr(order), i32(k_div), ptr(wts), ptr(tiles),
            ptr(n_tiles), ptr(codes), ptr(scale), np.int64(codes.strides[0] if stacked else 0),
            np.int64(scale.strides[0] if stacked else 0), i32(rows), i32(cols),
            i32(scale.shape[-1]), i32(_shift(m)), i32(parts), f32(limit), ptr(out),
            np.int64(out.shape[1]))
    if wg:  # the tile's used m16 tiles pick the instruction's N: no mt or variant
        assert m.fmt == "fp4" and not variant and mt <= MAX_MT
        launch("grouped_wg", f"{kind}_fp4_wg", grid, (THREADS,), args, shared=WG_SHARED)
        return out
    assert not variant or (m.fmt == "fp4" and mt in VARIANTS[variant][2])
    name = f"{kind}_{m.fmt}_m{mt}" + (f"_{variant}" if variant else "")
    launch("grouped", name, grid, (THREADS,), args, shared=shared_bytes(m.fmt, mt, variant))
    return out


def gate_up(m, words, order, k_div: int, wts, tiles, n_tiles, mt: int, act, limit: float,
            parts: int = 2, variant: str = ""):
    """act[r] = swiglu(gate_e a, up_e a) * wts[order[r]] for the sorted rows r of each tile
    (expert e), a = the activation row order[r] // k_div (order None: r; wts None: 1);
    m = packed gate/up [E, 2I, D] (gate rows, then up rows)."""
    return _gemm("gate_up", m, words, order, k_div, wts, tiles, n_tiles, mt, parts, limit, act,
                 variant)


def gemm(m, words, order, tiles, n_tiles, mt: int, out, parts: int = 2, variant: str = ""):
    """out[order[r]] = W_e a_r for the sorted rows r of each tile (order None: out[r]); variant:
    a key of VARIANTS or "" (the default shape)."""
    return _gemm("gemm", m, words, order, 1, None, tiles, n_tiles, mt, parts, 0.0, out, variant)


def _dense(m, e: int):
    codes, scale = np.asarray(m.codes), np.asarray(m.scale)
    if codes.ndim == 3:
        codes, scale = codes[e], scale[e]
    if m.fmt == "fp4":
        return dequant_fp4(codes, scale)
    return dequant_fp8(codes, scale, m.block[0])


def _tile_rows(tiles, n_tiles):
    for e, start, n, _ in np.asarray(tiles)[: int(np.asarray(n_tiles)[0])].tolist():
        yield e, start, start + n


def _product(m, e: int, a, rows=None):
    w = _dense(m, e)
    w = w if rows is None else w[rows]
    return (a.astype(np.float64) @ w.T.astype(np.float64)).astype(np.float32)


def gate_up_numpy(m, words, order, k_div: int, wts, tiles, n_tiles, mt: int, act,
                  limit: float, parts: int = 2, variant: str = ""):
    """NumPy twin of gate_up (products in float64 of the words' hi + lo values)."""
    a_all = words_values(words, m.shape[-1])
    inter = m.shape[-2] // 2
    for e, start, stop in _tile_rows(tiles, n_tiles):
        picks = np.arange(start, stop) if order is None else np.asarray(order)[start:stop]
        a = a_all[picks // k_div if order is not None else picks]
        y = _product(m, e, a)
        w = 1.0 if wts is None else np.asarray(wts)[picks][:, None]
        act[start:stop] = _swiglu(y[:, :inter], y[:, inter:], limit) * w
    return act


def gemm_numpy(m, words, order, tiles, n_tiles, mt: int, out, parts: int = 2,
               variant: str = ""):
    """NumPy twin of gemm."""
    a_all = words_values(words, m.shape[-1])
    for e, start, stop in _tile_rows(tiles, n_tiles):
        dst = np.arange(start, stop) if order is None else np.asarray(order)[start:stop]
        out[dst] = _product(m, e, a_all[start:stop])
    return out


def scales_fit(m) -> bool:
    """True when every E8M0 scale byte of m folds into a finite bf16 factor (checked once per
    matrix on its device; checkpoint scales are far below the bound)."""
    ok = getattr(m, "grouped_scales_fit", None)
    if ok is None:
        ok = int(m.scale.max()) <= MAX_SCALE[m.fmt]
        m.grouped_scales_fit = ok
    return ok


def fits(m, cols: int) -> bool:
    """True when the grouped kernels read packed m [..., rows, cols] in place: FP4 or FP8 with
    E8M0 bytes, whole 16-byte loads per row, FP8 square blocks of at least 16 (a lane's
    16 columns in one block), scale bytes in range, and a block of one m16 tile fits this GPU's
    shared memory (not an RTX 30xx / 40xx's 99 KB)."""
    return (getattr(m, "fmt", None) in NT and m.kernel_ready and m.shape[-1] == cols
            and m.shape[-1] % 32 == 0 and m.shape[-2] % 2 == 0 and scales_fit(m)
            and most_mt(m.fmt) > 0)


def most_mt(fmt: str) -> int:
    """The most m16 tiles (<= MAX_MT) a block of the default shape holds on this GPU's shared
    memory (0: none)."""
    room = shared_limits()[0]
    return max((mt for mt in range(1, MAX_MT + 1) if shared_bytes(fmt, mt) <= room), default=0)


def _ops(xp, wg: bool = False):
    """The launchers on CuPy, their twins on NumPy; wg: words in wgmma order."""
    if xp is np:
        split = split_words_wg_numpy if wg else split_words_numpy
        return split, expert_tiles_numpy, gate_up_numpy, gemm_numpy, slot_sum_numpy
    return split_words_wg if wg else split_words, expert_tiles, gate_up, gemm, slot_sum


def routed(xp, gate_up_m, down_m, x, ids, weights, limit: float, parts: int = 2,
           skips: bool = False, wg: bool | None = None):
    """sum_k weights[:, k] * expert_{ids[:, k]}(x) for x [S, D] with packed experts gate/up
    [E, 2I, D] and down [E, D, I]: the rows grouped by expert on the device, one gate/up and
    one down launch over all of them, picks summed per token in a fixed order. With `skips`,
    a pick whose id is E (no expert of these stacks: it lives in another memory) adds
    nothing. wg: the wgmma kernels (default: where wgmma_ready takes both stacks and tiles
    of 48+ rows are picked; with fewer rows an expert, mma.sync's narrower tiles win)."""
    S, k = ids.shape
    R, E, D = S * k, gate_up_m.shape[0], x.shape[1]
    base = min(pick_mt(R, E), most_mt(gate_up_m.fmt), most_mt(down_m.fmt))
    if wg is None:
        wg = (xp is not np and base >= WG_MIN_MT and wgmma_ready(gate_up_m)
              and wgmma_ready(down_m))
    split, tiles_of, up_op, down_op, sum_op = _ops(xp, wg)
    inter = down_m.shape[-1]
    flat = ids.reshape(-1)
    order = (np.argsort(flat, kind="stable") if xp is np else xp.argsort(flat)).astype(xp.int32)
    counts = expert_counts(xp, flat, E)  # picks of id E (skipped) sort last
    # TUNED holds mma.sync shapes; wgmma takes the tiles as picked, its N from their rows
    mt, variant = (base, "") if wg else TUNED.get((gate_up_m.fmt, base), (base, ""))
    tiles = xp.zeros((max_tiles(R, E, 16 * mt), 4), xp.int32)
    n_tiles = xp.zeros(1, xp.int32)
    tiles_of(counts, 16 * mt, tiles, n_tiles)
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    wts = xp.ascontiguousarray(weights.reshape(-1), dtype=xp.float32)
    act = xp.empty((R, inter), xp.float32)  # skipped picks' rows: split, never multiplied
    up_op(gate_up_m, split(x, new_words(xp, S, D, wg), parts), order, k, wts, tiles, n_tiles, mt,
          act, limit, parts, variant)
    # rows of skipped picks are in no tile, so only they need the zeros
    rows = (xp.zeros if skips else xp.empty)((R, D), xp.float32)
    down_op(down_m, split(act, new_words(xp, R, inter, wg), parts), order, tiles, n_tiles, mt,
            rows, parts, variant)
    return sum_op(rows, k, xp.empty((S, D), xp.float32))


def expert_counts(xp, flat, E: int):
    """Picks per expert id < E (int64 [E]) of flat ids in 0..E, on the device without a host
    round trip: CuPy's bincount checks its input for negatives on the host, which stalled
    the host once a layer (the queue behind the MoE drained while it waited)."""
    if xp is np:
        return np.bincount(flat, minlength=E + 1)[:E].astype(np.int64)
    import cupyx

    counts = xp.zeros(E + 1, xp.int32)
    cupyx.scatter_add(counts, flat, xp.ones(flat.shape, xp.int32))
    return counts[:E].astype(xp.int64)


def decode_numpy(fmt: str, q, j: int, h: int) -> tuple[int, int]:
    """NumPy twin of the device decode (Fp4 / Fp8 ::decode): a lane's u32 code words q -> the
    bf16x2 words (b0, b1) of k-step (j, h), each half = value * 2^-126 (FP4) or 2^-120 (FP8)."""
    sign = 0x80008000
    if fmt == "fp4":
        w, m = int(q[j]), 0x01C001C0
        if h == 0:
            return ((w << 12) & sign) | ((w << 6) & m), ((w << 8) & sign) | ((w << 2) & m)
        return ((w << 4) & sign) | ((w >> 2) & m), (w & sign) | ((w >> 6) & m)
    a, b, m = int(q[2 * j]), int(q[2 * j + 1]), 0x07F007F0
    lo, hi = (a, b) if h == 0 else (a >> 16, b >> 16)
    t = (lo & 0xFFFF) | ((hi & 0xFFFF) << 16)  # prmt 0x5410 / 0x7632
    return ((t << 8) & sign) | ((t << 4) & m), (t & sign) | ((t >> 4) & m)
