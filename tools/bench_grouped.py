"""The routed-expert stage of a V4-Flash prefill chunk on packed FP4 experts: the grouped kernels
(ds4/kernels/grouped.cu: codes read in place, one gate/up and one down launch) against the
current path (a widened bf16 slab per hit expert, cuBLAS on the hi + lo rows) and the floor.

Floor = max(the stage's FLOPs at the fp16 GEMM rate, the packed bytes of the experts hit plus
x and the output at the copy rate), both rates measured in the same run (bench_engine's
ceilings). Routing picks top-6 of 256 experts uniformly at random, as the packed random
weights do (nearly every expert hit at chunk 2048); `--skew s` gives expert e a fixed
popularity exp(s g_e), g_e ~ N(0, 1), as trained routers are uneven (s = 1: the busiest expert
gets ~11x the mean rows, and 349 tiles of 64 rows hold what 260 hold uniformly).

    PYTHONPATH=. python3 tools/bench_grouped.py [--chunks 512,2048] [--skew 1] [--json out.json]
    PYTHONPATH=. python3 tools/bench_grouped.py --crossover 768,1024,1536,2048 [--skew 1]
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from timing import ceilings, timed

from ds4.kernels import grouped
from ds4.model import moe
from ds4.model.expert_bank import ExpertBank
from ds4.model.packed import PackedMatrix

EXPERTS, TOP_K, HIDDEN, INTER, LIMIT = 256, 6, 4096, 2048, 10.0
SWEEP = [(1, ""), (1, "s4"), (2, ""), (2, "s4"), (3, ""),
         (4, "")]  # (m16 tiles per block, kernel variant: grouped.VARIANTS)
WG_SWEEP = [(1, "wgmma"), (4, "wgmma")]  # grouped_wg.cu, on compute capability 9.0


def fp4_stack(cp, rows: int, cols: int) -> PackedMatrix:
    """Random MXFP4 experts [EXPERTS, rows, cols] on the device (scales near 2^-6)."""
    codes = cp.random.randint(0, 256, (EXPERTS, rows, cols // 2), dtype=cp.int32)
    scale = cp.random.randint(118, 124, (EXPERTS, rows, cols // 32), dtype=cp.int32)
    return PackedMatrix("fp4", codes.astype(cp.uint8), scale.astype(cp.uint8), cols)


def chunk(cp, S: int, seed: int, skew: float = 0.0):
    """x [S, HIDDEN], ids [S, TOP_K] (distinct experts per token), routing weights."""
    rng = np.random.default_rng(seed)
    if skew:  # top-k of log-popularity + Gumbel noise: picks without replacement, p ~ popularity
        popularity = skew * np.random.default_rng(0).standard_normal(EXPERTS)
        ids = np.argsort(-(popularity - np.log(-np.log(rng.random((S, EXPERTS))))),
                         axis=1)[:, :TOP_K]
    else:
        ids = np.argsort(rng.random((S, EXPERTS)), axis=1)[:, :TOP_K]
    x = rng.standard_normal((S, HIDDEN)).astype(np.float32)
    w = rng.random((S, TOP_K)).astype(np.float32) / TOP_K
    return cp.asarray(x), cp.asarray(ids), cp.asarray(w), len(np.unique(ids))


DENSE = {"q_b 32768x1024": (32768, 1024), "o_b 4096x8192": (4096, 8192),
         "shared gate/up 4096x4096": (4096, 4096), "q_a 1024x4096": (1024, 4096)}


def dense_fp8(cp, rows: int, cols: int) -> PackedMatrix:
    """A random FP8 matrix with 128 x 128 E8M0 tiles on the device."""
    codes = cp.random.randint(0, 256, (rows, cols), dtype=cp.int32).astype(cp.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3E
    scale = cp.random.randint(116, 124, (rows // 128, cols // 128), dtype=cp.int32)
    return PackedMatrix("fp8", codes, scale.astype(cp.uint8), cols)


def dense_rows(cp, S: int) -> list[dict]:
    """The FP8 projections of a layer through the grouped GEMM (one expert, one tile table)
    against the current path (linear: a widened bf16 slab, then cuBLAS on the hi + lo rows)."""
    from ds4.model.linear import linear

    out = []
    for name, (rows, cols) in DENSE.items():
        w = dense_fp8(cp, rows, cols)
        x = cp.random.standard_normal((S, cols), dtype=cp.float32)
        tiles = cp.zeros((grouped.max_tiles(S, 1, 64), 4), cp.int32)
        n = cp.zeros(1, cp.int32)
        grouped.expert_tiles(cp.asarray([S], dtype=cp.int64), 64, tiles, n)
        words = grouped.split_words(x, grouped.new_words(cp, S, cols))
        y = cp.empty((S, rows), cp.float32)
        new = timed(cp, lambda: grouped.gemm(w, grouped.split_words(x, words), None, tiles, n, 4,
                                             y), repeat=10)
        old = timed(cp, lambda: linear(cp, x, w), repeat=10)
        want = linear(cp, x, w)
        err = float(cp.abs(y - want).max() / cp.abs(want).max())
        out.append({"name": name, "chunk": S, "grouped_ms": new * 1e3, "current_ms": old * 1e3,
                    "tflops": 2 * S * rows * cols / new / 1e12, "rel_err": err})
    return out


class _Cfg:
    moe_intermediate_size, swiglu_limit = INTER, LIMIT


def current(cp, bank, x, ids, w):
    """The per-expert path (slab + cuBLAS per hit expert)."""
    saved, moe.GROUPED_KERNELS = moe.GROUPED_KERNELS, False
    try:
        return moe._routed_grouped(cp, _Cfg, bank, x, ids, w, cp.asnumpy)
    finally:
        moe.GROUPED_KERNELS = saved


def launches_ms(cp, gate_up, down, x, ids, w, mt: int, variant: str) -> dict:
    """Device ms of the gate/up and the down launch alone (inputs prepared once), tiles of
    16 * mt rows."""
    S, k = ids.shape
    R, E, D = S * k, EXPERTS, HIDDEN
    flat = ids.reshape(-1)
    order = cp.argsort(flat).astype(cp.int32)
    tiles = cp.zeros((grouped.max_tiles(R, E, 16 * mt), 4), cp.int32)
    n = cp.zeros(1, cp.int32)
    grouped.expert_tiles(cp.bincount(flat, minlength=E).astype(cp.int64), 16 * mt, tiles, n)
    wg = variant == "wgmma"  # grouped_wg.cu's kernels, words in their order
    split, kind = (grouped.split_words_wg, "") if wg else (grouped.split_words, variant)
    words = split(x, grouped.new_words(cp, S, D, wg))
    wts = cp.ascontiguousarray(w.reshape(-1))
    act = cp.empty((R, INTER), cp.float32)
    act_words = grouped.new_words(cp, R, INTER, wg)
    rows = cp.empty((R, D), cp.float32)
    return {
        "mt": mt, "variant": variant or "default",
        "gate_up_ms": 1e3 * timed(cp, lambda: grouped.gate_up(
            gate_up, words, order, k, wts, tiles, n, mt, act, LIMIT, variant=kind), repeat=10),
        "split_act_ms": 1e3 * timed(cp, lambda: split(act, act_words), repeat=10),
        "down_ms": 1e3 * timed(cp, lambda: grouped.gemm(
            down, act_words, order, tiles, n, mt, rows, variant=kind), repeat=10)}


def measure(cp, gate_up, down, S: int, rates: dict, skew: float = 0.0) -> dict:
    """Times and floor of one chunk size."""
    x, ids, w, hit = chunk(cp, S, S, skew)
    bank = ExpertBank.from_stacks(cp, gate_up, down)
    R = S * TOP_K
    flops = 2 * R * (2 * INTER * HIDDEN + HIDDEN * INTER)
    per_expert = (gate_up.nbytes + down.nbytes) / EXPERTS
    nbytes = hit * per_expert + 2 * S * HIDDEN * 4
    floor = max(flops / rates["gemm_flop_per_s"], nbytes / rates["copy_bytes_per_s"])
    new = timed(cp, lambda: grouped.routed(cp, gate_up, down, x, ids, w, LIMIT), repeat=10)
    mma = timed(cp, lambda: grouped.routed(cp, gate_up, down, x, ids, w, LIMIT, wg=False),
                repeat=10)
    one = timed(cp, lambda: grouped.routed(cp, gate_up, down, x, ids, w, LIMIT, parts=1),
                repeat=10)
    old = timed(cp, lambda: current(cp, bank, x, ids, w), repeat=5, warmup=1)
    got = grouped.routed(cp, gate_up, down, x, ids, w, LIMIT)
    want = current(cp, bank, x, ids, w)
    err = float(cp.abs(got - want).max() / cp.abs(want).max())
    row = {"chunk": S, "experts_hit": hit, "busiest": int(cp.bincount(ids.reshape(-1)).max()),
           "new_ms": new * 1e3, "bf16_ms": one * 1e3, "mma_sync_ms": mma * 1e3,
           "current_ms": old * 1e3, "floor_ms": floor * 1e3, "tflops_new": flops / new / 1e12,
           "ratio_new": new / floor, "ratio_current": old / floor, "rel_err": err}
    row["launches"] = [launches_ms(cp, gate_up, down, x, ids, w, mt, variant)
                       for mt, variant in SWEEP]
    row["mt"] = grouped.pick_mt(S * TOP_K, EXPERTS)
    best = min(row["launches"], key=lambda t: t["gate_up_ms"] + t["down_ms"])
    if grouped.wgmma_ready(gate_up):
        row["launches"] += [launches_ms(cp, gate_up, down, x, ids, w, mt, variant)
                            for mt, variant in WG_SWEEP]
    pick = (best["mt"], "" if best["variant"] == "default" else best["variant"])
    saved = dict(grouped.TUNED)
    grouped.TUNED[("fp4", row["mt"])] = pick
    try:
        tuned = timed(cp, lambda: grouped.routed(cp, gate_up, down, x, ids, w, LIMIT, wg=False),
                      repeat=10)
        got = grouped.routed(cp, gate_up, down, x, ids, w, LIMIT, wg=False)
    finally:
        grouped.TUNED.clear()
        grouped.TUNED.update(saved)
    row |= {"tuned": pick, "tuned_ms": tuned * 1e3, "tuned_ratio": tuned / floor,
            "tuned_tflops": flops / tuned / 1e12,
            "tuned_rel_err": float(cp.abs(got - want).max() / cp.abs(want).max())}
    return row


def crossover(cp, chunks: list[int], skew: float) -> None:
    """The routed stage at each chunk on grouped.cu's mma.sync kernels and on grouped_wg.cu's
    wgmma ones (what grouped.WG_MIN_MT is set from)."""
    gate_up, down = fp4_stack(cp, 2 * INTER, HIDDEN), fp4_stack(cp, HIDDEN, INTER)
    for S in chunks:
        x, ids, w, _ = chunk(cp, S, S, skew)
        ms = {wg: 1e3 * timed(cp, lambda: grouped.routed(cp, gate_up, down, x, ids, w, LIMIT,
                                                         wg=wg), repeat=10)
              for wg in (False, True)}
        print(f"skew {skew} chunk {S} (m16 tiles {grouped.pick_mt(S * TOP_K, EXPERTS)}): "
              f"mma.sync {ms[False]:.2f} ms, wgmma {ms[True]:.2f} ms", flush=True)


def main() -> None:
    """Print one row per chunk size (and write them as JSON with --json)."""
    import cupy as cp

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", default="512,2048")
    p.add_argument("--skew", type=float, default=0.0, help="uneven expert popularity")
    p.add_argument("--json", default=None)
    p.add_argument("--crossover", default=None, metavar="CHUNKS",
                   help="only time the routed stage on mma.sync and on wgmma at these chunks")
    a = p.parse_args()
    if a.crossover:
        crossover(cp, [int(s) for s in a.crossover.split(",")], a.skew)
        return
    os.environ.setdefault("DS4_GEMM", "bf16x2")
    rates = ceilings(cp)
    print(f"copy {rates['copy_bytes_per_s'] / 1e12:.2f} TB/s, fp16 GEMM "
          f"{rates['gemm_flop_per_s'] / 1e12:.0f} TFLOP/s")
    gate_up, down = fp4_stack(cp, 2 * INTER, HIDDEN), fp4_stack(cp, HIDDEN, INTER)
    rows = [measure(cp, gate_up, down, int(s), rates, a.skew) for s in a.chunks.split(",")]
    print("| chunk | experts hit | grouped | grouped on mma.sync | grouped, DS4_GEMM=bf16 | "
          "current | floor | TFLOP/s | ratio grouped / current | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['chunk']} | {r['experts_hit']} | {r['new_ms']:.2f} ms | "
              f"{r['mma_sync_ms']:.2f} ms | {r['bf16_ms']:.2f} ms"
              f" | {r['current_ms']:.2f} ms | {r['floor_ms']:.2f} ms | {r['tflops_new']:.0f} | "
              f"{r['ratio_new']:.1f}x / {r['ratio_current']:.1f}x | {r['rel_err']:.1e} |")
    for r in rows:
        print(f"chunk {r['chunk']}: best swept (m16 tiles, variant) {r['tuned']}: "
              f"{r['tuned_ms']:.2f} ms, {r['tuned_tflops']:.0f} TFLOP/s, "
              f"{r['tuned_ratio']:.1f}x floor, rel err {r['tuned_rel_err']:.1e}")
    for r in rows:
        print(f"chunk {r['chunk']} (picked m16 tiles per block: {r['mt']}; busiest expert "
              f"{r['busiest']} rows):")
        for t in r["launches"]:
            print(f"  m16 tiles {t['mt']}, {t['variant']}: gate/up {t['gate_up_ms']:.2f} ms,"
                  f" act split {t['split_act_ms']:.2f} ms, down {t['down_ms']:.2f} ms")
    gate_up = down = None
    dense = [r for s in a.chunks.split(",") for r in dense_rows(cp, int(s))]
    print("| FP8 matrix | chunk | grouped GEMM | current (slab + cuBLAS) | TFLOP/s | rel err |")
    print("|---|---|---|---|---|---|")
    for r in dense:
        print(f"| {r['name']} | {r['chunk']} | {r['grouped_ms']:.3f} ms | {r['current_ms']:.3f} ms"
              f" | {r['tflops']:.0f} | {r['rel_err']:.1e} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rates": rates, "rows": rows, "dense": dense}, f, indent=1)


if __name__ == "__main__":
    main()
