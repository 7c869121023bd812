"""L2 prefetch of weights a later kernel of the decode step reads (ds4/kernels/prefetch.cu).

`l2_prefetch(arrays)` asks the L2 for the bytes of each array and returns once the requests are
issued; it changes no value, so its NumPy twin does nothing. The decoder launches it on a side
branch of its graph while the main chain runs kernels that leave DRAM idle (docs/PERF.md)."""

from __future__ import annotations

import numpy as np

from ds4.kernels import launch

BLOCKS, THREADS = 32, 256  # default shape: requests from 32 SMs
BULK_CHUNK = 16384


def l2_prefetch(arrays, blocks: int = BLOCKS, bulk: int = BULK_CHUNK, last: bool = True) -> None:
    """Prefetch every array (device arrays; a PackedMatrix gives its codes and scales) into the
    L2: bulk > 0 through cp.async.bulk in chunks of that many bytes, 0 line by line (last: with
    the evict_last priority)."""
    for a in _ranges(arrays):
        if bulk:
            launch("prefetch", "l2_prefetch_bulk", (blocks,), (THREADS,),
                   (a, np.int64(a.nbytes), np.int32(bulk)))
        else:
            launch("prefetch", "l2_prefetch_lines", (blocks,), (THREADS,),
                   (a, np.int64(a.nbytes), np.int32(int(last))))


def l2_prefetch_numpy(arrays, blocks: int = BLOCKS, bulk: int = BULK_CHUNK,
                   last: bool = True) -> None:
    """NumPy twin: a prefetch changes no value."""


def _ranges(arrays) -> list:
    """The device arrays behind `arrays` (a PackedMatrix: codes, then scales)."""
    out = []
    for a in arrays:
        out += [a.codes, a.scale] if hasattr(a, "codes") else [a]
    return out


def prefetch_aside(arrays, stream) -> None:
    """l2_prefetch(arrays) on `stream`, forked from the current stream where it stands (a
    graph being captured takes the branch in; `join` brings it back)."""
    import cupy

    stream.wait_event(cupy.cuda.get_current_stream().record())
    with stream:
        l2_prefetch(arrays)


def join(stream) -> None:
    """The current stream waits for what `stream` was given so far."""
    import cupy

    cupy.cuda.get_current_stream().wait_event(stream.record())
