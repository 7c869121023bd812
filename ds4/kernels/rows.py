"""Batched decode products on tensor cores (ds4/kernels/rows.cu) and their NumPy twins.

y[b] = W x[b] for b < batch <= 8, the weights read once for the whole batch: FP8 and FP4
PackedMatrix weights (kernel_ready), bf16 words (uint16) or fp32 (fp32 runs the bf16-word
GEMV of ds4/kernels/gemv.py once per row: exact fp32 weights do not fit a bf16 mma).

Accuracy: x is split into bf16 hi + lo (after a scale of 2^32 for packed weights, which carry
2^-32), so each output is W (hi + lo) summed in fp32, within ~1e-5 of |W| |x| of the fp32
product; the twins compute W (hi + lo) exactly, so kernel and twin agree to fp32 summation.
Row independence: how k is split and summed depends on the matrix shape only, so row b of a
batch is bitwise the result of the same row alone (batch=1).

Every launcher allocates nothing and reads all sizes from its arguments or device memory, so a
decode step made of them can be captured in a CUDA graph; plans (matvec_plan, moe_scratch)
allocate once up front.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ds4.kernels import f32, i32, kernel, launch, ptr, to_bf16, widen
from ds4.kernels import moe as plain_moe
from ds4.kernels.gemv import gemv
from ds4.kernels.moe import _swiglu
from ds4.kernels.packed import dequant_fp4, dequant_fp8

FP8, FP4 = "fp8", "fp4"  # PackedMatrix.fmt (ds4/model/packed.py; kernels do not import model)
WARPS = 8  # per block: rows.cu's RW
MAX_BATCH = 8  # columns of one mma tile
TARGET_WARPS = 2048  # row groups x k-split warps that keep every SM streaming
TALL_ROWS = 4096  # from this many rows a warp takes two 16-row tiles (more bytes in flight)
CHUNK = {FP8: 16, FP4: 32, "bf16": 16}  # columns of one lane's 16-byte (bf16: 32-byte) chunk
FORMAT_CODE = {FP8: 0, FP4: 1, "bf16": 2}  # rows_many's table
KERNEL_NAME = {FP8: "Fp8", FP4: "Fp4", "bf16": "Bf16"}
X_SHIFT = {FP8: 32, FP4: 32, "bf16": 0}  # x is scaled by 2^X_SHIFT, the weights by its inverse
UNIT = 10  # ints per expert in the grouping table (rows.cu)
MAX_PAIRS = 64  # tokens x slots of one MoE call
MOE_KERNELS = {(FP4, FP8), (FP4, "bf16"), (FP8, FP8), ("bf16", "bf16")}


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


def pick_split(groups: int, k_tiles: int) -> int:
    """Warps splitting k within a block (1..8): enough warps in all, >= 2 k-tiles each. Depends
    on the shape only, which keeps every row's sum order fixed."""
    kw = 1
    while kw < WARPS and groups * kw < TARGET_WARPS and k_tiles // (2 * kw) >= 2:
        kw *= 2
    return kw


