"""The routed experts of a decode batch on tensor cores (ds4/kernels/rows_moe.cu; the NumPy
twins: rows_moe_twin.py): each distinct expert of the batch read once, its tokens as the mma's
columns, the per-pick products summed in slot order, then the shared expert (accuracy and row
independence as in ds4/kernels/rows.py).

The experts are a plain stack (expert e at base + e * stride) or a placed one
(ds4/model/placement.py's PlacedStack: each expert in device or mapped host memory, found
through per-expert address tables that re-placement rewrites between graph replays); a placed
stack's host experts are grouped first, so their PCIe reads start in the first wave. A batch
graph's idle rows (members at or past a device-side live count) read no expert and count no
pick."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ds4 import kernels
from ds4.kernels import f32, i32, kernel, launch, ptr
from ds4.kernels import moe as plain_moe
from ds4.kernels.rows import (
    FP4,
    FP8,
    KERNEL_NAME,
    MAX_BATCH,
    WARPS,
    Operand,
    _check_rows,
    _k_tiles,
    _ld,
    is_packed,
    operand,
    pick_split,
    split_rows,
    words_ld,
)

UNIT = 10  # ints per expert in the grouping table (rows_moe.cu)
MAX_PAIRS = 64  # tokens x slots of one MoE call
MOE_KERNELS = {(FP4, FP8), (FP4, "bf16"), (FP8, FP8), ("bf16", "bf16")}
MOE_SPLIT = 2  # warps splitting an expert's k at most: the best of 1, 2, 4, 8 (docs/PERF.md)
# Warps of an MoE block: WARPS, or 4 or 2 (the same rows, k-spans and sums in more, smaller
# items). Alone, six routed experts at B = 1 ran a third faster on 4-warp blocks; in a layer,
# where the shared expert makes them seven, neither 4 nor 2 warps gained (docs/PERF.md's stop
# 47).
ITEM_WARPS = WARPS


@dataclass
class MoeScratch:
    """Buffers of one MoE call: routed act [pairs, inter], shared act [batch, s_inter], the
    per-pair down products [pairs, D], the shared one [batch, D], the expert groups (int32);
    on the GPU the split words (rows.split_rows) of x for FP4 experts and an FP8 shared expert
    (words), of act (FP4) and of sact (FP8) (act_words), None elsewhere."""

    act: object
    sact: object
    part: object
    spart: object
    units: object
    words: tuple | None = None
    act_words: tuple | None = None


def moe_scratch(xp, batch: int, k: int, inter: int, hidden: int,
                shared_inter: int = 0) -> MoeScratch:
    """Scratch for moe() of up to `batch` tokens with k experts each (allocated once)."""
    pairs = batch * k
    assert batch <= MAX_BATCH and pairs <= MAX_PAIRS
    z = functools.partial(xp.zeros, dtype=xp.float32)
    scratch = MoeScratch(z((pairs, inter)), z((batch, max(shared_inter, 1))), z((pairs, hidden)),
                         z((batch, hidden)), xp.zeros(1 + UNIT * pairs, dtype=xp.int32))
    if xp is not np:
        w = functools.partial(xp.zeros, dtype=xp.uint32)
        scratch.words = (w((batch, words_ld(FP4, hidden))), w((batch, words_ld(FP8, hidden))))
        scratch.act_words = (w((pairs, words_ld(FP4, inter))),
                             w((batch, words_ld(FP8, max(shared_inter, 1)))))
    return scratch


@dataclass
class Stack:
    """A stack of experts as the MoE kernels read it: one expert's layout (op), the number of
    experts, and for a placed stack the per-expert code / scale address tables and the
    in-host-memory flags (None for a plain stack: expert e at op.codes[e])."""

    op: Operand
    count: int
    code_ptrs: object = None
    scale_ptrs: object = None
    on_host: object = None

    @property
    def fmt(self) -> str:
        """The experts' format (rows.py's FP8 / FP4 / "bf16")."""
        return self.op.fmt

    @property
    def rows(self) -> int:
        """Rows of one expert."""
        return self.op.rows

    @property
    def cols(self) -> int:
        """Columns of one expert."""
        return self.op.cols


def stack_of(w) -> Stack | None:
    """The kernel view of an expert stack [E, rows, cols] (a packed or bf16-word stack, or a
    PlacedStack), None where rows_moe.cu cannot read it."""
    if getattr(w, "placed", False):
        op = operand(w[0])
        return None if op is None else Stack(op, w.shape[0], w.code_ptrs, w.scale_ptrs,
                                              w.on_host)
    op = operand(w)
    return None if op is None else Stack(op, op.codes.shape[0])


@dataclass
class Bank:
    """Kernel arguments of a stack of experts (or one matrix: strides 0)."""

    op: Operand | Stack | None

    def args(self) -> tuple:
        """(codes, scales, code table, scale table, strides, scale ld, shift) as rows_moe.cu's
        Bank takes them."""
        st = self.op
        if st is None:
            return (ptr(None),) * 4 + (np.int64(0), np.int64(0), i32(0), i32(0))
        op = st.op if isinstance(st, Stack) else st
        if isinstance(st, Stack) and st.code_ptrs is not None:
            return (ptr(None), ptr(None), ptr(st.code_ptrs), ptr(st.scale_ptrs), np.int64(0),
                    np.int64(0), i32(op.sc_ld), i32(op.shift))
        stacked = op.codes.ndim == 3
        return (ptr(op.codes), ptr(op.scale), ptr(None), ptr(None),
                np.int64(op.codes.strides[0] if stacked else 0),
                np.int64(op.scale.strides[0] if stacked and op.scale is not None else 0),
                i32(op.sc_ld), i32(op.shift))


@functools.cache
def resident_blocks(name: str, warps: int = WARPS) -> int:
    """Blocks of kernel `name` (`warps` a block) resident on the GPU at once: a persistent
    grid."""
    return kernels.resident_blocks(kernel("rows_moe", name), 32 * warps)


def item_warps(kw: int) -> int:
    """Warps of the blocks of an MoE launch whose warps split k kw ways."""
    return max(kw, ITEM_WARPS)


def moe(gate_up, down, idx, wts, x, act: MoeScratch, y, batch: int, inter: int, limit: float,
        shared=None, persistent: bool = False, fuse_shared: bool = True, counts=None,
        live=None, shared_done=None) -> None:
    """y[b] = sum_j down_e(swiglu(gate_e x[b], up_e x[b]) * wts[b, j]), e = idx[b, j], + the
    shared expert (gate, up, down) of x[b] (weight 1), for b < batch. gate_up [E, 2*inter, D]
    (gate rows then up rows), down [E, D, inter]: FP4/FP8 PackedMatrix stacks, bf16 words, or
    PlacedStacks (experts in device or mapped host memory); idx/wts [>= batch, k] contiguous
    int32/fp32 on the device; act from moe_scratch. Each expert hit is read once for all the
    tokens that picked it (grouped on the device, host experts first).
    counts (device int32 [E]): += 1 per pick (placement's routing counts); live (device int32
    [1], read at run time): tokens b >= *live are idle rows, which read no routed expert
    (their y is the shared expert alone) and count nothing.
    persistent: resident blocks loop over the work (else, as measured faster at B > 4 and
    even below, one block per item of the most the call can have: those past the units hit
    exit at once); fuse_shared: the shared expert in the routed launches (else launches of
    its own); shared_done: the event shared_ahead returned for this call (its shared expert
    already launched on a side stream: only the routed experts here, then the sum waits for
    it). None of them changes y."""
    call = _call(gate_up, down, idx, wts, x, act, batch, inter, limit, shared, persistent)
    if call is None:
        _moe_rows(gate_up, down, idx, wts, x, act, y, batch, inter, limit, shared)
        return
    gu, k, sops = call.gu, call.k, call.sops
    parts = _moe_parts(gu.fmt, sops, fuse_shared)
    xs = call.split_ready(parts)
    assert shared_done is None or xs, "shared_ahead ran the shared expert of a call that fuses it"
    _group(call, live, counts, split=shared_done is not None)
    if shared_done is not None:  # the routed experts alone, reading x split once
        _routed_xs(call)
        import cupy

        cupy.cuda.get_current_stream().wait_event(shared_done)  # (the join of the side branch)
    else:
        _launch_parts(call, parts, xs)
    n = batch * call.dn.rows
    launch("rows_moe", "rows_moe_sum", (-(-n // 256),), (256,),
           (ptr(act.part), ptr(act.spart if sops else None), i32(k), i32(call.dn.rows),
            i32(batch), ptr(live), ptr(idx), ptr(y), np.int64(_ld(y))))


def shared_ahead(gate_up, down, idx, x, act: MoeScratch, batch: int, inter: int, limit: float,
                 shared, stream):
    """The shared expert of the moe() call that follows (same arguments), launched now on
    `stream`, forked from the current stream (x is ready) and joined by that call before its
    sum: it then streams its weights while the router, the route and the grouping (small
    launches that wait on each other) run, instead of after them. Returns the event to pass
    as moe()'s shared_done, or None (nothing launched) where moe() fuses it anyway: no shared
    expert, or a call whose launches do not read x split once (the side launches are the
    fused kernel's shared items, so the sums are the same bits)."""
    call = _call(gate_up, down, idx, None, x, act, batch, inter, limit, shared, False)
    if call is None or call.sops is None:
        return None
    parts = _moe_parts(call.gu.fmt, call.sops, True)
    if not call.split_ready(parts):
        return None
    import cupy

    stream.wait_event(cupy.cuda.get_current_stream().record())
    name = "xs_" + parts[0][0]
    with stream:
        split_rows([(x, batch, call.gu.cols, FP8, act.words[1])])
        _moe_gate_up(f"rows_gate_up_{name}", False, call.sops, call, True)
        split_rows([(act.sact, batch, call.s_inter, FP8, act.act_words[1])])
        _moe_down(f"rows_down_{name}", False, call.sops, call, True)
        return stream.record()


def _call(gate_up, down, idx, wts, x, act, batch, inter, limit, shared, persistent):
    """The MoeCall of a moe() over rows_moe.cu's kernels, None where it cannot read the
    stacks (the per-token fallback)."""
    gu, dn = stack_of(gate_up), stack_of(down)
    sops = [operand(m) for m in shared] if shared is not None else None
    if gu is None or dn is None or (sops is not None and None in sops):
        return None
    call = MoeCall(gu, dn, idx, wts, x, act, batch, inter, sops[0].rows if sops else 0, limit,
                   idx.shape[1], persistent, sops)
    assert call.pairs <= act.part.shape[0] and gu.fmt == dn.fmt and 2 * inter == gu.rows
    placed = [getattr(w, "placed", False) for w in (gate_up, down)]
    assert placed[0] == placed[1], "both stacks placed or neither"
    assert not placed[0] or gu.code_ptrs is not None, "placed stacks on the device (tables)"
    _check_rows(x, batch, gu.cols, "x")
    return call


def _launch_parts(call: MoeCall, parts: list, xs: bool) -> None:
    """gate/up then down of each launch pair (_moe_parts); xs: x and the activations split
    once for the routed FP4 and the shared FP8 experts."""
    a, batch = call.act, call.batch
    if xs:
        split_rows([(call.x, batch, call.gu.cols, FP4, a.words[0]),
                    (call.x, batch, call.gu.cols, FP8, a.words[1])])
        parts = [("xs_" + name, routed, s) for name, routed, s in parts]
    for name, routed, s in parts:
        _moe_gate_up(f"rows_gate_up_{name}", routed, s, call, xs)
    if xs:
        split_rows([(a.act, call.pairs, call.inter, FP4, a.act_words[0]),
                    (a.sact, batch, call.s_inter, FP8, a.act_words[1])])
    for name, routed, s in parts:
        _moe_down(f"rows_down_{name}", routed, s, call, xs)


def _group(call: MoeCall, live, counts, split: bool) -> None:
    """rows_moe_group: the pairs grouped by expert into act.units; split: its other blocks
    split x into the FP4 experts' words (act.words[0]) meanwhile."""
    a, gu, n = call.act, call.gu, call.batch if split else 0
    ld = words_ld(FP4, gu.cols)
    launch("rows_moe", "rows_moe_group", (1 + -(-n * ld // 2 // 256),), (32 * WARPS,),
           (ptr(call.idx), i32(call.pairs), i32(call.k), i32(gu.count), ptr(gu.on_host),
            ptr(live), ptr(counts), ptr(a.units), ptr(call.x if split else None), i32(n),
            i32(gu.cols), np.int64(_ld(call.x)), ptr(a.words[0] if split else None),
            np.int64(ld)))


def _routed_xs(call: MoeCall) -> None:
    """The routed experts of a fused FP4 + FP8-shared call alone (its shared expert ran on the
    side: shared_ahead), through the kernels without a shared expert that read split words
    (x's split by the grouping launch: _group)."""
    a, name = call.act, "xs_fp4_none_n1"
    _moe_gate_up(f"rows_gate_up_{name}", True, None, call, True)
    split_rows([(a.act, call.pairs, call.inter, FP4, a.act_words[0])])
    _moe_down(f"rows_down_{name}", True, None, call, True)


@dataclass
class MoeCall:
    """The operands of one moe() call, shared by its launches."""

    gu: Stack
    dn: Stack
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
    sops: list | None = None  # the shared expert's gate, up, down operands

    @property
    def pairs(self) -> int:
        return self.batch * self.k

    @property
    def passes(self) -> int:
        return moe_passes(self.batch)

    def grid(self, name: str, items: int, warps: int) -> tuple[int]:
        return (min(items, resident_blocks(name, warps)) if self.persistent else items,)

    def split_ready(self, parts: list) -> bool:
        """Whether the launches read x and act split once (rows.cu's xs kernels): one fused
        FP4 + FP8-shared pair, with the scratch's words."""
        return (self.act.words is not None and len(parts) == 1 and parts[0][2] is not None
                and self.gu.fmt == FP4 and parts[0][2][0].fmt == FP8)


def _words(words: tuple, xs: bool) -> tuple:
    """The split-word arguments of an MoE launch: (words, row length) for the routed then the
    shared operand (nulls when the launch reads x itself)."""
    if not xs:
        return (ptr(None), np.int64(0)) * 2
    return tuple(v for a in words for v in (ptr(a), np.int64(a.shape[-1])))


def _moe_parts(fmt: str, sops, fuse: bool) -> list[tuple[str, bool, list | None]]:
    """(kernel suffix, routed?, shared operands or None) of each launch pair."""
    f = KERNEL_NAME[fmt].lower()
    if sops is None:
        return [(f"{f}_none_n1", True, None)]
    s = KERNEL_NAME[sops[0].fmt].lower()
    if fuse:
        assert (fmt, sops[0].fmt) in MOE_KERNELS, f"no MoE kernel for {fmt} + shared {s}"
        return [(f"{f}_{s}_n1", True, sops)]
    return [(f"{f}_none_n1", True, None), (f"{s}_{s}_n1", False, sops)]


def moe_split(groups: int, k_tiles: int) -> int:
    """Warps splitting k in an MoE item, by shape: at most MOE_SPLIT (more, and the items are
    too short to stream)."""
    return min(pick_split(groups, k_tiles), MOE_SPLIT)


def gate_up_tiles(k: int, inter: int, fmt: str, cols: int,
                  s_inter: int = 0) -> tuple[int, int, int]:
    """(warps splitting k, row tiles of one expert, of the shared expert) of the gate/up launch
    for k picks a token of experts with `inter` rows of gate (and of up) over `cols` columns
    in format fmt, and a fused shared expert of s_inter rows (0: none)."""
    kw = moe_split(k * -(-inter // 16), _k_tiles(fmt, cols))
    rows = 16 * (item_warps(kw) // kw)  # of an item
    return kw, -(-inter // rows), -(-s_inter // rows)


def moe_passes(batch: int) -> int:
    """Passes over an expert's tokens, 4 columns a pass (rows_moe.cu's moe_passes)."""
    return 2 if batch > 4 else 1


def _moe_gate_up(kname: str, routed: bool, sops, c: MoeCall, xs: bool = False) -> None:
    kw, tiles, tiles_s = gate_up_tiles(c.k, c.inter, c.gu.fmt, c.gu.cols,
                                       c.s_inter if sops else 0)
    warps = item_warps(kw)
    items = _items(c, routed, tiles, tiles_s)
    sg, su = (Bank(sops[0]), Bank(sops[1])) if sops else (Bank(None), Bank(None))
    args = (*Bank(c.gu).args(), *sg.args(), *su.args(), ptr(c.act.units), i32(int(routed)),
            i32(c.k), ptr(c.wts), ptr(c.x), np.int64(_ld(c.x)), ptr(c.act.act),
            ptr(c.act.sact), i32(c.inter), i32(c.s_inter), i32(c.gu.cols), i32(c.batch),
            f32(c.limit), i32(kw), i32(tiles), i32(tiles_s), *_words(c.act.words, xs))
    launch("rows_moe", kname, c.grid(kname, items, warps), (32 * warps,), args)


def _moe_down(kname: str, routed: bool, sops, c: MoeCall, xs: bool = False) -> None:
    hidden = c.dn.rows
    kw = moe_split(c.k * -(-hidden // 32), _k_tiles(c.dn.fmt, c.inter))
    warps = item_warps(kw)
    tiles = -(-hidden // (32 * (warps // kw)))
    tiles_s = tiles if sops else 0
    items = _items(c, routed, tiles, tiles_s)
    args = (*Bank(c.dn).args(), *Bank(sops[2] if sops else None).args(), ptr(c.act.units),
            i32(int(routed)), ptr(c.act.act), ptr(c.act.sact), ptr(c.act.part),
            ptr(c.act.spart), i32(hidden), i32(c.inter), i32(c.s_inter), i32(c.batch), i32(kw),
            i32(tiles), i32(tiles_s), *_words(c.act.act_words, xs))
    launch("rows_moe", kname, c.grid(kname, items, warps), (32 * warps,), args)


def _items(c: MoeCall, routed: bool, tiles: int, tiles_s: int) -> int:
    """Items of an MoE launch: the row tiles of each routed expert the call can hit (at most
    one a pick) and the shared expert's, once a pass."""
    return ((min(c.gu.count, c.pairs) * tiles if routed else 0) + tiles_s) * c.passes


def _moe_rows(gate_up, down, idx, wts, x, act, y, batch, inter, limit, shared) -> None:
    """fp32 experts: ds4/kernels/moe.py once per token (its experts read once per token)."""
    assert not is_packed(gate_up) and not getattr(gate_up, "placed", False), \
        "packed experts must be kernel_ready"
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
