"""What read pattern one wave of warps can stream at: kernels that only load (no decode, no x,
no mma) over a stack of rows the size of a layer's routed experts, each warp with the row
kernels' lane map (lane = 4 g + t: rows g and g + 8 of each 16-row tile, 16 bytes at chunk t of
a 64-byte k-tile; rows.cuh's load_stage), MT tiles a warp, DEPTH k-tiles in flight, and the
FP4 scale bytes read beside the codes as the kernels read them (a byte a lane and load), as a
16-byte word a lane every four k-tiles, or not at all; beside them the same bytes read as one
contiguous run a warp. The figures are GB/s of code bytes read and their ratio to the device
copy rate (read + written, timing.copy_rate), the convention of bench_rows.py.

Why: the routed experts stream ~0.5x the copy rate and, with their decode and x taken out,
0.62x (docs/PERF.md's stops 30 and 42), where the dense FP8 rows, with the same 32 rows x 64
bytes a k-tile, reach 0.85x; their one-scale-a-tile FP8 reads no per-row scale bytes, the FP4
experts a byte a lane for every 16 bytes of codes. This sweep says whether the rate follows the
scale loads, the tiles or the k-tiles in flight, before the experts' layout or loop changes.

    python3 tools/bench_stream.py [--mb 58] [--row-bytes 2048] [--warps 1792]
"""

from __future__ import annotations

import argparse
import sys

SOURCE = r"""
// Warp w reads the MT 16-row tiles of row group w / ks over k-span w % ks of ks, a k-tile (64
// bytes a row) a step, DEPTH steps a stage; SCALES 1: each code load with its row's scale
// byte (scales: a byte for each 16 code bytes), 4: a 16-byte scale word a row every 4 steps;
// CONTIG: the warp's bytes as one contiguous run instead (512 bytes a warp load). Stages are
// double-buffered as rows.cuh's warp_rows does (the next stage's loads issue before the current
// one is used), so a stage's loads are in flight together whatever order the compiler gives
// the uses. The XOR of everything read goes to sink[w] so no load is dropped.
struct Stage {
    uint4 v[DEPTH][MT][2];
    unsigned sc[DEPTH][MT][2];
};

__device__ __forceinline__ void load(Stage& st, const unsigned char* codes,
                                     const unsigned char* scales, long long row_bytes,
                                     long long grp, long long s0, long long span, long long sld,
                                     int w, int t0, int steps) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int d = 0; d < DEPTH; d++) {
        long long off = s0 + (long long)(t0 + d) * 64 + 16 * t;
        bool ok = t0 + d < steps;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                long long row = grp * 16 * MT + 16 * mt + g + 8 * h;
                const unsigned char* p = CONTIG
                    ? codes + w * 16 * MT * span + (long long)(t0 + d) * 1024 * MT
                          + (2 * mt + h) * 512 + 16 * lane
                    : codes + row * row_bytes + off;
                st.v[d][mt][h] = ok ? __ldcs((const uint4*)p) : make_uint4(0, 0, 0, 0);
                st.sc[d][mt][h] = 0;
                if (SCALES == 1 && ok) st.sc[d][mt][h] = __ldg(scales + row * sld + off / 16);
                if (SCALES == 4 && ok && (t0 + d) % 4 == 0) {
                    uint4 s4 = __ldg((const uint4*)(scales + row * sld + (off - 16 * t) / 16));
                    st.sc[d][mt][h] = s4.x ^ s4.y ^ s4.z ^ s4.w;
                }
            }
    }
}

extern "C" __global__ void stream(const unsigned char* __restrict__ codes,
                                  const unsigned char* __restrict__ scales, long long row_bytes,
                                  int ks, int warps, unsigned* sink) {
    int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (w >= warps) return;
    long long grp = w / ks, span = row_bytes / ks, s0 = (w % ks) * span, sld = row_bytes / 16;
    int steps = (int)(span / 64);
    unsigned acc = 0;
    Stage cur, nxt;
    load(cur, codes, scales, row_bytes, grp, s0, span, sld, w, 0, steps);
    for (int t0 = 0; t0 < steps; t0 += DEPTH) {
        if (t0 + DEPTH < steps)
            load(nxt, codes, scales, row_bytes, grp, s0, span, sld, w, t0 + DEPTH, steps);
#pragma unroll
        for (int d = 0; d < DEPTH; d++)
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int h = 0; h < 2; h++)
                    acc ^= cur.v[d][mt][h].x ^ cur.v[d][mt][h].y ^ cur.v[d][mt][h].z
                           ^ cur.v[d][mt][h].w ^ cur.sc[d][mt][h];
        cur = nxt;
    }
    if (lane == 0) sink[w] = acc;
}
"""