def _k_tiles(fmt: str, cols: int) -> int:
    return -(-cols // (4 * CHUNK[fmt]))


def _tiles_per_warp(rows: int) -> int:
    return 2 if rows >= TALL_ROWS else 1


def _ld(a) -> int:
    """Elements from one row of a 2-D fp32 array to the next."""
    return a.strides[0] // a.itemsize if a.ndim == 2 else a.shape[-1]


def _check_rows(a, batch: int, width: int, name: str, aligned: bool = True) -> None:
    assert a.dtype == np.float32 and a.strides[-1] == 4, f"{name}: fp32 with unit stride"
    assert (a.shape[0] if a.ndim == 2 else 1) >= batch and a.shape[-1] >= width, name
    assert not aligned or (a.data.ptr % 16 == 0 and _ld(a) % 4 == 0), f"{name}: 16-byte rows"


def variant(op: Operand) -> tuple[int, int]:
    """(16-row tiles per warp, k-tiles per stage) of matvec for a matrix: by shape only."""
    return (2, 2) if op.rows >= TALL_ROWS else (1, 4)


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
    mt, depth = variant(op) if tiles is None else tiles
    group = op.rows if rows_per_group is None else rows_per_group
    assert rows_per_group is None or (group % (16 * mt) == 0 and op.rows % group == 0), \
        "groups of whole 16-row tiles"
    _check_rows(x, batch, op.cols * (op.rows // group), "x")
    _check_rows(y, batch, op.rows, "y", aligned=False)
    groups = -(-op.rows // (16 * mt))
    kw = pick_split(groups, _k_tiles(op.fmt, op.cols)) if split is None else split
    nt = 1 if batch <= 4 else 2
    blocks = -(-groups // (WARPS // kw))
    args = (ptr(op.codes), ptr(op.scale), i32(op.rows), i32(op.cols), i32(op.sc_ld),
            i32(op.shift), ptr(x), np.int64(_ld(x)), i32(group), ptr(y), np.int64(_ld(y)),
            i32(batch), i32(kw))
    name = f"rows_matvec_{KERNEL_NAME[op.fmt]}_m{mt}_d{depth}_n{nt}"
    launch("rows", name, (blocks,), (32 * WARPS,), args)


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


def rows_numpy(wd: np.ndarray, fmt: str | None, x: np.ndarray) -> np.ndarray:
    """W x[b] for dense W [N, K] and x [B, K] as a kernel of format fmt computes it (fmt None:
    the plain fp32 GEMV)."""
    x = np.asarray(x, np.float32)
    if fmt is None:
        return (x @ wd.T).astype(np.float32)
    shift = X_SHIFT[fmt]
    return (split_x(x, shift) @ wd.T.astype(np.float64) * 2.0 ** -shift).astype(np.float32)


def _kernel_fmt(w) -> str | None:
    op = operand(w)
    return None if op is None else op.fmt


def matvec_numpy(w, x, y, batch: int, rows_per_group: int | None = None) -> None:
    """NumPy twin of matvec (host arrays; a device w is copied to the host)."""
    wd, fmt = dense(w), _kernel_fmt(w)
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
                        FORMAT_CODE[op.fmt], op.sc_ld, op.shift, _ld(y), first])
        first += -(-g // per)
    table = xp.asarray(np.array(entries, dtype=np.int64).reshape(-1))
    return ManyPlan(weights, outs, table, len(entries), cols, kw, first, loose)


def matvec_many(plan: ManyPlan, x, batch: int) -> None:
    """outs[i][b] = weights[i] x[b] for the plan's matrices, one launch (plus one per matrix
    rows.cu cannot read)."""
    assert 1 <= batch <= MAX_BATCH
    if plan.count:
        _check_rows(x, batch, plan.cols, "x")
        args = (ptr(plan.table), i32(plan.count), ptr(x), np.int64(_ld(x)), i32(plan.cols),
                i32(batch), i32(plan.kw))
        launch("rows", f"rows_many_n{1 if batch <= 4 else 2}", (plan.blocks,), (32 * WARPS,),
               args)
    for w, y in plan.loose:
        matvec(w, x, y, batch)


def matvec_many_numpy(plan: ManyPlan, x, batch: int) -> None:
    """NumPy twin of matvec_many."""
    for w, y in zip(plan.weights, plan.outs):
        matvec_numpy(w, x, y, batch)


@dataclass
class MoeScratch:
    """Buffers of one MoE call: routed act [pairs, inter], shared act [batch, s_inter], the
    per-pair down products [pairs, D], the shared one [batch, D], the expert groups (int32)."""

    act: object
    sact: object
    part: object
    spart: object
    units: object


def moe_scratch(xp, batch: int, k: int, inter: int, hidden: int,
                shared_inter: int = 0) -> MoeScratch:
    """Scratch for moe() of up to `batch` tokens with k experts each (allocated once)."""
    pairs = batch * k
    assert batch <= MAX_BATCH and pairs <= MAX_PAIRS
    z = functools.partial(xp.zeros, dtype=xp.float32)
    return MoeScratch(z((pairs, inter)), z((batch, max(shared_inter, 1))), z((pairs, hidden)),
                      z((batch, hidden)), xp.zeros(1 + UNIT * pairs, dtype=xp.int32))


@dataclass
class Bank:
    """Kernel arguments of a stack of experts (or one matrix: strides 0)."""

    op: Operand | None

    def args(self) -> tuple:
        op = self.op
        if op is None:
            return (ptr(None), ptr(None), np.int64(0), np.int64(0), i32(0), i32(0))
        stacked = op.codes.ndim == 3
        return (ptr(op.codes), ptr(op.scale), np.int64(op.codes.strides[0] if stacked else 0),
                np.int64(op.scale.strides[0] if stacked and op.scale is not None else 0),
                i32(op.sc_ld), i32(op.shift))


@functools.cache
def resident_blocks(name: str) -> int:
    """Blocks of kernel `name` resident on the GPU at once (by registers): a persistent grid."""
    import cupy

    k = kernel("rows", name)
    regs = -(-max(k.num_regs, 1) // 8) * 8
    per_sm = max(1, min(65536 // (regs * 32 * WARPS), 2048 // (32 * WARPS)))
    return per_sm * cupy.cuda.Device().attributes["MultiProcessorCount"]


def moe(gate_up, down, idx, wts, x, act: MoeScratch, y, batch: int, inter: int, limit: float,
        shared=None, persistent: bool = True, fuse_shared: bool = True) -> None:
    """y[b] = sum_j down_e(swiglu(gate_e x[b], up_e x[b]) * wts[b, j]), e = idx[b, j], + the
    shared expert (gate, up, down) of x[b] (weight 1), for b < batch. gate_up [E, 2*inter, D]
    (gate rows then up rows), down [E, D, inter]: FP4/FP8 PackedMatrix stacks or bf16 words;
    idx/wts [>= batch, k] contiguous int32/fp32 on the device; act from moe_scratch. Each
    expert hit is read once for all the tokens that picked it (grouped on the device).
    persistent: resident blocks loop over the work (else one block per item); fuse_shared:
    the shared expert in the routed launches (else launches of its own). Neither changes y."""
    gu, dn = operand(gate_up), operand(down)
    sops = [operand(m) for m in shared] if shared is not None else None
    if gu is None or dn is None or (sops is not None and None in sops):
        _moe_rows(gate_up, down, idx, wts, x, act, y, batch, inter, limit, shared)
        return
    k = idx.shape[1]
    call = MoeCall(gu, dn, idx, wts, x, act, batch, inter, sops[0].rows if sops else 0, limit,
                   k, persistent)
    assert call.pairs <= act.part.shape[0] and gu.fmt == dn.fmt and 2 * inter == gu.rows
    _check_rows(x, batch, gu.cols, "x")
    launch("rows", "rows_moe_group", (1,), (32 * WARPS,),
           (ptr(idx), i32(call.pairs), i32(gu.codes.shape[0]), ptr(act.units)))
    parts = _moe_parts(gu.fmt, sops, fuse_shared, 1 if batch <= 4 else 2)
    for name, routed, s in parts:
        _moe_gate_up(f"rows_gate_up_{name}", routed, s, call)
    for name, routed, s in parts:
        _moe_down(f"rows_down_{name}", routed, s, call)
    n = batch * dn.rows
    launch("rows", "rows_moe_sum", (-(-n // 256),), (256,),
           (ptr(act.part), ptr(act.spart if sops else None), i32(k), i32(dn.rows), i32(batch),
            ptr(y), np.int64(_ld(y))))


@dataclass
class MoeCall:
    """The operands of one moe() call, shared by its launches."""

    gu: Operand
    dn: Operand
    idx: object
    wts: object
    x: object
    act: MoeScratch
    batch: int
    inter: int
    s_inter: int
    limit: float
    k: int
    persistent: bool

    @property
    def pairs(self) -> int:
        return self.batch * self.k

    def grid(self, name: str, items: int) -> tuple[int]:
        return (min(items, resident_blocks(name)) if self.persistent else items,)


def _moe_parts(fmt: str, sops, fuse: bool, nt: int) -> list[tuple[str, bool, list | None]]:
    """(kernel suffix, routed?, shared operands or None) of each launch pair."""
    f = KERNEL_NAME[fmt].lower()
    if sops is None:
        return [(f"{f}_none_n{nt}", True, None)]
    s = KERNEL_NAME[sops[0].fmt].lower()
    if fuse:
        assert (fmt, sops[0].fmt) in MOE_KERNELS, f"no MoE kernel for {fmt} + shared {s}"
        return [(f"{f}_{s}_n{nt}", True, sops)]
    return [(f"{f}_none_n{nt}", True, None), (f"{s}_{s}_n{nt}", False, sops)]


def _moe_gate_up(kname: str, routed: bool, sops, c: MoeCall) -> None:
    kw = pick_split(c.k * -(-c.inter // 16), _k_tiles(c.gu.fmt, c.gu.cols))
    rows_per_block = 16 * (WARPS // kw)
    tiles = -(-c.inter // rows_per_block)
    tiles_s = -(-c.s_inter // rows_per_block) if sops else 0
    sg, su = (Bank(sops[0]), Bank(sops[1])) if sops else (Bank(None), Bank(None))
    items = (min(c.gu.codes.shape[0], c.pairs) * tiles if routed else 0) + tiles_s
    args = (*Bank(c.gu).args(), *sg.args(), *su.args(), ptr(c.act.units), i32(int(routed)),
            i32(c.k), ptr(c.wts), ptr(c.x), np.int64(_ld(c.x)), ptr(c.act.act),
            ptr(c.act.sact), i32(c.inter), i32(c.s_inter), i32(c.gu.cols), i32(c.batch),
            f32(c.limit), i32(kw), i32(tiles), i32(tiles_s))
    launch("rows", kname, c.grid(kname, items), (32 * WARPS,), args)


def _moe_down(kname: str, routed: bool, sops, c: MoeCall) -> None:
    hidden = c.dn.rows
    kw = pick_split(c.k * -(-hidden // 32), _k_tiles(c.dn.fmt, c.inter))
    tiles = -(-hidden // (32 * (WARPS // kw)))
    tiles_s = tiles if sops else 0
    items = (min(c.dn.codes.shape[0], c.pairs) * tiles if routed else 0) + tiles_s
    args = (*Bank(c.dn).args(), *Bank(sops[2] if sops else None).args(), ptr(c.act.units),
            i32(int(routed)), ptr(c.act.act), ptr(c.act.sact), ptr(c.act.part),
            ptr(c.act.spart), i32(hidden), i32(c.inter), i32(c.s_inter), i32(c.batch), i32(kw),
            i32(tiles), i32(tiles_s))
    launch("rows", kname, c.grid(kname, items), (32 * WARPS,), args)


def _moe_rows(gate_up, down, idx, wts, x, act, y, batch, inter, limit, shared) -> None:
    """fp32 experts: ds4/kernels/moe.py once per token (its experts read once per token)."""
    assert not is_packed(gate_up), "packed experts must be kernel_ready"
    k = idx.shape[1]
    for b in range(batch):
        a = act.act[b * k:(b + 1) * k]
        plain_moe.moe_gate_up(gate_up[:, :inter], gate_up[:, inter:], idx[b], wts[b], x[b], a,
                              limit)
        plain_moe.moe_down(down, idx[b], a, y[b])
        if shared is not None:
            s = act.sact[b:b + 1, :shared[0].shape[0]]
            plain_moe.moe_gate_up(shared[0], shared[1], None, None, x[b], s, limit)
            plain_moe.moe_down(shared[2], None, s, y[b], accumulate=True)


def _expert_rows(w, e: int, start: int, stop: int) -> np.ndarray:
    """fp32 rows [start, stop) of expert e of a stack."""
    return dense(w[e])[start:stop]


def _swiglu32(g, u, limit: float, weight) -> np.ndarray:
    return (_swiglu(g, u, limit) * np.float32(weight)).astype(np.float32)


def moe_numpy(gate_up, down, idx, wts, x, act, y, batch: int, inter: int, limit: float,
              shared=None) -> None:
    """NumPy twin of moe (act unused; device inputs are copied to the host)."""
    fmt, dfmt = _kernel_fmt(gate_up), _kernel_fmt(down)
    idx, wts, x = _host(idx), _host(wts), np.asarray(_host(x), np.float32)
    k = idx.shape[1]
    for b in range(batch):
        parts = []
        for j in range(k):
            e = int(idx[b, j])
            g = rows_numpy(_expert_rows(gate_up, e, 0, inter), fmt, x[b:b + 1])[0]
            u = rows_numpy(_expert_rows(gate_up, e, inter, 2 * inter), fmt, x[b:b + 1])[0]
            a = _swiglu32(g, u, limit, wts[b, j])
            parts.append(rows_numpy(dense(down[e]), dfmt, a[None])[0])
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        if shared is not None:
            total = total + _shared_numpy(shared, x[b:b + 1], limit)
        y[b] = total


def _shared_numpy(shared, x, limit: float) -> np.ndarray:
    fmts = [_kernel_fmt(m) for m in shared]
    g = rows_numpy(dense(shared[0]), fmts[0], x)[0]
    u = rows_numpy(dense(shared[1]), fmts[1], x)[0]
    return rows_numpy(dense(shared[2]), fmts[2], _swiglu32(g, u, limit, 1.0)[None])[0]


def decode_words(w, out) -> None:
    """Test hook: out [rows, cols] = the bf16 words rows.cu feeds the mma for each code of a 2-D
    packed matrix (the weight times 2^-32), in column order."""
    op = operand(w)
    chunks = op.rows * op.cols // CHUNK[op.fmt]
    launch("rows", f"rows_decode_{op.fmt}", (-(-chunks // 256),), (256,),
           (ptr(op.codes), ptr(op.scale), i32(op.rows), i32(op.cols), i32(op.sc_ld),
            i32(op.shift), ptr(out)))


def decode_words_numpy(w, out) -> None:
    """NumPy twin of decode_words: bf16 words of the weights times 2^-32 (exact)."""
    out[...] = to_bf16(dense(w) * np.float32(2.0 ** -32)).reshape(out.shape)
