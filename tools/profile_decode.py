"""Where one packed decode layer's time goes: the device time of every kernel of its CUDA graph,
one line a launch, measured by Nsight Compute (`ncu --graph-profiling node`, kernels serialized,
caches flushed between them, so the lines add up to more than a replay), beside the replayed
graph's own time from the same layer.

Each layer kind is a one-layer official-format model at V4-Flash dimensions (random packed
weights, as `bench_engine.py --format official`), one session at position ctx - 2 with random
rows in every cache, the kernel decoder's `run_layer` captured once; the child process replays
it for the graph time (bench_engine's median replay), then once between cudaProfilerStart/Stop
for ncu.

    python3 tools/profile_decode.py [--layers csa,sliding,hca,head] [--ctx 4096] [--batch 1]
        [--detail KERNEL_REGEX]

`head` is the step's end instead of a layer (the last hc_post, the final norm and the bf16
vocabulary product, `run_head`): one step reads its ~1 GB once for the whole batch, more than
four packed layers do.

--detail prints ncu's own report (speed of light, occupancy, warp stall reasons, memory
workload) for the graph's kernels whose names match the regex, instead of the table.
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent


def child(kind: str, ctx: int, batch: int) -> None:
    """Capture layer 0's decode for `batch` members, time its replays, profile one."""
    import cupy as cp
    from bench_engine import KINDS
    from bench_official import filled_state, layer_model
    from timing import capture, replay_time

    from ds4.model.gpu_decode import KernelDecoder

    model = layer_model(cp, KINDS["sliding" if kind == "head" else kind], False, False)
    states = [filled_state(cp, model.cfg, ctx) for _ in range(batch)]
    dec = KernelDecoder.from_model(model)
    B = dec.prepare(states, list(range(7, 7 + batch)))  # own tokens: the batch's own routing
    dec.run(B)  # every kernel compiled and loaded outside the capture
    stream = dec.stream
    graph = capture(cp, stream, (lambda: dec.run_head(B)) if kind == "head"
                    else lambda: dec.run_layer(0, B))
    print(f"graph {replay_time(cp, stream, graph, repeat=200) * 1e6:.1f}", flush=True)
    if kind == "head":  # its floor: the vocabulary matrix read once at the copy rate
        from timing import copy_rate

        nbytes = dec.top["head"].nbytes
        print(f"floor {nbytes / copy_rate(cp) * 1e6:.1f} {nbytes / 1e6:.0f}", flush=True)
    cp.cuda.profiler.start()
    graph.launch(stream)
    stream.synchronize()
    cp.cuda.profiler.stop()


def child_values(out: str, key: str) -> list[float] | None:
    """The numbers of the child's line that starts with `key` (`graph`: the replay's us;
    `floor`: the vocabulary matrix's floor us and megabytes, printed for the head only), None
    where it printed no such line."""
    for line in out.splitlines():
        if line.startswith(key + " "):
            return [float(v) for v in line.split()[1:]]
    return None


def kernel_times(text: str) -> list[tuple[str, float]]:
    """(kernel name, microseconds) per profiled launch from ncu's --csv output."""
    rows = [r for r in csv.reader(io.StringIO(text)) if len(r) > 10]
    if not rows:
        return []
    head = rows[0]
    name, value, unit = (head.index(c) for c in ("Kernel Name", "Metric Value", "Metric Unit"))
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    return [(r[name], float(r[value].replace(",", "")) * scale[r[unit]]) for r in rows[1:]]


DETAIL = ("SpeedOfLight", "Occupancy", "LaunchStats", "SchedulerStats", "WarpStateStats",
          "MemoryWorkloadAnalysis")


def child_command(kind: str, ctx: int, batch: int) -> list[str]:
    """This tool as the child that captures, times and replays one layer kind's graph."""
    return [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--ctx", str(ctx),
            "--batch", str(batch)]


def detail(kind: str, ctx: int, batch: int, ncu: str, kernels: str) -> None:
    """Run the child under ncu with the stall and memory sections of the matching kernels."""
    me = child_command(kind, ctx, batch)
    sections = [a for s in DETAIL for a in ("--section", s)]
    out = subprocess.run([ncu, "--graph-profiling", "node", "--profile-from-start", "off",
                          "--clock-control", "none", "--kernel-name", f"regex:{kernels}",
                          *sections, *me], capture_output=True, text=True, check=True).stdout
    print(f"\n{kind} layer, position {ctx - 2}, batch {batch}:\n{out}")


def profile(kind: str, ctx: int, batch: int, ncu: str) -> None:
    """Run the child under ncu and print its kernels' table."""
    me = child_command(kind, ctx, batch)
    plain = subprocess.run(me, capture_output=True, text=True, check=True)
    graph_us = child_values(plain.stdout, "graph")[0]
    floor = child_values(plain.stdout, "floor")
    out = subprocess.run([ncu, "--graph-profiling", "node", "--profile-from-start", "off",
                          "--clock-control", "none", "--metrics", "gpu__time_duration.sum",
                          "--csv", *me], capture_output=True, text=True, check=True).stdout
    times = kernel_times(out)
    print(f"\n{kind}, position {ctx - 2}, batch {batch}: graph replay {graph_us:.1f} us, "
          f"{len(times)} kernels summing to {sum(t for _, t in times):.1f} us serialized")
    if floor:
        print(f"  the vocabulary matrix: {floor[1]:.0f} MB, floor {floor[0]:.1f} us at the copy "
              f"rate; the replay {graph_us / floor[0]:.2f}x it")
    for name, us in times:
        print(f"  {us:7.2f} us  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="csa,sliding,hca")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--detail", help="ncu's sections for the kernels matching this regex")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(TOOLS))
    if args.child:
        child(args.child, args.ctx, args.batch)
        return
    ncu = shutil.which("ncu") or next(iter(sorted(Path("/opt/nvidia").glob(
        "nsight-compute/*/ncu"))), None)
    if ncu is None:
        sys.exit("profile_decode needs Nsight Compute's ncu on PATH")
    for kind in args.layers.split(","):
        if args.detail:
            detail(kind, args.ctx, args.batch, str(ncu), args.detail)
        else:
            profile(kind, args.ctx, args.batch, str(ncu))


if __name__ == "__main__":
    main()
