"""When each kernel of a replayed decode graph was let go by the kernel ahead: the device side
of tools/timeline_decode.py.

With DS4_TIMELINE=1 in the environment every family is built with -DDS4_TIMELINE (its own
compile cache entries; the default build has none of it). Then block 0 of each kernel stamps
the global timer as it reaches common.cuh's `wait_inputs()` and as the kernel ahead lets it go,
into one device buffer that every loaded module points at. Under programmatic dependent launch
(pdl.py) a kernel's release is the end of the kernel ahead of it on its stream, so the
differences between consecutive releases are each kernel's share of the graph's critical path,
overlap included, where Nsight Compute's serialized times add launch and cold caches to each.
While a stream captures, `launch` records each kernel's name, grid and block (`launches`): on
one stream the stamps come in that order (a kernel starts only once the one ahead passed its
wait).
"""

from __future__ import annotations

import math
import os

ENTRIES = 4096  # common.cuh's TIMELINE_ENTRIES
FIELDS = 4  # reached, released, the launch's grid id, its blocks << 32 | threads a block

launches: list[tuple[str, int, int]] = []  # (kernel, blocks, threads a block) as captured
_buffer = None


def enabled() -> bool:
    """Whether kernels are built and launched with the timeline (DS4_TIMELINE=1)."""
    return os.environ.get("DS4_TIMELINE", "") not in ("", "0")


def buffer():
    """The device buffer of the stamps: [count, then ENTRIES x FIELDS] uint64 (made once)."""
    global _buffer
    if _buffer is None:
        import cupy

        _buffer = cupy.zeros(1 + ENTRIES * FIELDS, cupy.uint64)
    return _buffer


def attach(module) -> None:
    """Point a loaded module's ds4_timeline at the buffer (every family shares it)."""
    import cupy

    address = module.get_global("ds4_timeline")
    cupy.ndarray((1,), cupy.uint64, address)[0] = buffer().data.ptr


def record(name: str, grid, block) -> None:
    """Note a launch while a stream captures (its blocks over every grid dimension: a
    (heads, splits, members) grid is that many blocks, not its x)."""
    launches.append((name, math.prod(map(int, grid)), math.prod(map(int, block))))


def reset() -> None:
    """Forget the stamps (before the replay to read)."""
    buffer()[0] = 0


def stamps() -> list[tuple[int, int, int, int]]:
    """(reached, released, blocks, threads a block) of each kernel since the last reset, in
    order."""
    return launch_stamps(buffer().get())


def launch_stamps(raw) -> list[tuple[int, int, int, int]]:
    """The stamps of a buffer's copy (numpy uint64), a launch's first only: a kernel whose
    block 0 waits again (a loop over items) stamps again under the same grid id, and those
    come right after its first (the next kernel on the stream is let go once it ends)."""
    count = min(int(raw[0]), ENTRIES)
    out, last = [], None
    for reached, released, grid_id, shape in raw[1:1 + count * FIELDS].reshape(count, FIELDS):
        if grid_id != last:
            out.append((int(reached), int(released), int(shape) >> 32, int(shape) & 0xffffffff))
        last = grid_id
    return out
