"""Prefill attention of one layer at V4-Flash dims: the fused kernel against the model code.

For each layer kind (sliding; CSA: 512 picks per query; HCA: every closed row), chunk and
context (the chunk ends there; ring and compressed rows full of random unit rows), prints the
device time of ds4/kernels/chunk_attention.cu (hi + lo words, and one bf16 rounding as with
DS4_GEMM=bf16) and of the model code's query-block softmax
(ds4/model/attention.py:attend_keys, what prefill ran before), and the FLOP floor: the useful
FLOPs (4 * heads * head_dim per visible key and query, fp32-equivalent: no hi/lo terms) at the
fp16 GEMM rate measured in the same run. Compressor and indexer are outside both timings.
`--fp8` rounds the keys and rows as the official KV is (FP8 before the RoPE dims), and the
kernel then takes lo words for the RoPE dims only (what prefill runs for official checkpoints);
run it beside a plain run to see what that saves.

    PYTHONPATH=. python3 tools/bench_chunk_attention.py --chunks 512,2048 --ctx 4096,32768
    PYTHONPATH=. python3 tools/bench_chunk_attention.py --chunks 2048 --ctx 16384 --fp8
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from bench_flash import FLASH
from timing import ceilings, timed

KINDS = {"sliding": 0, "csa": 4, "hca": 128}


def unit_rows(cp, shape):
    """RMS-normed random rows, as the engine's roped queries and keys are."""
    x = cp.random.standard_normal(shape, dtype=cp.float32)
    return x / cp.sqrt((x * x).mean(axis=-1, keepdims=True))


def layer_inputs(cp, kind: str, chunk: int, ctx: int, fp8: bool = False) -> dict:
    """q, keys, rows and picks of a chunk ending at position ctx (start = ctx - chunk); fp8:
    keys and rows FP8-rounded before the RoPE dims."""
    H, d, W, k = (FLASH[n] for n in ("num_attention_heads", "head_dim", "sliding_window",
                                     "index_topk"))
    start, ratio = ctx - chunk, KINDS[kind]
    c = {"q": unit_rows(cp, (chunk, H, d)), "keys": unit_rows(cp, (W + chunk, d)), "rows": None,
         "picks": None, "ratio": ratio, "start": start,
         "sinks": cp.random.uniform(-2, 2, H).astype(cp.float32)}
    if ratio:
        c["rows"] = unit_rows(cp, (ctx // ratio, d))
    if kind == "csa":  # k picks per query among its usable rows (repeats do not change the cost)
        usable = (cp.arange(start, ctx) + 1) // ratio
        c["picks"] = (cp.random.random((chunk, k)) * usable[:, None]).astype(cp.int64)
    if fp8:
        from ds4.model.quant import kv_fp8_simulation

        rope = FLASH["qk_rope_head_dim"]
        for name in ("keys", "rows"):
            if c[name] is not None:
                c[name] = kv_fp8_simulation(cp, c[name], rope)
        c["exact"] = d - rope
    return c


def visible_keys(kind: str, chunk: int, ctx: int) -> int:
    """Keys all queries of the chunk attend to, summed (the ring is full: W each)."""
    t = np.arange(ctx - chunk, ctx)
    W, k = FLASH["sliding_window"], FLASH["index_topk"]
    comp = {"sliding": 0 * t, "csa": np.minimum(k, (t + 1) // 4), "hca": (t + 1) // 128}[kind]
    return int(np.minimum(W, t + 1).sum() + comp.sum())


def runners(cp, c: dict):
    """(model code, kernel, kernel with one bf16 rounding) as functions of no arguments
    returning out [S, H, d]."""
    from ds4.kernels.chunk_attention import chunk_attention, words_size
    from ds4.model.attention import attend_keys, window_bias
    from ds4.model.forward import Step

    S = c["q"].shape[0]
    positions = cp.arange(c["start"], c["start"] + S, dtype=cp.int64)
    W = c["keys"].shape[0] - S
    step = Step(c["start"], positions, None, {}, window_bias(cp, c["start"], positions, W))
    words = cp.empty(words_size(c["keys"], c["rows"], 2), cp.uint16)
    out = cp.empty_like(c["q"])
    args = (c["q"], c["keys"], c["rows"], c["picks"], c["ratio"], c["start"])

    def model_code():
        return attend_keys(cp, *args[:5], step, c["sinks"])

    def kernel():
        return chunk_attention(*args, c["sinks"], out, words, 2, c.get("exact", 0))

    def kernel_bf16():
        return chunk_attention(*args, c["sinks"], out, words, 1)
    return model_code, kernel, kernel_bf16


def rel_err(cp, a, b) -> float:
    """|a - b| / |b| (Frobenius)."""
    return float(cp.linalg.norm(a - b) / cp.linalg.norm(b))


def bench(cp, kinds: list[str], chunks: list[int], contexts: list[int], rate: float,
          fp8: bool = False) -> list:
    """One row per (kind, context, chunk): seconds of both paths, floor, kernel error."""
    rows = []
    d, H = FLASH["head_dim"], FLASH["num_attention_heads"]
    for kind in kinds:
        for ctx in contexts:
            for chunk in chunks:
                c = layer_inputs(cp, kind, chunk, ctx, fp8)
                old, new, bf16 = runners(cp, c)
                flops = 4.0 * H * d * visible_keys(kind, chunk, ctx)
                want = old()
                row = {"kind": kind, "ctx": ctx, "chunk": chunk, "floor_s": flops / rate,
                       "rel_err": rel_err(cp, new(), want),
                       "bf16_rel_err": rel_err(cp, bf16(), want)}
                want = None
                row.update(old_s=timed(cp, old, repeat=5, warmup=1),
                           new_s=timed(cp, new, repeat=10, warmup=2),
                           bf16_s=timed(cp, bf16, repeat=10, warmup=2))
                rows.append(row)
                cp.get_default_memory_pool().free_all_blocks()
    return rows


def report(rows: list, rate: float) -> None:
    """The table: ms per layer of both paths, the floor and the kernel's ratio to it."""
    print(f"fp16 GEMM rate {rate / 1e12:.0f} TFLOP/s (floor = useful FLOPs at that rate)")
    print("| layer | ctx | chunk | model code ms | kernel ms | speedup | floor ms | kernel/floor"
          " | rel err | bf16 kernel ms | bf16/floor | bf16 rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['ctx']} | {r['chunk']} | {r['old_s'] * 1e3:.3f} | "
              f"{r['new_s'] * 1e3:.3f} | {r['old_s'] / r['new_s']:.1f}x | "
              f"{r['floor_s'] * 1e3:.3f} | {r['new_s'] / r['floor_s']:.1f}x | "
              f"{r['rel_err']:.1e} | {r['bf16_s'] * 1e3:.3f} | "
              f"{r['bf16_s'] / r['floor_s']:.1f}x | {r['bf16_rel_err']:.1e} |")


def main(argv=None) -> int:
    """Run the benchmark; print the table and optionally write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="sliding,csa,hca")
    ap.add_argument("--chunks", default="512,2048")
    ap.add_argument("--ctx", default="4096,32768")
    ap.add_argument("--fp8", action="store_true",
                    help="FP8-rounded keys; the kernel with lo words for the RoPE dims only")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import cupy as cp

    rate = ceilings(cp)["gemm_flop_per_s"]
    cp.get_default_memory_pool().free_all_blocks()
    rows = bench(cp, args.layers.split(","), [int(c) for c in args.chunks.split(",")],
                 [int(c) for c in args.ctx.split(",")], rate, args.fp8)
    report(rows, rate)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gemm_flop_per_s": rate, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
