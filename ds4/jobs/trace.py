"""`--trace FILE`: one JSON line per ended job, written whole (docs/ARCHITECTURE.md, Traces)."""

from __future__ import annotations

import json
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any


def job_record(job: Any) -> dict:
    """Everything a replay needs of one ended job; times in seconds after its arrival."""
    req = job.request
    times = [round(t - job.arrived, 6) for t in job.token_times]
    return {
        "seq": job.seq,
        "endpoint": req.endpoint,
        "slot": job.slot.index if job.slot is not None else None,
        "arrived_at": job.arrived_wall,
        "prompt_tokens": len(req.prompt_tokens),
        "cached_tokens": job.cached,
        "sampling": asdict(req.sampling),
        "seed": job.seed,
        "id_seed": job.id_seed,
        "max_tokens": req.max_tokens,
        "stop": list(req.stop),
        "thinking": req.thinking,
        "tools_active": req.tools_active,
        "generated_tokens": job.generated(),
        "reasoning_tokens": job.usage().reasoning_tokens,
        "text": job.text(),
        "finish_reason": job.finish_reason,
        "error": job.error.message if job.error else None,
        "redecodes": job.redecodes,
        "first_token_s": times[0] if times else None,
        "token_times_s": times,
        "raw_request": req.raw_body,
        "prompt_token_ids": list(req.prompt_tokens),
    }


class TraceWriter:
    """Appends job records to a file; one `write` call per job so lines never interleave."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        # open for the server's lifetime, closed by close(); truncates, like ds4
        self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict) -> None:
        """Write one record as one line and flush it."""
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            self._file.close()


def read_trace(path: str | Path) -> list[dict]:
    """Records of a trace file, in the order jobs ended."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
