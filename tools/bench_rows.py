"""Micro-benchmark of the batched tensor-core kernels (ds4/kernels/rows.py) at V4-Flash shapes.

For B = 1, 2, 4, 8 rows of x: microseconds per launch, GB/s of the bytes read once (codes +
scales + x; for the MoE each distinct expert hit once, plus the shared expert), the ratio to a
device copy measured in the same run, and the old one-vector packed kernel
(ds4/kernels/packed.py, or gemv.py for bf16) at B = 1. Timing as tools/bench_packed.py: CUDA
graphs rotating over enough weight copies to leave the L2.

The placed-MoE lines (--placed, or with the MoE table) run the same experts as PlacedStacks
with every --host-every'th expert in pinned mapped host memory (read over PCIe), read once per
batch through their address tables, against the per-member placed.cu kernels they replace.

The MoE lines split x and the activations once (rows.split_rows) wherever the scratch has the
words, as the decoder's does ("spli=0": a scratch without them, the kernels splitting x).

    PYTHONPATH=. python3 tools/bench_rows.py [--batches 1,2,4,8] [--no-moe] [--placed]
    PYTHONPATH=. python3 tools/bench_rows.py --moe-picks 2,4,6,8,12,16 --batches 1,2
    PYTHONPATH=. python3 tools/bench_rows.py --moe-picks 2,4,5,6,8 --batches 1 --moe-shared
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_packed import (
    EXPERTS,
    HIDDEN,
    INTER,
    TOP_K,
    bench_bf16,
    bench_gemv,
    copies,
    fp4_matrix,
    fp8_matrix,
    per_launch,
)
from timing import copy_rate

from ds4.kernels import packed as P
from ds4.kernels import placed as PL
from ds4.kernels import rows as R
from ds4.kernels import rows_moe as RM
from ds4.model.packed import FP4, FP8, PackedMatrix
from ds4.model.placement import PlacedStack

SHAPES = {  # name: (format, rows, cols, rows_per_group)
    "q_a 1024x4096": (FP8, 1024, 4096, None),
    "q_b 32768x1024": (FP8, 32768, 1024, None),
    "kv 512x4096": (FP8, 512, 4096, None),
    "o_a 8192x4096 (8 groups)": (FP8, 8192, 4096, 1024),
    "o_b 4096x8192": (FP8, 4096, 8192, None),
    "router 256x4096": ("bf16", 256, 4096, None),
    "shared gate 2048x4096": (FP8, 2048, 4096, None),
    "shared down 4096x2048": (FP8, 4096, 2048, None),
    "expert w1/w3 2048x4096": (FP4, 2048, 4096, None),
    "expert w2 4096x2048": (FP4, 4096, 2048, None),
    "head 129280x4096": ("bf16", 129280, 4096, None),  # the engine step's largest read (1 GB)
}


def weight(cp, fmt: str, rows: int, cols: int):
    """A random device matrix of the format, as the decoder holds it."""
    if fmt == FP8:
        return PackedMatrix(FP8, *fp8_matrix(cp, rows, cols), cols)
    if fmt == FP4:
        return PackedMatrix(FP4, *fp4_matrix(cp, rows, cols), cols)
    return cp.random.randint(0, 1 << 14, (rows, cols), dtype=cp.int32).astype(cp.uint16)


def weights(cp, fmt, rows, cols) -> list:
    """Enough copies of a random matrix to leave the L2 between launches."""
    return [weight(cp, fmt, rows, cols) for _ in range(copies(rows * cols))]


def bench_matvec(cp, mats, group, batch, **kw) -> tuple[float, float]:
    """(seconds per launch, GB/s) of rows.matvec for `batch` rows of x (kw: tiles, split)."""
    rows, cols = mats[0].shape
    width = cols * (rows // group if group else 1)
    x = cp.random.standard_normal((batch, width), dtype=cp.float32)
    y = cp.zeros((batch, rows), cp.float32)
    t = per_launch(cp, [lambda w=w: R.matvec(w, x, y, batch, rows_per_group=group, **kw)
                        for w in mats])
    return t, (mats[0].nbytes + x.nbytes) / t


def old_b1(cp, fmt, rows, cols, group, copy) -> float:
    """Seconds of the one-vector kernel the decoder uses today on this shape."""
    if fmt == "bf16":
        return 2 * rows * cols / bench_bf16(cp, rows, cols, group)
    return bench_gemv(cp, fmt, rows, cols, group, copy)[0]


def expert_bank(cp):
    """256 FP4 experts (gate and up stacked as gate_up) and the FP8 shared expert."""
    gu = PackedMatrix(FP4, *fp4_matrix(cp, EXPERTS * 2 * INTER, HIDDEN), HIDDEN)
    gu = PackedMatrix(FP4, gu.codes.reshape(EXPERTS, 2 * INTER, -1),
                      gu.scale.reshape(EXPERTS, 2 * INTER, -1), HIDDEN)
    dn = PackedMatrix(FP4, *fp4_matrix(cp, EXPERTS * HIDDEN, INTER), INTER)
    dn = PackedMatrix(FP4, dn.codes.reshape(EXPERTS, HIDDEN, -1),
                      dn.scale.reshape(EXPERTS, HIDDEN, -1), INTER)
    shared = tuple(PackedMatrix(FP8, *fp8_matrix(cp, r, c), c)
                   for r, c in ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)))
    return gu, dn, shared


def pick_sets(batch: int, k: int = TOP_K) -> list[np.ndarray]:
    """8 sets of `batch` tokens' k distinct random experts (one per graph launch)."""
    rng = np.random.default_rng(batch)
    return [np.stack([rng.choice(EXPERTS, k, replace=False) for _ in range(batch)])
            for _ in range(8)]


