"""Jobs, slots and the interleaving scheduler (docs/ARCHITECTURE.md, The scheduler).

`from ds4.jobs import Scheduler, SchedulerConfig` loads lazily, so that importing the plain
event contracts (ds4.jobs.events) never pulls in the engine, the parser or the sampler.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Scheduler": "ds4.jobs.scheduler",
    "SchedulerConfig": "ds4.jobs.scheduler",
    "SchedulerStats": "ds4.jobs.stats",
    "Job": "ds4.jobs.job",
    "Slot": "ds4.jobs.slot",
    "TraceWriter": "ds4.jobs.trace",
    "read_trace": "ds4.jobs.trace",
    "read_trace_file": "ds4.jobs.trace",
    "TraceError": "ds4.jobs.trace",
    "TraceRun": "ds4.jobs.replay",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import an exported name on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ds4.jobs' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
