"""Batched decode products on tensor cores (ds4/kernels/rows.cu) and their NumPy twins.

y[b] = W x[b] for b < batch <= 8, the weights read once for the whole batch: FP8 and FP4
PackedMatrix weights (kernel_ready), bf16 words (uint16) or fp32 (fp32 runs the bf16-word
GEMV of ds4/kernels/gemv.py once per row: exact fp32 weights do not fit a bf16 mma).

Accuracy: x is split into bf16 hi + lo (after a scale of 2^32 for packed weights, which carry
2^-32), so each output is W (hi + lo) summed in fp32, within ~1e-5 of |W| |x| of the fp32
product; the twins compute W (hi + lo) exactly, so kernel and twin agree to fp32 summation.
FP8 in scale tiles of 64 or more (FP8H, the official checkpoint's 128) feeds its codes to f16
mmas as they are and x as f16 hi + lo under a power of two per 64-column k-tile (split_f16:
within 2^-23 of the tile's largest |x|), the tile scale applied to each k-tile's fp32 sums:
fewer instructions a code than the bf16 bit moves (docs/PERF.md).
Row independence: how k is split and summed depends on the matrix shape only, so row b of a
batch is bitwise the result of the same row alone (batch=1).

x split once (`split_rows`, rows.cu's rows_split): the B words of every lane laid out as the
mma reads them, so the row kernels of a launch load them instead of splitting x again for
every row tile (docs/PERF.md); the words are the same, so are the sums. The MoE's scratch
(rows_moe.py) holds them. The dense matrices split x in the kernel: at B <= STAGE_BATCH each
block once into shared memory (rows.cuh's stage_x, the _sx kernels), else each warp its own
chunks (a split launch of their own measured no faster: it costs what the split saves).

Every launcher allocates nothing and reads all sizes from its arguments or device memory, so a
decode step made of them can be captured in a CUDA graph; plans (matvec_plan, moe_scratch)
allocate once up front.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds4.kernels import i32, launch, ptr, shared_limits, to_bf16, widen
from ds4.kernels.gemv import gemv
from ds4.kernels.packed import E4M3, dequant_fp4, dequant_fp8

FP8, FP4 = "fp8", "fp4"  # PackedMatrix.fmt (ds4/model/packed.py; kernels do not import model)
FP8H = "fp8h"  # FP8 in square scale tiles of >= 64 read through f16 mmas (rows_formats.cuh's Fp8h)
F16_SHIFT = 6  # the least tile shift of FP8H: a k-tile of 64 columns in one scale tile
WARPS = 8  # per block: rows_formats.cuh's RW
MAX_BATCH = 8  # columns of one mma tile
TARGET_WARPS = 2048  # row groups x k-split warps that keep every SM streaming
TALL_ROWS = 4096  # from this many rows a warp takes two 16-row tiles (more bytes in flight)
WIDE_COLS = 8192  # a tall packed matrix this wide takes 4 k-tiles a stage (o_b, docs/PERF.md)
CHUNK = {FP8: 16, FP8H: 16, FP4: 32, "bf16": 16}  # columns of one lane's 16-byte (bf16: 32) chunk
FORMAT_CODE = {FP8: 0, FP4: 1, "bf16": 2, FP8H: 3}  # rows_many's table
KERNEL_NAME = {FP8: "Fp8", FP8H: "Fp8h", FP4: "Fp4", "bf16": "Bf16"}
X_SHIFT = {FP8: 32, FP4: 32, "bf16": 0}  # x is scaled by 2^X_SHIFT, the weights by its inverse
STAGE_X = True  # matvec's blocks split x once into shared memory where it fits (docs/PERF.md)
STAGE_BATCH = 4  # ... at batches up to this (measured: 3-7% faster at B = 1, 2; even at 4; not 8)
STAGED = {(1, 4), (2, 2), (2, 4)}  # the variants with such kernels (rows.cu's MATVEC_SX)


def is_packed(w) -> bool:
    """True for a PackedMatrix (codes + scales of FP8 / FP4 weights)."""
    return hasattr(w, "codes") and hasattr(w, "fmt")


@dataclass
class Operand:
    """A matrix as the kernels read it: format, codes (or words), E8M0 scales, their row
    length and tile shift, logical rows and columns."""

    fmt: str
    codes: object
    scale: object
    sc_ld: int
    shift: int
    rows: int
    cols: int


def operand(w) -> Operand | None:
    """The kernel view of w ([..., rows, cols]), or None where rows.cu cannot read it (fp32,
    scales that are not E8M0 bytes, ragged chunks, non-square FP8 tiles)."""
    if is_packed(w):
        if not w.kernel_ready:
            return None
        rows, cols = w.shape[-2:]
        shift = w.block[0].bit_length() - 1 if w.fmt == FP8 else 0
        return Operand(w.fmt, w.codes, w.scale, w.scale.shape[-1], shift, rows, cols)
    if str(w.dtype) == "uint16" and w.shape[-1] % CHUNK["bf16"] == 0 and w.flags.c_contiguous:
        return Operand("bf16", w, None, 0, 0, w.shape[-2], w.shape[-1])
    return None


def dense_fmt(op: Operand) -> str:
    """The format matvec reads op in: FP8 tiles of >= 64 go through f16 mmas (FP8H: the codes
    as they are, the tile scale on the k-tile's sums), smaller ones through the bf16 bit moves.
    The MoE kernels (rows_moe.py) read FP8 in the bf16 way only."""
    return FP8H if op.fmt == FP8 and op.shift >= F16_SHIFT else op.fmt


def pick_split(groups: int, k_tiles: int) -> int:
    """Warps splitting k within a block (1..8): enough warps in all, >= 2 k-tiles each. Depends
    on the shape only, which keeps every row's sum order fixed."""
    kw = 1
    while kw < WARPS and groups * kw < TARGET_WARPS and k_tiles // (2 * kw) >= 2:
        kw *= 2
    return kw


def _k_tiles(fmt: str, cols: int) -> int:
    return -(-cols // (4 * CHUNK[fmt]))


def _ld(a) -> int:
    """Elements from one row of a 2-D fp32 array to the next."""
    return a.strides[0] // a.itemsize if a.ndim == 2 else a.shape[-1]


def _check_rows(a, batch: int, width: int, name: str, aligned: bool = True) -> None:
    assert a.dtype == np.float32 and a.strides[-1] == 4, f"{name}: fp32 with unit stride"
    assert (a.shape[0] if a.ndim == 2 else 1) >= batch and a.shape[-1] >= width, name
    assert not aligned or (a.data.ptr % 16 == 0 and _ld(a) % 4 == 0), f"{name}: 16-byte rows"


def variant(op: Operand) -> tuple[int, int]:
    """(16-row tiles per warp, k-tiles per stage) of matvec for a matrix: by shape only."""
    if op.rows < TALL_ROWS:
        return (1, 4)
    return (2, 4) if op.cols >= WIDE_COLS and op.fmt != "bf16" else (2, 2)  # (bf16: no m2_d4)


def staged_bytes(fmt: str, cols: int, batch: int) -> int:
    """Shared memory of a staged (_sx) kernel: each batch row of x as B words, one a column of
    whole k-tiles, and a power of two a k-tile (rows.cuh's stage_x)."""
    kt = _k_tiles(fmt, cols)
    return 4 * batch * kt * (4 * CHUNK[fmt] + 1)


STAGE_TWO, STAGE_ONE = 96 * 1024, 200 * 1024  # staged x at two blocks an SM, or one
STATIC = 8 * 1024 + 1024  # a row kernel's own shared memory (reduce_k) and a block's reserve


def stage_limit(fmt: str, tiles: tuple[int, int]) -> int:
    """The most shared memory a staged kernel takes: two blocks an SM for the variants whose
    launch bounds hold two (rows.cu's MINB), else one; less on a GPU with less (an A100 holds
    164 KB an SM, an RTX 30xx / 40xx 100 KB)."""
    two = (tiles == (1, 4) and fmt != "bf16") or (tiles == (2, 2) and fmt in (FP8, FP8H))
    return _room(2 if two else 1)


def _room(blocks: int) -> int:
    """Staged x's shared memory for each of `blocks` (1 or 2) row kernels an SM: the measured
    limit, or less where this GPU gives less."""
    block, sm = shared_limits()
    return min(STAGE_TWO if blocks == 2 else STAGE_ONE, min(block, sm // blocks) - STATIC)


def _staged_fit(need: int, limit: int, batch: int) -> int:
    """need (staged x's bytes) where splitting x once a block pays and fits in limit, else 0.
    It pays at small batches, where most of a warp's lanes split x for no column or for one
    another's (docs/PERF.md: at B = 4 the copy and barriers cost more than the split saves)."""
    return need if STAGE_X and batch <= STAGE_BATCH and need <= limit else 0


def staged(fmt: str, tiles: tuple[int, int], kw: int, rows: int, group: int, cols: int,
           batch: int) -> int:
    """Shared memory bytes of the staged kernel for this launch, or 0 where it takes x in
    registers: no gain or no room (_staged_fit), a variant without one, or a block whose rows
    read two x row groups."""
    if tiles not in STAGED or (group != rows and group % (16 * tiles[0] * (WARPS // kw))):
        return 0
    return _staged_fit(staged_bytes(fmt, cols, batch), stage_limit(fmt, tiles), batch)


def matvec_kernel(op: Operand, batch: int, group: int, tiles=None, split=None) -> tuple:
    """(kernel name, blocks, k-split, dynamic shared bytes) of matvec for op at batch, its row
    groups `group` rows apart; tiles / split as matvec's."""
    mt, depth = variant(op) if tiles is None else tiles
    groups = -(-op.rows // (16 * mt))
    kw = pick_split(groups, _k_tiles(op.fmt, op.cols)) if split is None else split
    fmt, nt = dense_fmt(op), 1 if batch <= 4 else 2
    shared = staged(fmt, (mt, depth), kw, op.rows, group, op.cols, batch)
    name = f"rows_matvec_{KERNEL_NAME[fmt]}_m{mt}_d{depth}_n{nt}{'_sx' if shared else ''}"
    return name, -(-groups // (WARPS // kw)), kw, shared


def matvec(w, x, y, batch: int, rows_per_group: int | None = None,
           tiles: tuple[int, int] | None = None, split: int | None = None) -> None:
    """y[b] = W x[b] for b < batch (<= 8): x [>= batch, K] fp32 (or [K] for batch 1), y
    [>= batch, N]; rows may be strided. Row r of W reads x[b, (r // rows_per_group) * K:] (the
    grouped o_a projection, as gemv.py). tiles / split override the shape's kernel variant and
    k-split (benchmarks; a fixed choice keeps rows bitwise batch-independent)."""
    assert 1 <= batch <= MAX_BATCH
    op = operand(w)
    if op is None:
        _matvec_rows(w, x, y, batch, rows_per_group)
        return
    mt = (variant(op) if tiles is None else tiles)[0]
    group = op.rows if rows_per_group is None else rows_per_group
    assert rows_per_group is None or (group % (16 * mt) == 0 and op.rows % group == 0), \
        "groups of whole 16-row tiles"
    _check_rows(x, batch, op.cols * (op.rows // group), "x")
    _check_rows(y, batch, op.rows, "y", aligned=False)
    name, blocks, kw, shared = matvec_kernel(op, batch, group, tiles, split)
    args = (ptr(op.codes), ptr(op.scale), i32(op.rows), i32(op.cols), i32(op.sc_ld),
            i32(op.shift), ptr(x), np.int64(_ld(x)), i32(group), ptr(y), np.int64(_ld(y)),
            i32(batch), i32(kw))
    launch("rows", name, (blocks,), (32 * WARPS,), args, shared=shared)


def words_ld(fmt: str, cols: int) -> int:
    """uint32 words per row of x split for format fmt (FP8 / FP4): hi then lo, each
    ceil(cols / (4 CH)) k-tiles of 2 CH words (columns past cols zero)."""
    return 2 * _k_tiles(fmt, cols) * 2 * CHUNK[fmt]


def split_rows(jobs: list) -> None:
    """rows_split: for each of up to two jobs (x [>= n, K] fp32, n, K, fmt, out uint32 [>= n,
    words_ld(fmt, K)] contiguous), out = the split words of x's first n rows, one launch."""
    assert 1 <= len(jobs) <= 2 and all(job[3] in (FP8, FP4) for job in jobs), \
        "rows_split lays out FP8 and FP4 words only"  # (it reads any other code as FP4)
    args, most = [], 0
    for x, n, cols, fmt, out in jobs + [(None, 0, 0, FP8, None)] * (2 - len(jobs)):
        ld = words_ld(fmt, cols)
        assert out is None or (out.dtype == np.uint32 and out.size >= n * ld and x.strides[-1] == 4)
        args += [ptr(x), i32(n), i32(cols), np.int64(_ld(x) if x is not None else 0), ptr(out),
                 np.int64(ld), i32(FORMAT_CODE[fmt])]
        most = max(most, n * ld // 2)
    launch("rows", "rows_split", (-(-most // 256), len(jobs)), (256,), tuple(args))


def _xcol(fmt: str, m, r, h):
    """rows_formats.cuh's F::xcol: the chunk column of half h of B register r of mma m."""
    if fmt == FP4:
        return 8 * (m >> 1) + 2 * (m & 1) + r + 4 * h
    return 4 * m + r + 2 * h


def split_rows_numpy(jobs: list) -> None:
    """NumPy twin of split_rows (host arrays)."""
    for x, n, cols, fmt, out in jobs:
        ch, ld = CHUNK[fmt], words_ld(fmt, cols)
        j = np.arange(ld // 2)
        w = 2 * (ch // 4)  # words per lane and k-tile
        kt, t, m, r = j // (4 * w), (j // w) % 4, (j % w) >> 1, j & 1
        base = kt * 4 * ch + t * ch
        xs = np.zeros((n, base.max() + 4 * ch), np.float32)
        xs[:, :cols] = np.asarray(x, np.float32)[:n, :cols] * np.float32(2.0 ** X_SHIFT[fmt])
        pair = [xs[:, base + _xcol(fmt, m, r, h)] for h in (0, 1)]
        hi = [to_bf16(v).reshape(v.shape).astype(np.uint32) for v in pair]
        lo = [to_bf16(v - widen(to_bf16(v)).reshape(v.shape)).reshape(v.shape).astype(np.uint32)
              for v in pair]
        o = out.reshape(-1)[:n * ld].reshape(n, ld)
        o[:, :ld // 2] = hi[0] | (hi[1] << 16)
        o[:, ld // 2:] = lo[0] | (lo[1] << 16)


def _matvec_rows(w, x, y, batch: int, rows_per_group) -> None:
    """fp32 (or otherwise unsupported) weights: the plain GEMV once per row of the batch."""
    assert not is_packed(w), "packed weights must be kernel_ready"
    xs, ys = (x[None], y[None]) if x.ndim == 1 else (x, y)
    for b in range(batch):  # one split: gemv's column splits add atomically (not repeatable)
        gemv(w, xs[b], ys[b], rows_per_group=rows_per_group, splits=1)


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def dense(w) -> np.ndarray:
    """fp32 values of a weight (PackedMatrix, bf16 words or fp32; host or device) on the host."""
    if is_packed(w):
        codes, scale = _host(w.codes), _host(w.scale)
        if w.fmt == FP8:
            return dequant_fp8(codes, scale, w.block[0])
        return dequant_fp4(codes, scale)
    return widen(_host(w))


def split_x(x: np.ndarray, shift: int) -> np.ndarray:
    """x * 2^shift as the kernels see it, hi + lo bf16 (float64, exact): hi = bf16(x), lo =
    bf16(x - hi)."""
    xs = np.asarray(x, np.float32) * np.float32(2.0 ** shift)
    hi = widen(to_bf16(xs)).reshape(xs.shape)
    lo = widen(to_bf16(xs - hi)).reshape(xs.shape)
    return hi.astype(np.float64) + lo.astype(np.float64)


F16_ROUND = np.float32(1.5 * 2.0 ** 27)  # (v + it) - it: |v| < 2^15 to a multiple of 16


def split_f16(x: np.ndarray) -> np.ndarray:
    """x [B, K] as the FP8H kernels feed it (rows_formats.cuh's split_f16; float64, exact): per
    row and k-tile of 64 columns a power of two puts the largest |x| in [2^14, 2^15), hi = the
    scaled x to a multiple of 16, lo = the rest rounded to f16; (hi + lo) over the power."""
    x = np.asarray(x, np.float32)
    rows, cols = x.shape
    tiles = np.zeros((rows, -(-cols // 64) * 64), np.float32)
    tiles[:, :cols] = x
    tiles = tiles.reshape(rows, -1, 64)
    e = np.maximum(np.abs(tiles).max(-1).view(np.uint32) >> 23, 15).astype(np.uint32)
    sc, un = (((b << 23).astype(np.uint32)).view(np.float32) for b in (268 - e, e - 14))
    v = tiles * sc[..., None]
    hi = (v + F16_ROUND) - F16_ROUND
    lo = (v - hi).astype(np.float16).astype(np.float64)
    both = (hi.astype(np.float64) + lo) * un[..., None].astype(np.float64)
    return both.reshape(rows, -1)[:, :cols]


def rows_numpy(wd: np.ndarray, fmt: str | None, x: np.ndarray) -> np.ndarray:
    """W x[b] for dense W [N, K] and x [B, K] as a kernel of format fmt computes it (fmt None:
    the plain fp32 GEMV)."""
    x = np.asarray(x, np.float32)
    if fmt is None:
        return (x @ wd.T).astype(np.float32)
    if fmt == FP8H:
        return (split_f16(x) @ wd.T.astype(np.float64)).astype(np.float32)
    shift = X_SHIFT[fmt]
    return (split_x(x, shift) @ wd.T.astype(np.float64) * 2.0 ** -shift).astype(np.float32)


def _kernel_fmt(w) -> str | None:
    op = operand(w)
    return None if op is None else op.fmt


def matvec_numpy(w, x, y, batch: int, rows_per_group: int | None = None) -> None:
    """NumPy twin of matvec (host arrays; a device w is copied to the host)."""
    op = operand(w)
    wd, fmt = dense(w), None if op is None else dense_fmt(op)
    rows, cols = wd.shape
    group = rows if rows_per_group is None else rows_per_group
    xs, ys = (x[None], y[None]) if np.ndim(x) == 1 else (x, y)
    xs = np.asarray(xs, np.float32)[:batch, :cols * (rows // group)]
    out = np.concatenate([rows_numpy(wd[g * group:(g + 1) * group], fmt,
                                     xs[:, g * cols:(g + 1) * cols])
                          for g in range(rows // group)], axis=1)
    ys[:batch, :rows] = out


@dataclass
class ManyPlan:
    """What matvec_many launches: the kernel table (device int64, ENTRY per matrix), its
    k-split and blocks, and the matrices rows.cu cannot read (run one by one)."""

    weights: list
    outs: list
    table: object
    count: int
    cols: int
    kw: int
    blocks: int
    loose: list
    fmts: tuple = ()  # the formats the table's matrices are read in (dense_fmt)

    def staged(self, batch: int) -> int:
        """Shared memory of the staged (_sx) launch of this plan at `batch`, or 0 (as matvec's
        `staged`; rows_many holds one block an SM)."""
        return _staged_fit(max(staged_bytes(fmt, self.cols, batch) for fmt in self.fmts),
                           _room(1), batch)


ENTRY = 9  # int64 per table entry (rows.cu)


def matvec_plan(xp, weights: list, outs: list) -> ManyPlan:
    """The plan of matvec_many for matrices sharing x (one K): outs[i] is a 2-D fp32 view
    [>= batch, N_i] with unit stride along N and any row stride (16-byte aligned), or a 1-D
    [N_i] for batch 1. Allocates the device table once."""
    ops = [operand(w) for w in weights]
    cols = weights[0].shape[-1]
    assert all(w.shape[-1] == cols for w in weights), "one x: one column count"
    picked = [(op, y) for op, y in zip(ops, outs) if op is not None]
    loose = [(w, y) for w, op, y in zip(weights, ops, outs) if op is None]
    if xp is np or not picked:
        return ManyPlan(weights, outs, None, 0, cols, 1, 0, loose if xp is not np else [])
    groups = [-(-op.rows // 16) for op, _ in picked]
    kw = pick_split(sum(groups), min(_k_tiles(op.fmt, cols) for op, _ in picked))
    per = WARPS // kw
    entries, first = [], 0
    for (op, y), g in zip(picked, groups):
        entries.append([int(ptr(op.codes)), int(ptr(op.scale)), int(ptr(y)), op.rows,
                        FORMAT_CODE[dense_fmt(op)], op.sc_ld, op.shift, _ld(y), first])
        first += -(-g // per)
    table = xp.asarray(np.array(entries, dtype=np.int64).reshape(-1))
    fmts = tuple(sorted({dense_fmt(op) for op, _ in picked}))
    return ManyPlan(weights, outs, table, len(entries), cols, kw, first, loose, fmts)


def matvec_many(plan: ManyPlan, x, batch: int) -> None:
    """outs[i][b] = weights[i] x[b] for the plan's matrices, one launch (plus one per matrix
    rows.cu cannot read)."""
    assert 1 <= batch <= MAX_BATCH
    if plan.count:
        _check_rows(x, batch, plan.cols, "x")
        args = (ptr(plan.table), i32(plan.count), ptr(x), np.int64(_ld(x)), i32(plan.cols),
                i32(batch), i32(plan.kw))
        shared = plan.staged(batch)
        launch("rows", f"rows_many_n{1 if batch <= 4 else 2}{'_sx' if shared else ''}",
               (plan.blocks,), (32 * WARPS,), args, shared=shared)
    for w, y in plan.loose:
        matvec(w, x, y, batch)


def matvec_many_numpy(plan: ManyPlan, x, batch: int) -> None:
    """NumPy twin of matvec_many."""
    for w, y in zip(plan.weights, plan.outs):
        matvec_numpy(w, x, y, batch)


def decode_words(w, out) -> None:
    """Test hook: out [rows, cols] = the words rows.cu's matvec feeds the mma for each code of a
    2-D packed matrix, in column order: bf16 of the weight times 2^-32, or for FP8H the code's
    own value in f16."""
    op = operand(w)
    chunks = op.rows * op.cols // CHUNK[op.fmt]
    launch("rows", f"rows_decode_{dense_fmt(op)}", (-(-chunks // 256),), (256,),
           (ptr(op.codes), ptr(op.scale), i32(op.rows), i32(op.cols), i32(op.sc_ld),
            i32(op.shift), ptr(out)))


def decode_words_numpy(w, out) -> None:
    """NumPy twin of decode_words: bf16 words of the weights times 2^-32, or the f16 codes (both
    exact)."""
    if dense_fmt(operand(w)) == FP8H:
        out[...] = E4M3[_host(w.codes)].astype(np.float16).view(np.uint16)
        return
    out[...] = to_bf16(dense(w) * np.float32(2.0 ** -32)).reshape(out.shape)