def bench_moe(cp, bank, batch: int, with_shared: bool, per_expert: float | None = None,
              split_x: bool = True, k: int = TOP_K, **kw) -> tuple[float, float, int]:
    """(seconds, GB/s, distinct experts) of rows.moe for `batch` tokens of k random picks
    (per_expert: an expert's bytes, for placed stacks whose nbytes count the device share;
    split_x False: a scratch without split words, so the kernels split x themselves)."""
    gu, dn, shared = bank
    scratch = RM.moe_scratch(cp, batch, k, INTER, HIDDEN, INTER)
    if not split_x:
        scratch.words = scratch.act_words = None
    x = cp.random.standard_normal((batch, HIDDEN), dtype=cp.float32)
    y = cp.zeros((batch, HIDDEN), cp.float32)
    wts = cp.full((batch, k), 0.2, cp.float32)
    picks = pick_sets(batch, k)
    idxs = [cp.asarray(p.astype(np.int32)) for p in picks]
    sh = shared if with_shared else None
    t = per_launch(cp, [lambda i=i: RM.moe(gu, dn, i, wts, x, scratch, y, batch, INTER, 10.0, sh,
                                             **kw)
                        for i in idxs])
    distinct = float(np.mean([len(np.unique(p)) for p in picks]))
    per_expert = per_expert or (gu.nbytes + dn.nbytes) / EXPERTS
    total = distinct * per_expert + (sum(m.nbytes for m in shared) if sh else 0) + x.nbytes
    return t, total / t, distinct


def placed_bank(cp, bank, host_every: int) -> tuple:
    """The bank with its routed experts placed: every host_every'th one in host memory."""
    gu, dn, shared = bank
    resident = np.arange(EXPERTS) % host_every != 0
    return PlacedStack.copy_of(cp, gu, resident), PlacedStack.copy_of(cp, dn, resident), shared


def old_placed(cp, placed, batch: int) -> float:
    """Seconds of the per-member placed.cu kernels for `batch` tokens (routed experts only):
    what the batch decoder ran before rows.moe read placed stacks."""
    gu, dn, _ = placed
    x = cp.random.standard_normal((batch, HIDDEN), dtype=cp.float32)
    y, act = cp.zeros((batch, HIDDEN), cp.float32), cp.zeros((TOP_K, INTER), cp.float32)
    wts = cp.full(TOP_K, 0.2, cp.float32)
    idxs = [cp.asarray(p.astype(np.int32)) for p in pick_sets(batch)]

    def members(i):
        for b in range(batch):
            PL.moe_placed(gu, dn, INTER, i[b], wts, x[b], act, y[b], 10.0)

    return per_launch(cp, [lambda i=i: members(i) for i in idxs])


