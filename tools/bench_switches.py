"""A/B of the kernel decoder's switches (the boolean constants of ds4/model/gpu_decode.py, and
ds4/kernels/rows.py's and rows_moe.py's as `rows.NAME`, `rows_moe.NAME`): one
official-format layer at V4-Flash dimensions per kind, its decode graph per layer-token with a
switch off and on, alternating in one process (`--rounds` pairs), at each batch size, and the
ratio on / off. What a switch buys is measured against the path it replaces in the same run.

    cd tools && python3 bench_switches.py --switch SHARED_AHEAD --layers sliding,csa,hca \\
        --batch 1,8
    python3 bench_switches.py --list                 # the switches (no GPU needed)
    python3 bench_switches.py --switch rows.STAGE_X --set rows.STAGE_BATCH=8 --batch 1,4,8
    python3 bench_switches.py --switch SHARED_AHEAD --set rows_moe.ITEM_WARPS=4
"""

from __future__ import annotations

import argparse
import statistics
import sys

from bench_engine import KINDS


def _modules() -> dict:
    """The modules whose booleans are switches, by prefix ("" for gpu_decode)."""
    from ds4.kernels import rows, rows_moe
    from ds4.model import gpu_decode

    return {"": gpu_decode, "rows.": rows, "rows_moe.": rows_moe}


def switches() -> dict[str, bool]:
    """The decoder's switches and their defaults: gpu_decode's module-level booleans, then
    the row kernels' (rows.NAME) and the MoE kernels' (rows_moe.NAME)."""
    return {prefix + name: value for prefix, module in _modules().items()
            for name, value in vars(module).items() if name.isupper() and isinstance(value, bool)}


def _owner(name: str) -> tuple:
    """(module, attribute) of switch `name`."""
    prefix, _, attr = name.rpartition(".")
    return _modules()[prefix + "." if prefix else ""], attr


def layer_seconds(cp, model, ctx: int, batch: int) -> float:
    """Median replay seconds of layer 0 for `batch` members at position ctx - 2, through a
    decoder built now (a switch read at construction takes effect)."""
    from bench_official import filled_state
    from timing import graph_time

    from ds4.model.gpu_decode import KernelDecoder

    dec = KernelDecoder.from_model(model)
    states = [filled_state(cp, model.cfg, ctx) for _ in range(batch)]
    B = dec.prepare(states, [7 + b for b in range(batch)])
    dec.run(B)  # compiles and loads every kernel outside capture
    cp.cuda.Device().synchronize()
    return graph_time(cp, dec.stream, lambda: dec.run_layer(0, B))


def alternate(cp, model, ctx: int, batch: int, rounds: int, turn) -> tuple[float, float]:
    """Median seconds (off, on) of layer 0's decode, measured off, on, off, on, ... with
    turn(False) / turn(True) applied before each (a decoder is built after it)."""
    times: dict = {False: [], True: []}
    for _ in range(rounds):
        for on in (False, True):
            turn(on)
            times[on].append(layer_seconds(cp, model, ctx, batch))
            cp.get_default_memory_pool().free_all_blocks()  # (that decoder's buffers)
    return statistics.median(times[False]), statistics.median(times[True])


def ab(cp, model, name: str, ctx: int, batch: int, rounds: int) -> tuple[float, float]:
    """Median seconds (off, on) of switch `name`, measured off, on, off, on, ..."""
    module, attr = _owner(name)
    kept = getattr(module, attr)
    try:
        return alternate(cp, model, ctx, batch, rounds, lambda on: setattr(module, attr, on))
    finally:
        setattr(module, attr, kept)


def layer_rows(cp, layers: str, batches: str, small: bool, row) -> None:
    """row(model, kind, batch) for each layer kind (comma-separated) and batch size, on the
    kind's one-layer official-format model at V4-Flash dimensions (tiny ones: small)."""
    from bench_official import layer_model

    for kind in layers.split(","):
        model = layer_model(cp, KINDS[kind], small, quantize=False)
        for batch in (int(b) for b in batches.split(",")):
            row(model, kind, batch)
        del model
        cp.get_default_memory_pool().free_all_blocks()


def layer_arguments(ap, pairs: str) -> None:
    """The options of a tool that times layers through layer_rows: which layers, batch sizes,
    decode position, how many `pairs` alternate, and tiny dimensions."""
    ap.add_argument("--layers", default="sliding,csa,hca")
    ap.add_argument("--batch", default="1,8", help="batch sizes (1, 2, 4, 8)")
    ap.add_argument("--ctx", type=int, default=4096, help="decode position")
    ap.add_argument("--rounds", type=int, default=2, help=f"{pairs} pairs, alternating")
    ap.add_argument("--small", action="store_true", help="tiny dims: a smoke test of this tool")


def apply_sets(items: list[str]) -> list[tuple]:
    """Set module-level integers NAME=VALUE (rows.NAME for the row kernels) for the whole run,
    e.g. a switch's threshold; returns (module, attribute, value) of each. Raises ValueError
    for a name that is no integer constant."""
    done = []
    for item in items:
        name, _, value = item.partition("=")
        module, attr = _owner(name)
        if not attr.isupper() or type(getattr(module, attr, None)) is not int:
            raise ValueError(f"--set {item}: {name} is no integer constant")
        setattr(module, attr, int(value))
        done.append((module, attr, int(value)))
    return done


def main(argv=None) -> int:
    """Print one row per layer kind, switch and batch size."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--switch", action="append", default=[], help="a gpu_decode switch (repeat)")
    layer_arguments(ap, "off/on")
    ap.add_argument("--list", action="store_true", help="print the switches and their defaults")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="an integer constant for the whole run, e.g. rows.STAGE_BATCH=8")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    known = switches()
    try:
        apply_sets(args.set)
    except ValueError as e:
        ap.error(str(e))
    if args.list:
        for name, value in known.items():
            print(f"{name} = {value}")
        return 0
    unknown = [s for s in args.switch if s not in known]
    if unknown or not args.switch:
        ap.error(f"--switch takes one of {', '.join(known)} (got {unknown or 'none'})")
    import cupy as cp

    def row(model, kind: str, batch: int) -> None:
        for name in args.switch:
            off, on = ab(cp, model, name, args.ctx, batch, args.rounds)
            print(f"| {kind} | {name} | {batch} | {off * 1e3:.4f} | {on * 1e3:.4f} | "
                  f"{on / off:.3f} |", flush=True)

    print("| layer | switch | batch | off (ms) | on (ms) | on / off |\n|---|---|--:|--:|--:|--:|")
    layer_rows(cp, args.layers, args.batch, args.small, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
