"""Micro-benchmark of the packed-weight kernels (ds4/kernels/packed.cu) at V4-Flash shapes.

Each kernel runs inside a CUDA graph over enough copies of its weights to exceed the L2
(so HBM is what is timed); bytes = packed codes + scales read once per launch. Prints GB/s
and the ratio to a device-to-device copy (bytes read + written) measured in the same run, with
the bf16-word GEMV (ds4/kernels/gemv.cu) on the same shapes for comparison.

    PYTHONPATH=. python3 tools/bench_packed.py [--quick]
"""

from __future__ import annotations

import argparse

import numpy as np
from timing import copy_rate, timed

from ds4.kernels import gemv as G
from ds4.kernels import packed as P

ROTATE_BYTES = 256 << 20  # weight copies per graph: well past the L2
HIDDEN = 4096
FP8_SHAPES = {  # name: (rows, cols, rows_per_group)
    "q_a 1024x4096": (1024, 4096, None),
    "kv 512x4096": (512, 4096, None),
    "q_b 32768x1024": (32768, 1024, None),
    "o_a 8192x4096 (8 groups)": (8192, 4096, 1024),
    "o_b 4096x8192": (4096, 8192, None),
    "shared gate 2048x4096": (2048, 4096, None),
    "shared down 4096x2048": (4096, 2048, None),
    "indexer q_b 8192x1024": (8192, 1024, None),
}
FP4_SHAPES = {"expert w1/w3 2048x4096": (2048, 4096, None),
              "expert w2 4096x2048": (4096, 2048, None)}
EXPERTS, TOP_K, INTER = 256, 6, 2048


