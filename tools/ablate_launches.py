"""What fusing a decode layer's launches could buy at most: the layer's CUDA graph captured with
the launches of some kernels left out, timed against the whole graph in the same process.

A kernel left out costs nothing, so the difference is the most that folding it into another
launch (or making it free) can save on the replay's critical path: the upper bound a fusion
must be worth before it is built. The results are garbage (the decoder runs one whole eager
step first, so index buffers such as the route's picks and the indexer's selection hold valid
values from it and the graph without their kernels reads the same rows as before; only the time
counts). One official-format layer at V4-Flash dimensions per kind, as bench_switches.py.

    cd tools && python3 ablate_launches.py --skip small --layers sliding,csa --batch 1,8
    python3 ablate_launches.py --each --layers csa --batch 8 --rounds 1   # one kernel at a time
    python3 ablate_launches.py --skip 'rows_split|rows_moe_sum' --batch 1

`--skip` takes a regular expression over kernel names (or a name from GROUPS); `--each` makes
one row per kernel name the layer's graph launches.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable

from bench_switches import alternate, layer_arguments, layer_rows, layer_seconds

import ds4.kernels as K

# the weight streams (a layer's bytes) and everything else (launches that read a few MB at most)
STREAMS = "rows_gate_up|rows_down|rows_matvec|rows_many|attention_partial|indexer_scores"
GROUPS = {"small": f"^(?!{STREAMS})", "streams": f"^({STREAMS})"}
REAL_LAUNCH = K.launch


def skip_launches(pattern: str | None, capturing: Callable[[], bool],
                  seen: list[str] | None = None) -> None:
    """Make every ds4 module's `launch` drop the kernels whose names match `pattern` while
    `capturing()` (a graph capture: the eager step before it runs them all) and append the
    names it launches while capturing to `seen`; neither pattern nor seen restores the real
    launch."""

    def launch(family: str, name: str, grid, block, args, shared: int = 0) -> None:
        """K.launch, unless the kernel is one left out of the capture."""
        if capturing():
            if seen is not None:
                seen.append(name)
            if pattern and re.search(pattern, name):
                return
        REAL_LAUNCH(family, name, grid, block, args, shared)

    launch.skips = True
    chosen = REAL_LAUNCH if pattern is None and seen is None else launch
    for name, module in list(sys.modules.items()):
        current = getattr(module, "launch", None)
        if name.startswith("ds4") and (current is REAL_LAUNCH or hasattr(current, "skips")):
            module.launch = chosen


def layer_kernels(cp, model, ctx: int, batch: int, capturing: Callable[[], bool]) -> list[str]:
    """The kernel names layer 0's decode graph launches, in order, each once."""
    seen: list[str] = []
    skip_launches(None, capturing, seen)
    try:
        layer_seconds(cp, model, ctx, batch)
    finally:
        skip_launches(None, capturing)
    return list(dict.fromkeys(seen))


def main(argv=None) -> int:
    """Print one row per layer kind, batch size and set of kernels left out."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip", action="append", default=[],
                    help=f"kernel-name regex or one of {', '.join(GROUPS)} (repeat)")
    ap.add_argument("--each", action="store_true", help="one row per kernel of the layer")
    layer_arguments(ap, "whole/without")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.skip and not args.each:
        ap.error("give --skip REGEX (or a group) or --each")
    patterns = [GROUPS.get(s, s) for s in args.skip]
    for p in patterns:
        try:
            re.compile(p)
        except re.error as e:
            ap.error(f"--skip {p!r}: {e}")
    import cupy as cp

    capturing = lambda: cp.cuda.get_current_stream().is_capturing()  # noqa: E731

    def row(model, kind: str, batch: int) -> None:
        names = layer_kernels(cp, model, args.ctx, batch, capturing) if args.each else []
        for p in patterns + [f"^{re.escape(n)}$" for n in names]:
            try:
                whole, without = alternate(cp, model, args.ctx, batch, args.rounds,
                                           lambda on: skip_launches(p if on else None,
                                                                    capturing))
            finally:
                skip_launches(None, capturing)
            print(f"| {kind} | {batch} | `{p}` | {whole * 1e6:.1f} | {without * 1e6:.1f} | "
                  f"{(whole - without) * 1e6:.1f} | {1 - without / whole:.1%} |", flush=True)

    print("| layer | batch | left out | whole (us) | without (us) | saved (us) | share |\n"
          "|---|--:|---|--:|--:|--:|--:|")
    layer_rows(cp, args.layers, args.batch, args.small, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
