"""A/B of kernel source edits in the layers: one official-format layer at V4-Flash dimensions
per kind, its decode graph per layer-token with every kernel family built from a base copy of
the kernel sources (`--base DIR`, say a git revision's ds4/kernels) and from the repository's
own, alternating in one process (`--rounds` pairs), and the ratio new / base. The switches' A/B
(bench_switches.py) needs a flag in the code; this one needs none, so a header edit is timed
against the text it replaced.

    git archive HEAD~1 ds4/kernels | tar -x -C /tmp/base
    cd tools && python3 bench_sources.py --base /tmp/base/ds4/kernels --layers csa --batch 1,8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench_switches import alternate, layer_arguments, layer_rows

import ds4.kernels as K
from ds4.kernels import rows_moe


def use(cp, source: Path | None, families=None, plain=K._module) -> None:
    """Build the kernel families (`families`, None: all) from the sources in `source`, with the
    repository's options but that directory on the include path; source None: the repository's
    own loader back."""
    built: dict = {}

    def module(family: str):
        if families is not None and family not in families:
            return plain(family)
        if family not in built:
            built[family] = cp.RawModule(code=(source / f"{family}.cu").read_text(),
                                         options=K.family_options(family, source))
        return built[family]

    K._module = plain if source is None else module
    rows_moe.resident_blocks.cache_clear()  # (keyed on kernels of the other build)


def ab(cp, model, base: Path, ctx: int, batch: int, rounds: int) -> tuple[float, float]:
    """Median seconds (base, new) of layer 0's decode, measured base, new, base, new, ..."""
    try:
        return alternate(cp, model, ctx, batch, rounds,
                         lambda new: use(cp, None if new else base))
    finally:
        use(cp, None)


def main(argv=None) -> int:
    """Print one row per layer kind and batch size."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the base copy of ds4/kernels")
    layer_arguments(ap, "base/new")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if not (args.base / "common.cuh").is_file():
        ap.error(f"--base {args.base} holds no kernel sources (common.cuh)")
    import cupy as cp

    def row(model, kind: str, batch: int) -> None:
        base, new = ab(cp, model, args.base.resolve(), args.ctx, batch, args.rounds)
        print(f"| {kind} | {batch} | {base * 1e3:.4f} | {new * 1e3:.4f} | {new / base:.3f} |",
              flush=True)

    print("| layer | batch | base (ms) | new (ms) | new / base |\n|---|--:|--:|--:|--:|")
    layer_rows(cp, args.layers, args.batch, args.small, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
