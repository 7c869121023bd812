"""Is a decode GEMV faster when its weights were asked into the L2 while DRAM sat idle?

A B=1 decode layer spends about a third of its time in small latency-bound launches (mHC,
norms, attention, the router) during which DRAM is idle. This bench asks whether
`prefetch.l2_prefetch` of the next matrix on a side branch, forked before such a stretch,
makes the matrix's `rows.matvec` that follows it faster. At V4-Flash shapes, rotating over
weight copies that leave the L2, each a graph of (per copy):

    spin        a one-warp kernel that holds the chain for --spin-us with DRAM idle
    spin, mv    spin, then rows.matvec of the copy
    + prefetch  the same with l2_prefetch of the copy on a side stream forked before spin

and prints the matvec's own time (the graph's time less spin's) cold and after each prefetch
variant, against the copy rate measured in the same run.

    cd tools && python3 bench_l2_prefetch.py [--spin-us 10,20] [--batch 1]
"""

from __future__ import annotations

import argparse

from bench_packed import copy_rate, timed
from bench_rows import SHAPES, weights

from ds4.kernels import prefetch
from ds4.kernels import rows as R

MATRICES = ("q_b 32768x1024", "o_a 8192x4096 (8 groups)", "o_b 4096x8192",
            "shared gate 2048x4096", "shared down 4096x2048")
VARIANTS = {  # label: l2_prefetch options
    "bulk 16 KB, 16 blocks": {"bulk": 16384, "blocks": 16},
    "bulk 16 KB, 32 blocks": {"bulk": 16384, "blocks": 32},
    "bulk 64 KB, 132 blocks": {"bulk": 65536, "blocks": 132},
    "lines, evict_last, 32 blocks": {"bulk": 0, "blocks": 32},
    "lines, evict_last, 132 blocks": {"bulk": 0, "blocks": 132},
    "lines, normal, 132 blocks": {"bulk": 0, "blocks": 132, "last": False},
}
SPIN = r"""extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}"""


def graph_seconds(cp, steps: list) -> float:
    """Median seconds of one step: every step captured in one graph on a stream (a step may
    fork to bench's side stream and join back), replayed."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for fn in steps:  # eager once: compile and load
            fn()
        stream.begin_capture()
        for fn in steps:
            fn()
        graph = stream.end_capture()
        seconds = timed(cp, lambda: graph.launch(stream))
    return seconds / len(steps)


def step(cp, side, spin, cycles, w, x, y, group, batch, options=None):
    """One item: [fork: l2_prefetch(w) on side] spin, matvec(w) [join]."""
    def run():
        main = cp.cuda.get_current_stream()
        if options is not None:
            side.wait_event(main.record())
            with side:
                prefetch.l2_prefetch([w], **options)
        if cycles:
            spin((1,), (32,), (cp.int64(cycles),))
        if w is not None:
            R.matvec(w, x, y, batch, rows_per_group=group)
        if options is not None:
            main.wait_event(side.record())
    return run


def matrix_lines(cp, name, spin, cycles, spin_s, batch, copy) -> None:
    """The cold and prefetched matvec times of one shape."""
    fmt, rows, cols, group = SHAPES[name]
    mats = weights(cp, fmt, rows, cols)
    width = cols * (rows // group if group else 1)
    x = cp.random.standard_normal((batch, width), dtype=cp.float32)
    y = cp.zeros((batch, rows), cp.float32)
    side = cp.cuda.Stream(non_blocking=True)
    nbytes = mats[0].nbytes

    def mv_us(options):
        total = graph_seconds(cp, [step(cp, side, spin, cycles, w, x, y, group, batch, options)
                                   for w in mats])
        return (total - spin_s) * 1e6

    cold_alone = graph_seconds(cp, [step(cp, side, spin, 0, w, x, y, group, batch)
                                    for w in mats]) * 1e6
    cold = mv_us(None)
    print(f"{name}, B={batch}: {nbytes / 1e6:.1f} MB, copy-rate time "
          f"{nbytes / copy * 1e6:.2f} us; matvec alone {cold_alone:.2f} us, after spin {cold:.2f}")
    for label, options in VARIANTS.items():
        us = mv_us(options)
        print(f"    {label:32s} matvec {us:6.2f} us  ({cold / us:.2f}x cold)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spin-us", default="10,20")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated prefixes of MATRICES")
    args = ap.parse_args()
    import cupy as cp

    spin = cp.RawKernel(SPIN, "spin")
    copy = copy_rate(cp)  # bytes moved per second (bench_rows' "copy")
    clock = cp.cuda.Device().attributes["ClockRate"] * 1e3
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}: copy {copy / 1e12:.2f} "
          f"TB/s, L2 {cp.cuda.Device().attributes['L2CacheSize'] >> 20} MB")
    for us in [float(s) for s in args.spin_us.split(",")]:
        cycles = int(us * 1e-6 * clock)
        spin_s = graph_seconds(cp, [step(cp, None, spin, cycles, None, None, None, None, 1)
                                    for _ in range(8)])
        print(f"\nspin {spin_s * 1e6:.2f} us (asked {us})")
        for name in MATRICES:
            if not args.only or any(name.startswith(p) for p in args.only.split(",")):
                matrix_lines(cp, name, spin, cycles, spin_s, args.batch, copy)


if __name__ == "__main__":
    main()
