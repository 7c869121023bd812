"""The routed experts of a decode batch on tensor cores (ds4/kernels/rows.cu's MoE kernels)
and their NumPy twins: each distinct expert of the batch read once, its tokens as the mma's
columns, the per-pick products summed in slot order, then the shared expert (accuracy and row
independence as in ds4/kernels/rows.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ds4.kernels import f32, i32, kernel, launch, ptr
from ds4.kernels import moe as plain_moe
from ds4.kernels.moe import _swiglu
from ds4.kernels.rows import (
    FP4,
    FP8,
    KERNEL_NAME,
    MAX_BATCH,
    WARPS,
    Operand,
    _check_rows,
    _host,
    _k_tiles,
    _kernel_fmt,
    _ld,
    dense,
    is_packed,
    operand,
    pick_split,
    rows_numpy,
)

UNIT = 10  # ints per expert in the grouping table (rows.cu)
MAX_PAIRS = 64  # tokens x slots of one MoE call
MOE_KERNELS = {(FP4, FP8), (FP4, "bf16"), (FP8, FP8), ("bf16", "bf16")}


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
