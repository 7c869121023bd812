"""Device clocks of the benchmarks under tools/: a function's median seconds by CUDA events,
a captured graph's replay, and the two ceilings every table is read against (the device copy
rate and the fp16 GEMM rate), measured in the same run as the figures they judge."""

from __future__ import annotations

import numpy as np


def timed(cp, fn, repeat: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() measured with device events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return float(np.median(times))


def copy_rate(cp, floats: int = 1 << 29) -> float:
    """Device copy bandwidth (bytes read + written per second) over `floats` fp32 values
    (default 2 GiB, far past the 50-60 MB L2)."""
    a = cp.ones(floats, dtype=cp.float32)
    b = cp.empty_like(a)
    return 2 * a.nbytes / timed(cp, lambda: cp.copyto(b, a), repeat=10)


def ceilings(cp) -> dict:
    """Device copy bandwidth (bytes read + written per second, over 4 GiB) and fp16 GEMM
    FLOP/s."""
    copy = copy_rate(cp, 1 << 30)
    n = 8192
    x = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    gemm = timed(cp, lambda: x @ x, repeat=10)
    return {"copy_bytes_per_s": copy, "gemm_flop_per_s": 2 * n ** 3 / gemm}


def graph_time(cp, stream, fn, repeat: int = 50) -> float:
    """Median seconds of one replay of fn captured as a CUDA graph."""
    return replay_time(cp, stream, capture(cp, stream, fn), repeat)


def capture(cp, stream, fn):
    """fn's launches on stream as a CUDA graph (captured once, ready to replay)."""
    with stream:
        stream.begin_capture()
        fn()
        graph = stream.end_capture()
    cp.cuda.Device().synchronize()
    return graph


def replay_time(cp, stream, graph, repeat: int = 50) -> float:
    """Median seconds of one replay of a captured graph."""

    def replays():
        """Ten back-to-back replays (one timing sample)."""
        for _ in range(10):
            graph.launch(stream)

    with stream:
        return timed(cp, replays, repeat=max(3, repeat // 10)) / 10
