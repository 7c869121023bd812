"""The critical path of one packed decode layer's CUDA graph, kernel by kernel, as replayed:
under programmatic dependent launch a kernel is let go when the kernel ahead of it ends, so the
time from one kernel's release to the next one's is that kernel's share of the replay, its
overlap with its neighbours included (ds4/kernels/timeline.py stamps them on the device).
Nsight Compute's serialized times (profile_decode.py) add launch and cold caches to every
kernel instead. Also: how long each kernel's block 0 waited for the one ahead (its head start),
and its blocks, and blocks an SM (a launch of 1.45 an SM leaves some SMs twice the work).
Launches that stamp nothing (CuPy's own kernels, copies) fall into the share of the kernel
before them.

Each layer kind is a one-layer official-format model at V4-Flash dimensions (random packed
weights, as `bench_engine.py --format official`), `batch` members at position ctx - 2; the
layer's graph is captured once and replayed `--replays` times, the shares averaged. The
shared expert's side stream is off by default (`--side-stream` keeps it): the stamps of two
streams interleave, and then a share mixes them.

    DS4_TIMELINE=1 python3 tools/timeline_decode.py [--layers sliding,csa] [--batch 1,8]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

TOOLS = Path(__file__).resolve().parent


def match(launches: list[tuple], stamps: list[tuple]) -> list[str]:
    """The kernel name of each stamp (reached, released, grid, block): the earliest launch not
    yet matched with the same grid and block ("?" for none)."""
    taken, names = [False] * len(launches), []
    for _, _, grid, block in stamps:
        at = next((i for i, (_, g, b) in enumerate(launches)
                   if not taken[i] and (g, b) == (grid, block)), None)
        if at is not None:
            taken[at] = True
        names.append("?" if at is None else launches[at][0])
    return names


def critical_path(launches: list[tuple], stamps: list[tuple], replays: int) -> list[tuple]:
    """(kernel, mean share ns, mean head start ns, blocks) per launch of one replay, from
    `replays` replays' stamps in order. A share is the time from this kernel's release to the
    next one's (the last kernel's is unknown: None); the head start is release - reached."""
    n = len(stamps) // replays
    assert n and n * replays == len(stamps), "every replay stamps the same kernels"
    shares, heads = defaultdict(float), defaultdict(float)
    for r in range(replays):
        one = stamps[r * n:(r + 1) * n]
        for i, (reached, released, _, _) in enumerate(one):
            heads[i] += (released - reached) / replays
            if i + 1 < n:
                shares[i] += (one[i + 1][1] - released) / replays
    names = match(launches, stamps[:n])
    return [(names[i], shares[i] if i + 1 < n else None, heads[i], stamps[i][2])
            for i in range(n)]


def by_kernel(rows: list[tuple]) -> list[tuple[str, float, int]]:
    """(kernel, summed share ns, launches) over a replay, the largest first."""
    total, count = defaultdict(float), defaultdict(int)
    for name, share, *_ in rows:
        total[name] += share or 0.0
        count[name] += 1
    return sorted(((k, total[k], count[k]) for k in total), key=lambda t: -t[1])


def run(kind: str, ctx: int, batch: int, replays: int) -> None:
    """Capture layer 0 of a `kind` layer for `batch` members, replay it, print its path."""
    import cupy as cp
    from bench_engine import KINDS
    from bench_official import filled_state, layer_model
    from timing import capture, replay_time

    from ds4 import kernels
    from ds4.kernels import timeline
    from ds4.model.gpu_decode import KernelDecoder

    model = layer_model(cp, KINDS[kind], False, False)
    states = [filled_state(cp, model.cfg, ctx) for _ in range(batch)]
    dec = KernelDecoder.from_model(model)
    B = dec.prepare(states, list(range(7, 7 + batch)))
    dec.run(B)  # every kernel compiled and loaded outside the capture
    stream = dec.stream
    timeline.launches.clear()
    graph = capture(cp, stream, lambda: dec.run_layer(0, B))
    graph_us = replay_time(cp, stream, graph, repeat=100) * 1e6
    timeline.reset()
    for _ in range(replays):
        graph.launch(stream)
    stream.synchronize()
    rows = critical_path(timeline.launches, timeline.stamps(), replays)
    known = sum(row[1] for row in rows if row[1] is not None) / 1e3
    print(f"\n{kind} layer, position {ctx - 2}, batch {batch}: graph replay {graph_us:.1f} us; "
          f"{len(rows)} kernels, first release to last {known:.1f} us")
    sms = kernels.device_limits()[0]
    print(f"  share us  head start us  blocks (a SM of {sms})  kernel")
    for name, share, head, blocks in rows:
        print(f"  {'-' if share is None else f'{share / 1e3:8.2f}':>8}  {head / 1e3:13.2f}  "
              f"{blocks:6d} ({blocks / sms:5.2f})  {name}")
    print("  by kernel (share us, launches):")
    for name, ns, count in by_kernel(rows):
        print(f"  {ns / 1e3:8.2f}  {count:3d}  {name}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="sliding,csa,hca")
    ap.add_argument("--batch", default="1", help="batch sizes, e.g. 1,8")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--side-stream", action="store_true",
                    help="keep the shared expert on its side stream (shares then mix streams)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if os.environ.get("DS4_TIMELINE", "") in ("", "0"):
        ap.error("set DS4_TIMELINE=1: the kernels are built with their stamps only then")
    sys.path.insert(0, str(TOOLS))
    from ds4.model import gpu_decode

    gpu_decode.SHARED_AHEAD = args.side_stream
    for kind in args.layers.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            run(kind, args.ctx, batch, args.replays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