def placed_table(cp, copy, batches, bank, host_every: int) -> None:
    """rows.moe over placed experts (with and without the shared expert) against placed.cu once
    per member."""
    placed = placed_bank(cp, bank, host_every)
    per_expert = (bank[0].nbytes + bank[1].nbytes) / EXPERTS
    host = ~placed[0].resident
    for with_shared in (False, True):
        for b in batches:
            t, rate, distinct = bench_moe(cp, placed, b, with_shared, per_expert)
            on_host = np.mean([host[np.unique(p)].sum() for p in pick_sets(b)])
            label = (f"placed moe {distinct:4.1f} ({on_host:3.1f} host)"
                     + (" +shared" if with_shared else ""))
            old = None if with_shared else old_placed(cp, placed, b)
            line(label, b, t, rate, copy, old, "per-member placed.cu")


def old_moe(cp, bank) -> float:
    """Seconds of the one-token packed expert kernels (gate_up + down, no shared expert)."""
    gu, dn, _ = bank
    rng = np.random.default_rng(0)
    picks = [cp.asarray(rng.choice(EXPERTS, TOP_K, replace=False).astype(np.int32))
             for _ in range(8)]
    wts = cp.full(TOP_K, 0.2, cp.float32)
    x = cp.random.standard_normal(HIDDEN, dtype=cp.float32)
    act, y = cp.zeros((TOP_K, INTER), cp.float32), cp.zeros(HIDDEN, cp.float32)
    halves = (gu.codes[:, :INTER], gu.scale[:, :INTER], gu.codes[:, INTER:], gu.scale[:, INTER:])

    def one(i):
        P.moe_gate_up_fp4(*halves, i, wts, x, act, 10.0)
        P.moe_down_fp4(dn.codes, dn.scale, i, act, y)

    return per_launch(cp, [lambda i=i: one(i) for i in picks])


def line(name: str, batch: int, seconds: float, rate: float, copy: float, old=None,
         old_name: str = "old B=1") -> None:
    extra = ("" if old is None
             else f"   {old_name} {old * 1e6:7.2f} us ({seconds / old:4.2f}x time)")
    print(f"{name:28s} B={batch}  {seconds * 1e6:8.2f} us {rate / 1e9:7.0f} GB/s "
          f"{rate / copy:5.2f}x copy{extra}", flush=True)


TILES = ((1, 4), (2, 2), (1, 8), (2, 4), (4, 2))
SPLITS = (1, 2, 4, 8)


def variants(cp, copy) -> None:
    """Every kernel variant (tiles per warp, k-tiles per stage) with every k-split, per shape,
    at B = 1 and 8 (bf16 has two variants); the fastest at B = 1 is marked."""
    for name, (fmt, rows, cols, group) in SHAPES.items():
        mats = weights(cp, fmt, rows, cols)
        best = None
        for tiles in TILES[:2] if fmt == "bf16" else TILES:
            if group and group % (16 * tiles[0]):
                continue
            for split in SPLITS:
                for b in (1, 8):
                    t, rate = bench_matvec(cp, mats, group, b, tiles=tiles, split=split)
                    line(f"{name} t{tiles[0]}d{tiles[1]} s{split}", b, t, rate, copy)
                    if b == 1 and (best is None or t < best[0]):
                        best = (t, tiles, split)
        print(f"best B=1 {name}: t{best[1][0]}d{best[1][1]} s{best[2]} {best[0] * 1e6:.2f} us")
        del mats


def moe_table(cp, copy, batches, placed_only: bool = False, host_every: int = 4) -> None:
    """The routed experts (and + shared) for B tokens, against the one-token kernels; then the
    same over placed stacks."""
    bank = expert_bank(cp)
    if not placed_only:
        plain_table(cp, copy, batches, bank)
    placed_table(cp, copy, batches, bank, host_every)


def plain_table(cp, copy, batches, bank) -> None:
    """rows.moe over a device stack, against the one-token packed kernels."""
    old = old_moe(cp, bank)
    for with_shared, kw in ((False, {}), (True, {}), (True, {"split_x": False}),
                            (True, {"fuse_shared": False}), (True, {"persistent": True})):
        for b in batches:
            t, rate, distinct = bench_moe(cp, bank, b, with_shared, **kw)
            label = (f"moe {distinct:4.1f} experts" + (" +shared" if with_shared else "")
                     + "".join(f" {k[:4]}={int(v)}" for k, v in kw.items()))
            line(label, b, t, rate, copy, old if b == 1 and not with_shared else None)


