"""What bounds the row kernels: each part of their work taken out in turn, and the time it saves.

Builds copies of ds4/kernels/rows.cu and rows_moe.cu with one part removed (the results are
garbage; only the time counts) and times them against the unchanged kernels in the same run,
with bench_rows.py's timing: the MoE (6 FP4 experts + the FP8 shared one) and the dense FP8
q_b and o_b at B = 1 and 8. Ablations (ABLATIONS):

- nox: x (or its split words) not loaded: a value computed from the column instead;
- nodec: codes fed to the mma as they are, no decode (spills a few registers: an upper bound);
- nox_nodec: both;
- noalloc: the weight stream loaded without L1 allocation (ld.global.nc.L1::no_allocate);
- frag: each 16-row tile's k-tile read as one 1 KB block in the lanes' order (rows g, then
  g + 8; 512 contiguous bytes a warp load) instead of 64 bytes from each of 16 rows: the
  addressing of weights repacked at load into the mma's fragment order (codes only; the scale
  bytes are read as before);
- frag_nox_nodec: frag with neither x nor the decode (the loads alone);
- noscale: the FP4 experts' scale bytes not loaded (a multiplier made from the column instead):
  each code load of theirs comes with a byte load of its row's scale, 8 rows' sectors a warp
  instruction, where the dense FP8 rows read one scale a tile (bench_stream.py asks the same
  of loads alone); nox_nodec_noscale: none of x, decode or scales (the code loads alone);
- l1_squeezed: the kernels unchanged, but every MoE launch asks for 100 KB of dynamic shared
  memory it does not use and the largest carveout, so two blocks an SM leave ~28 KB of L1:
  what the shared-memory ring of stop 48 did besides its staging (its x words' L1 hits).

    cd tools && python3 ablate_rows.py [--only nox,nodec] [--rounds 2]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import bench_rows as BR
from bench_sources import use
from timing import copy_rate

import ds4.kernels as K
from ds4.backend import KERNEL_DIR
from ds4.kernels import rows_moe as RM

X_WORDS = "if (src.w) q = XS == X_SHARED ? p[i] : __ldg(p + i);"
X_FLOATS = "float4 f = ok ? __ldg(v + i) : make_float4(0.f, 0.f, 0.f, 0.f);"
FP8_BITS = """        const u32 S = 0x80008000u, M = 0x07f007f0u, w = word(q[0], m);
        lo = bf16x2_mul(((w << 8) & S) | ((w << 4) & M), mul);
        hi = bf16x2_mul((w & S) | ((w >> 4) & M), mul);"""
FP4_BITS = """        e2m1_pairs(word(q[0], m >> 1), m & 1, lo, hi);  // (common.cuh)
        lo = bf16x2_mul(lo, mul), hi = bf16x2_mul(hi, mul);"""
FP8H_CVT = "        e4m3x4(word(q[0], m), lo, hi);"
LD_NA = """__device__ __forceinline__ uint4 ld_na(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
"""
NOX = [("rows.cuh", X_WORDS, "if (src.w) q = make_uint4(kt * 7 + i, kt + n, kt ^ i, kt + 3 * i);"),
       ("rows.cuh", X_FLOATS,
        "float4 f = ok ? make_float4(col * 1e-3f, i, col, 1.f) : make_float4(0.f, 0.f, 0.f, 0.f);")]
NODEC = [("rows_formats.cuh", FP8_BITS, "        u32 w = word(q[0], m); lo = w + mul; hi = w;"),
         ("rows_formats.cuh", FP4_BITS,
          "        u32 w = word(q[0], m >> 1); lo = w + mul + m; hi = w;"),
         ("rows_formats.cuh", FP8H_CVT, "        lo = word(q[0], m); hi = lo;")]
NOALLOC = [("rows.cuh", "st.q[d][mt][h][l] = ok ? __ldcs(p + l) : make_uint4(0, 0, 0, 0);",
            "st.q[d][mt][h][l] = ok ? ld_na(p + l) : make_uint4(0, 0, 0, 0);"),
           ("rows.cuh", '#include "rows_formats.cuh"\n', '#include "rows_formats.cuh"\n' + LD_NA)]
FRAG = [("rows.cuh", "tl.w[mt][h] = W + (size_t)r * F::bytes(cols);",
         "tl.w[mt][h] = W + (size_t)(r >> 4) * 16 * F::bytes(cols) + (r & 15) * 64;"),
        ("rows.cuh", "(tl.w[mt][h] + F::bytes(col));",
         "(tl.w[mt][h] + F::bytes(col) + (size_t)(kt + d) * 960);")]
NOSCALE = [("rows_formats.cuh", "return multiplier(__ldg(srow + (col >> 5)), 126 - 32);",
            "return multiplier(120u + ((col >> 5) & 3), 126 - 32);")]
ABLATIONS = {"base": [], "nox": NOX, "nodec": NODEC, "nox_nodec": NOX + NODEC,
             "noalloc": NOALLOC, "frag": FRAG, "frag_nox_nodec": FRAG + NOX + NODEC,
             "noscale": NOSCALE, "nox_nodec_noscale": NOX + NODEC + NOSCALE,
             "l1_squeezed": []}  # (its own copy of the sources: the carveout stays on its module)
SQUEEZE_BYTES = 100 * 1024  # l1_squeezed: unused dynamic shared memory a block
FAMILIES = ("rows", "rows_moe")
MATRICES = ("q_b 32768x1024", "o_b 4096x8192")


def patched(name: str, root: Path) -> Path:
    """A copy of the kernel sources with ablation `name` applied, under root / name."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    for p in KERNEL_DIR.glob("*.cu*"):
        shutil.copy(p, d / p.name)
    for file, old, new in ABLATIONS[name]:
        text = (d / file).read_text()
        assert text.count(old) == 1, f"{name}: {file} no longer holds the text it patches"
        (d / file).write_text(text.replace(old, new))
    return d


def squeeze_l1(on: bool, plain=K.launch) -> None:
    """l1_squeezed on or off: the MoE's gate/up and down launches with SQUEEZE_BYTES of
    dynamic shared memory and the largest carveout (the same kernels, grids and sums; the
    grouping and the sum as they are), or every launch as it is."""

    def squeezed(family, name, grid, block, args, shared=0):
        if name.startswith(("rows_gate_up_", "rows_down_")):
            K.kernel(family, name).preferred_shared_memory_carveout = 100
            shared = max(shared, SQUEEZE_BYTES)
        plain(family, name, grid, block, args, shared=shared)

    RM.launch = squeezed if on else plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(ABLATIONS), help="ablations to time")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the ablations")
    args = ap.parse_args()
    import cupy as cp

    copy = copy_rate(cp)
    print(f"device copy: {copy / 1e9:.0f} GB/s (read + write)\n")
    bank = BR.expert_bank(cp)
    mats = {n: BR.weights(cp, *BR.SHAPES[n][:3]) for n in MATRICES}
    with tempfile.TemporaryDirectory() as tmp:
        sources = {n: patched(n, Path(tmp)) for n in args.only.split(",")}
        for _ in range(args.rounds):
            for name, source in sources.items():
                use(cp, source, FAMILIES)
                squeeze_l1(name == "l1_squeezed")
                for b in (1, 8):
                    t, rate, _ = BR.bench_moe(cp, bank, b, True)
                    BR.line(f"{name} moe+shared", b, t, rate, copy)
                for n, ms in mats.items():
                    for b in (1, 8):
                        t, rate = BR.bench_matvec(cp, ms, None, b)
                        BR.line(f"{name} {n}", b, t, rate, copy)
    use(cp, None)
    squeeze_l1(False)


if __name__ == "__main__":
    main()
