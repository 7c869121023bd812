"""The one rule of `--ssd-streaming` (routed experts read from the mapped checkpoint per use):
what it cannot be combined with. The CLI turns a refusal into a usage error, the scheduler
into a ValueError; both ask here, so the flag's limits are written once."""

from __future__ import annotations

from ds4.engine import cuda_available

TOO_MANY_SLOTS = ("--parallel > 1 cannot be combined with --ssd-streaming: interleaved sessions "
                  "would thrash the streamed expert cache; use --parallel 1")
NO_CHECKPOINT = "--ssd-streaming reads experts from checkpoint files; --load-format dummy has none"
NOT_ON_CUPY = ("--ssd-streaming is not supported on the CuPy backend yet; "
               "use --backend numpy or drop --ssd-streaming")


def ssd_streaming_refusal(parallel: int = 1, backend: str = "numpy",
                          load_format: str = "auto") -> str | None:
    """Why --ssd-streaming cannot run with these settings (None: it can). `backend` may be
    "auto", resolved only when the other settings pass (finding a GPU takes a while)."""
    if parallel > 1:
        return TOO_MANY_SLOTS
    if load_format == "dummy":
        return NO_CHECKPOINT
    if backend == "cupy" or (backend == "auto" and cuda_available()):
        return NOT_ON_CUPY
    return None