def per_launch(cp, launches: list) -> float:
    """Median seconds of one launch: all of them captured in one graph, replayed."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for fn in launches:  # eager once: compile and load
            fn()
        stream.begin_capture()
        for fn in launches:
            fn()
        graph = stream.end_capture()
        seconds = timed(cp, lambda: graph.launch(stream), repeat=15, warmup=2)
    return seconds / len(launches)


def copies(nbytes: int) -> int:
    """Weight copies that together exceed the L2 several times."""
    return max(2, -(-ROTATE_BYTES // nbytes))


def rand_u8(cp, shape, lo=0, hi=256):
    return cp.random.randint(lo, hi, size=shape, dtype=cp.int32).astype(cp.uint8)


def fp8_matrix(cp, rows, cols):
    codes = rand_u8(cp, (rows, cols))
    codes[(codes & 0x7F) == 0x7F] = 0x3F  # no NaN codes
    return codes, rand_u8(cp, (-(-rows // 128), -(-cols // 128)), 112, 132)


def fp4_matrix(cp, rows, cols):
    return rand_u8(cp, (rows, cols // 2)), rand_u8(cp, (rows, cols // 32), 112, 132)


def bench_gemv(cp, fmt, rows, cols, group, copy, nb=1, **kw) -> tuple[float, float]:
    """(seconds per launch, GB/s) of gemv_<fmt> with options kw."""
    make = fp8_matrix if fmt == "fp8" else fp4_matrix
    mats = [make(cp, rows, cols) for _ in range(copies(rows * cols))]
    nbytes = mats[0][0].nbytes + mats[0][1].nbytes
    xcols = cols * (rows // group if group else 1)
    x = cp.random.standard_normal((nb, xcols) if nb > 1 else xcols, dtype=cp.float32)
    y = cp.zeros((nb, rows) if nb > 1 else rows, cp.float32)
    if fmt == "fp8":
        launches = [lambda w=w, s=s: P.gemv_fp8(w, s, 128, x, y, rows_per_group=group, **kw)
                    for w, s in mats]
    else:
        launches = [lambda w=w, s=s: P.gemv_fp4(w, s, x, y, rows_per_group=group, **kw)
                    for w, s in mats]
    t = per_launch(cp, launches)
    return t, nbytes / t


def bench_bf16(cp, rows, cols, group) -> float:
    """GB/s of the bf16-word GEMV on the same shape (its launcher's own choices)."""
    mats = [cp.random.randint(0, 1 << 14, (rows, cols), dtype=cp.int32).astype(cp.uint16)
            for _ in range(copies(2 * rows * cols))]
    x = cp.random.standard_normal(cols * (rows // group if group else 1), dtype=cp.float32)
    y = cp.zeros(rows, cp.float32)
    t = per_launch(cp, [lambda w=w: G.gemv(w, x, y, rows_per_group=group) for w in mats])
    return mats[0].nbytes / t


def bench_moe(cp, copy, per_warp=None) -> list[tuple[str, float, float]]:
    """The routed experts of one token: gate/up (fused SwiGLU) and down, 6 of 256 FP4 experts."""
    gate, gate_s = fp4_matrix(cp, EXPERTS * INTER, HIDDEN)
    up, up_s = fp4_matrix(cp, EXPERTS * INTER, HIDDEN)
    down, down_s = fp4_matrix(cp, EXPERTS * HIDDEN, INTER)
    gate, up = gate.reshape(EXPERTS, INTER, -1), up.reshape(EXPERTS, INTER, -1)
    gate_s, up_s = gate_s.reshape(EXPERTS, INTER, -1), up_s.reshape(EXPERTS, INTER, -1)
    down, down_s = down.reshape(EXPERTS, HIDDEN, -1), down_s.reshape(EXPERTS, HIDDEN, -1)
    rng = np.random.default_rng(0)
    picks = [cp.asarray(rng.choice(EXPERTS, TOP_K, replace=False).astype(np.int32))
             for _ in range(8)]
    wts = cp.full(TOP_K, 0.2, cp.float32)
    x = cp.random.standard_normal(HIDDEN, dtype=cp.float32)
    act = cp.zeros((TOP_K, INTER), cp.float32)
    y = cp.zeros(HIDDEN, cp.float32)
    per_expert = gate[0].nbytes + gate_s[0].nbytes
    t_gu = per_launch(cp, [lambda i=i: P.moe_gate_up_fp4(gate, gate_s, up, up_s, i, wts, x, act,
                                                         10.0, rows_per_warp=per_warp)
                           for i in picks])
    t_dn = per_launch(cp, [lambda i=i: P.moe_down_fp4(down, down_s, i, act, y,
                                                      rows_per_warp=per_warp) for i in picks])
    return [("moe gate_up 6 x 2 x (2048x4096)", t_gu, 2 * TOP_K * per_expert / t_gu),
            ("moe down 6 x (4096x2048)", t_dn, TOP_K * per_expert / t_dn)]



def bench_many(cp) -> tuple[str, float, float]:
    """Decode's small FP8 projections of one input (q_a, kv, compressor and indexer parts) in
    one gemv_many_fp8 launch."""
    rows = [1024, 512, 1024, 512, 64]
    nbytes = sum(r * HIDDEN for r in rows)
    x = cp.random.standard_normal(HIDDEN, dtype=cp.float32)
    launches = []
    for _ in range(copies(nbytes)):
        mats = [fp8_matrix(cp, r, HIDDEN) for r in rows]
        codes, scs = [m[0] for m in mats], [m[1] for m in mats]
        outs = [cp.zeros(r, cp.float32) for r in rows]
        table = P.gemv_table_fp8(cp, codes, scs, outs)
        launches.append(lambda t=table, c=codes, s=scs, o=outs: P.gemv_many_fp8(t, c, s, 128,
                                                                               x, o))
    nbytes += sum(s.nbytes for s in scs)
    t = per_launch(cp, launches)
    return f"fp8 many {'+'.join(map(str, rows))}x{HIDDEN}", t, nbytes / t

def bench_dequant(cp, copy) -> list[tuple[str, float, float]]:
    """Prefill slabs: bytes = codes + scales read, bf16 words written."""
    rows, cols = 8192, 4096  # 32 MB of FP8 codes, 64 MB of words: past the L2
    out = cp.empty((rows, cols), cp.uint16)
    w8, s8 = fp8_matrix(cp, rows, cols)
    w4, s4 = fp4_matrix(cp, rows, cols)
    t8 = per_launch(cp, [lambda: P.dequant_fp8_bf16(w8, s8, 128, out)])
    t4 = per_launch(cp, [lambda: P.dequant_fp4_bf16(w4, s4, out)])
    return [("dequant fp8 -> bf16 8192x4096", t8, (w8.nbytes + s8.nbytes + out.nbytes) / t8),
            ("dequant fp4 -> bf16 8192x4096", t4, (w4.nbytes + s4.nbytes + out.nbytes) / t4)]


def row(name: str, variant: str, seconds: float, rate: float, copy: float) -> None:
    print(f"{name:34s} {variant:12s} {seconds * 1e6:9.2f} us {rate / 1e9:8.0f} GB/s "
          f"{rate / copy:6.2f}x copy", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="launcher defaults only, no variants")
    args = ap.parse_args()
    import cupy as cp

    copy = copy_rate(cp)
    print(f"device copy: {copy / 1e9:.0f} GB/s (read + write)\n")
    variants = [{}] if args.quick else [{}, {"rows_per_warp": 1}, {"rows_per_warp": 2},
                                        {"rows_per_warp": 4}, {"rows_per_warp": 4, "splits": 1}]
    for fmt, shapes in (("fp8", FP8_SHAPES), ("fp4", FP4_SHAPES)):
        for name, (rows, cols, group) in shapes.items():
            for kw in variants:
                t, rate = bench_gemv(cp, fmt, rows, cols, group, copy, **kw)
                label = ",".join(f"{k[0]}{v}" for k, v in kw.items()) or "default"
                row(f"{fmt} {name}", label, t, rate, copy)
            rate = bench_bf16(cp, rows, cols, group)
            row(f"bf16 {name}", "gemv.py", 2 * rows * cols / rate, rate, copy)
    for fmt, (rows, cols) in (("fp8", (4096, 4096)), ("fp4", (2048, 4096))):
        for nb in (2, 4, 8):
            t, rate = bench_gemv(cp, fmt, rows, cols, None, copy, nb=nb)
            row(f"{fmt} batched {rows}x{cols}", f"nb={nb}", t, rate, copy)
    for per_warp in ([None] if args.quick else [None, 2, 4]):
        for name, t, rate in bench_moe(cp, copy, per_warp):
            row(name, f"r{per_warp or 'def'}", t, rate, copy)
    name, t, rate = bench_many(cp)
    row(name, "1 launch", t, rate, copy)
    for name, t, rate in bench_dequant(cp, copy):
        row(name, "", t, rate, copy)


if __name__ == "__main__":
    main()
