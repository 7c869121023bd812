"""The decode step's small launches on the H200, each against what it replaced, same run:
one mHC unit boundary (`hc_unit` against hc_post + hc_mix + hc_pre_norm, in a CUDA graph of
200 launches, each unit's fn read in turn from 64 copies: 96 MB, past the L2) and one device
draw under the default sampling options, with top_p 0.95 beside them and with top_k 40 too
(the `sample_min_p` kernel, after `topk_select` for top_k, against the masked CuPy path, a
129280-token row, the id's host sync included); then `topk_select` alone at the shapes it
serves (a top_k draw's vocabulary row; the indexer's 512 of a long context's compressed
entries, one decode member or a prefill chunk's queries), against the kernel of an earlier
sampling.cu when --topk-before names one (built in the same run).

    PYTHONPATH=. python3 tools/bench_decode_small.py [--topk-before OLD_sampling.cu]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from bench_packed import per_launch

import ds4.kernels as K
import ds4.sampling as S
from ds4.backend import KERNEL_DIR
from ds4.kernels import hyper_connection as hc
from ds4.kernels import sampling as sampling_kernels
from ds4.sampling import SamplingOptions, make_rng, sample

D, STREAMS, MIX, COPIES = 4096, 4, 24, 64


def graph_us(cp, f, n: int = 200) -> float:
    """Microseconds per call of f, n calls captured in one CUDA graph and replayed."""
    return per_launch(cp, [f] * n) * 1e6


def unit_case(cp, B: int) -> dict:
    """Device operands of one mHC unit boundary for B members."""
    f32, rnd = cp.float32, cp.random.standard_normal
    pc = cp.zeros((B, STREAMS + STREAMS * STREAMS), f32)
    pc[:, :STREAMS], pc[:, STREAMS:] = 1, 1 / STREAMS
    return {"X": rnd((B, STREAMS, D), dtype=f32), "y": rnd((B, D), dtype=f32) * 0.1, "pc": pc,
            "fns": [rnd((MIX, STREAMS * D), dtype=f32) * 0.01 for _ in range(COPIES)],
            "mix": cp.zeros((B, MIX), f32), "scale": cp.ones(3, f32), "base": cp.zeros(MIX, f32),
            "prev_mix": rnd((B, MIX), dtype=f32) * 0.1,  # the previous unit's (not this one's:
            # hc_unit reads it before it waits for the launch ahead, here another hc_unit)
            "w": cp.ones(D, f32), "h": cp.zeros((B, D), f32),
            "scratch": hc.unit_scratch(cp, B, D)}


def unit_table(cp) -> None:
    """hc_unit against the three launches it replaces, with and without the Sinkhorn."""
    for B in (1, 8):
        c, turn = unit_case(cp, B), [0]

        def fn():
            turn[0] = (turn[0] + 1) % COPIES
            return c["fns"][turn[0]]

        for iters in (20, 0):
            fused = graph_us(cp, lambda: hc.hc_unit(
                c["X"], c["y"], (c["prev_mix"], c["scale"], c["base"]), fn(), c["scale"], c["base"],
                c["w"], c["mix"], c["h"], c["scratch"], iters))

            def three():
                hc.hc_post(c["X"], c["y"], c["pc"], c["X"])
                hc.hc_mix(fn(), c["X"], c["mix"])
                hc.hc_pre_norm(c["mix"], c["scale"], c["base"], c["X"], c["w"], c["h"], c["pc"],
                               iters)

            apart = graph_us(cp, three)
            print(f"mHC unit B={B} sinkhorn iters {iters:2d}: hc_unit {fused:6.2f} us, "
                  f"post + mix + pre_norm {apart:6.2f} us ({apart / fused:4.2f}x)", flush=True)


def draw_us(x, opts: SamplingOptions, n: int = 200) -> float:
    """Microseconds per device draw under opts, the host sync included."""
    import cupy as cp

    rng = make_rng(0)
    for _ in range(5):
        sample(x, opts, rng)
    cp.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(n):
        sample(x, opts, rng)
    return (time.perf_counter() - start) / n * 1e6


def sampling_line(cp) -> None:
    """The listing kernels against the masked path (turned off for the second run)."""
    x = cp.asarray((np.random.default_rng(0).normal(size=129280) * 3).astype(np.float32))
    for name, opts in (("default options", SamplingOptions()),
                       ("top_p 0.95 + min_p 0.05", SamplingOptions(top_p=0.95)),
                       ("top_k 40 + top_p 0.95", SamplingOptions(top_k=40, top_p=0.95))):
        kernel = draw_us(x, opts)
        keep, S._listed_draw = S._listed_draw, lambda *a: -1
        try:
            masked = draw_us(x, opts)
        finally:
            S._listed_draw = keep
        print(f"device draw, {name}: sample_min_p {kernel:.1f} us, masked path "
              f"{masked:.1f} us ({masked / kernel:.1f}x)")


TOPK_SHAPES = (("vocabulary row, k 40", 1, 129280, 40), ("vocabulary row, k 1024", 1, 129280, 1024),
               ("indexer, 1 member, 16384 entries", 1, 16384, 512),
               ("indexer, 2048 queries, 4096 entries", 2048, 4096, 512))


def topk_us(cp, rows: int, n: int, k: int) -> float:
    """Microseconds per topk_select of k from each of `rows` rows of n normal scores (a
    graph of 20 launches)."""
    x = cp.asarray(np.random.default_rng(1).normal(size=(rows, n)).astype(np.float32))
    sel, count = cp.zeros((rows, k), cp.int32), cp.zeros(rows, cp.int32)
    return per_launch(cp, [lambda: sampling_kernels.topk_select(x[0] if rows == 1 else x, k,
                                                                sel[0] if rows == 1 else sel,
                                                                count)] * 20) * 1e6


def topk_line(cp, before: Path | None) -> None:
    """topk_select at each TOPK_SHAPES shape; with `before`, that source's kernel too."""
    plain, earlier = K._module, None
    if before is not None:  # built once, served in place of the family while it is timed
        module = cp.RawModule(code=before.read_text(), options=("--std=c++17", f"-I{KERNEL_DIR}"))

        def earlier(family: str):
            return module if family == "sampling" else plain(family)
    for name, rows, n, k in TOPK_SHAPES:
        now = topk_us(cp, rows, n, k)
        line = f"topk_select, {name}: {now:.1f} us"
        if earlier is not None:
            K._module = earlier
            try:
                old = topk_us(cp, rows, n, k)
            finally:
                K._module = plain
            line += f", before {old:.1f} us ({old / now:.1f}x)"
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topk-before", type=Path, help="an earlier sampling.cu to time against")
    args = ap.parse_args()
    import cupy as cp

    unit_table(cp)
    sampling_line(cp)
    topk_line(cp, args.topk_before)


if __name__ == "__main__":
    main()