# (16-row tiles a warp, k-tiles in flight, scale reads, contiguous): the kernels' own pattern
# (2 tiles, 2 k-tiles, a scale byte a load) first, then each knob moved alone
PATTERNS = [(2, 2, 1, False), (2, 2, 0, False), (2, 2, 4, False), (2, 2, 0, True),
            (2, 4, 1, False), (2, 1, 1, False), (1, 2, 1, False), (4, 2, 1, False),
            (2, 4, 0, False), (2, 4, 4, False)]
STEP = 64  # bytes a row a k-tile (128 FP4 or 64 FP8 columns)


def plan(total_bytes: int, row_bytes: int, warps: int, tiles: int) -> tuple[int, int]:
    """(k-spans a row, warps launched) for a stack of total_bytes of row_bytes rows read by
    about `warps` warps of 16 * tiles rows each: the k-split that comes nearest to that many
    warps while each span holds whole groups of four k-tiles (a scale word's)."""
    groups = max(1, total_bytes // row_bytes // (16 * tiles))
    ks = 1
    while groups * ks * 2 <= warps and (row_bytes // (ks * 2)) % (4 * STEP) == 0:
        ks *= 2
    return ks, groups * ks


def kernel(cp, tiles: int, depth: int, scales: int, contig: bool):
    """The stream kernel for one pattern (compiled once per pattern)."""
    defines = (f"-DMT={tiles}", f"-DDEPTH={depth}", f"-DSCALES={scales}",
               f"-DCONTIG={int(contig)}")
    return cp.RawModule(code=SOURCE, options=("--std=c++17", *defines)).get_function("stream")


def main(argv=None) -> int:
    """Print one row per pattern: its launch, GB/s of codes read and the ratio to the copy
    rate."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=58, help="code bytes (MB; 58: a B=1 gate/up)")
    ap.add_argument("--row-bytes", type=int, default=2048, help="a row's bytes (FP4 x 4096)")
    ap.add_argument("--warps", type=int, default=1792, help="warps to aim at (224 items x 8)")
    ap.add_argument("--block", type=int, default=256, help="threads a block")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.row_bytes % (4 * STEP):
        ap.error(f"--row-bytes must be a multiple of {4 * STEP} (four k-tiles)")
    import cupy as cp
    from timing import copy_rate, timed

    copy = copy_rate(cp)
    total = args.mb * 1_000_000 // args.row_bytes * args.row_bytes
    codes = cp.random.randint(0, 2 ** 31, total // 4, dtype=cp.int32)
    scales = cp.random.randint(0, 2 ** 31, total // 64, dtype=cp.int32)
    print(f"device copy {copy / 1e9:.0f} GB/s; {total / 1e6:.1f} MB of codes in rows of "
          f"{args.row_bytes} bytes\n")
    print("| tiles a warp | k-tiles in flight | scales | contiguous | k-spans | warps | us | GB/s "
          "| x copy |\n|--:|--:|---|---|--:|--:|--:|--:|--:|")
    names = {0: "none", 1: "a byte a load", 4: "a word / 4 k-tiles"}
    for tiles, depth, sc, contig in PATTERNS:
        ks, warps = plan(total, args.row_bytes, args.warps, tiles)
        sink = cp.zeros(warps, dtype=cp.uint32)
        fn = kernel(cp, tiles, depth, sc, contig)
        grid = (-(-warps * 32 // args.block),)
        read = warps // ks * 16 * tiles * args.row_bytes
        t = timed(cp, lambda: fn(grid, (args.block,), (codes, scales, cp.int64(args.row_bytes),
                                                       cp.int32(ks), cp.int32(warps), sink)))
        print(f"| {tiles} | {depth} | {names[sc]} | {'yes' if contig else 'no'} | {ks} | "
              f"{warps} | {t * 1e6:.1f} | {read / t / 1e9:.0f} | {read / t / copy:.2f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