def moe_splits(cp, copy, batches=(1, 8)) -> None:
    """The MoE kernels at fixed k-splits (1: a warp an item; rows_moe.moe_split picks), on a
    persistent grid and one block an item, + shared."""
    bank, chosen = expert_bank(cp), RM.moe_split
    try:
        for persistent in (True, False):
            for split in SPLITS:
                RM.moe_split = lambda groups, k_tiles, s=split: s
                for b in batches:
                    t, rate, distinct = bench_moe(cp, bank, b, True, persistent=persistent)
                    line(f"moe +shared split {split} pers={int(persistent)}", b, t, rate, copy)
    finally:
        RM.moe_split = chosen


def gate_up_items(batch: int, k: int, experts: float, shared: bool = False) -> float:
    """The gate/up launch's work items for `experts` distinct experts hit by `batch` tokens of
    k picks, as rows_moe's launcher counts them (row tiles an expert, and the shared expert's
    where fused, times the passes over more than 4 tokens)."""
    _, tiles, tiles_s = RM.gate_up_tiles(k, INTER, FP4, HIDDEN, INTER if shared else 0)
    return (experts * tiles + tiles_s) * RM.moe_passes(batch)


def moe_picks(cp, copy, batches, picks, shared: bool = False) -> None:
    """The routed experts at k picks a token (shared: with the FP8 shared expert fused, the
    layer's own launch, which reads x split once): does the time follow the bytes (a line
    through the origin) or the work items per block slot (steps)? (rows_moe.ITEM_WARPS as
    set: --item-warps.)"""
    bank = expert_bank(cp)
    name = "rows_gate_up_xs_fp4_fp8_n1" if shared else "rows_gate_up_fp4_none_n1"
    for b in batches:
        for k in picks:
            t, rate, distinct = bench_moe(cp, bank, b, shared, k=k)
            items = gate_up_items(b, k, distinct, shared)
            kw = RM.gate_up_tiles(k, INTER, FP4, HIDDEN)[0]
            slots = RM.resident_blocks(name, RM.item_warps(kw))
            line(f"moe k={k:2d} {distinct:5.1f} experts", b, t, rate, copy)
            print(f"{'':28s}   {t * 1e6 / distinct:6.2f} us an expert, gate/up items {items:6.0f}"
                  f" = {items / slots:4.2f} a block slot ({slots})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--no-moe", action="store_true")
    ap.add_argument("--variants", action="store_true", help="kernel variants and k-splits too")
    ap.add_argument("--only-moe", action="store_true", help="the MoE table alone")
    ap.add_argument("--moe-splits", action="store_true",
                    help="the MoE at each k-split alone (1: a warp an item)")
    ap.add_argument("--moe-picks", default="",
                    help="the routed experts alone at these picks a token (e.g. 2,4,6,8,12,16)")
    ap.add_argument("--moe-shared", action="store_true",
                    help="--moe-picks with the shared expert fused (the layer's launch)")
    ap.add_argument("--item-warps", type=int, default=RM.WARPS,
                    help="warps of the MoE lines' blocks: 8, 4 or 2 (rows_moe.ITEM_WARPS)")
    ap.add_argument("--placed", action="store_true",
                    help="the placed-MoE lines alone (experts partly in mapped host memory)")
    ap.add_argument("--host-every", type=int, default=4,
                    help="placed lines: every n'th expert in host memory (default 4)")
    args = ap.parse_args()
    import cupy as cp

    batches = [int(b) for b in args.batches.split(",")]
    RM.ITEM_WARPS = args.item_warps
    copy = copy_rate(cp)
    print(f"device copy: {copy / 1e9:.0f} GB/s (read + write)\n")
    if args.moe_splits:
        moe_splits(cp, copy, batches)
        return
    if args.moe_picks:
        moe_picks(cp, copy, batches, [int(k) for k in args.moe_picks.split(",")],
                  args.moe_shared)
        return
    if args.placed:
        moe_table(cp, copy, batches, placed_only=True, host_every=args.host_every)
        return
    for name, (fmt, rows, cols, group) in ({} if args.only_moe else SHAPES).items():
        old = old_b1(cp, fmt, rows, cols, group, copy)
        mats = weights(cp, fmt, rows, cols)
        for b in batches:
            t, rate = bench_matvec(cp, mats, group, b)
            line(f"{fmt} {name}", b, t, rate, copy, old if b == 1 else None)
        del mats
    if not args.no_moe:
        moe_table(cp, copy, batches, host_every=args.host_every)
    if args.variants:
        moe_splits(cp, copy)
        variants(cp, copy)


if __name__ == "__main__":
    main()
