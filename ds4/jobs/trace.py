"""`--trace FILE`: a header line naming the model, then one JSON line per ended job, each
written whole under a lock (docs/ARCHITECTURE.md, Traces). Traces without a header (older
servers) still read."""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ds4.jobs.job import Job

JsonValue = str | int | float | bool | None | list | dict  # what a trace line's fields hold
FORMAT = 1  # the header's "ds4_trace": bumped when a record's meaning changes
NEEDED = ("seq", "endpoint", "sampling", "seed", "prompt_token_ids", "generated_tokens",
          "finish_reason", "token_times_s")  # what a replay reads of every record


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


class TraceWriter:
    """Appends job records to a file; one `write` call per job so lines never interleave."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        # open for the server's lifetime, closed by close(); truncates, like ds4
        self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict) -> None:
        """Write one record (or the header) as one line and flush it."""
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            self._file.close()


@dataclass
class Trace:
    """A trace file read whole: its header (empty for an old trace) and its job records."""

    header: dict = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)


def read_trace_file(path: str | Path) -> Trace:
    """Header and records of a trace file; TraceError (naming the line) when it is not one."""
    trace = Trace()
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise TraceError(f"{path}:{number}: not UTF-8 text") from None
            if not line.strip():
                continue
            value = parse_line(path, number, line)
            if "ds4_trace" in value:
                if number != 1:
                    raise TraceError(f"{path}:{number}: a header line after the first line")
                trace.header = value
            else:
                trace.records.append(check_record(path, number, value))
    return trace


def weight_shapes(model_dir: Path) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of every tensor in the directory's safetensors headers, sorted."""
    out = []
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        out += [(name, info["dtype"], info["shape"]) for name, info in header.items()
                if name != "__metadata__"]
    return sorted(out)


def model_fingerprint(model_dir: str | Path) -> str:
    """A digest of config.json's bytes and the weights' names, shapes and dtypes: equal for
    the same model, different for another one (no weight byte is read)."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    digest.update(json.dumps(weight_shapes(model_dir)).encode())
    return digest.hexdigest()[:32]


def trace_header(model_dir: str | Path, **settings: JsonValue) -> dict:
    """The first line of a trace: format version, model fingerprint, the server's settings."""
    return {"ds4_trace": FORMAT, "model_fingerprint": model_fingerprint(model_dir), **settings}


def job_record(job: Job) -> dict:
    """Everything a replay needs of one ended job; times in seconds after its arrival."""
    req = job.request
    times = [round(t - job.arrived, 6) for t in job.token_times]
    started = getattr(job, "started", None)
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
        "forced_text": req.forced_text,
        "streamed": req.streamed,
        "generated_tokens": job.generated(),
        "reasoning_tokens": job.usage().reasoning_tokens,
        "text": job.text(),
        "finish_reason": job.finish_reason,
        "error": job.error.message if job.error else None,
        "redecodes": job.redecodes,
        "started_s": round(started - job.arrived, 6) if started is not None else None,
        "first_token_s": times[0] if times else None,
        "token_times_s": times,
        "ended_s": round(job.clock() - job.arrived, 6),
        "raw_request": req.raw_body,
        "prompt_token_ids": list(req.prompt_tokens),
    }


def parse_line(path: str | Path, number: int, line: str) -> dict:
    """One line as a JSON object, or a TraceError naming the line."""
    try:
        value = json.loads(line)
    except ValueError as exc:
        raise TraceError(f"{path}:{number}: not a JSON line (truncated or edited?): "
                         f"{exc}") from None
    if not isinstance(value, dict):
        raise TraceError(f"{path}:{number}: a trace line is a JSON object, got "
                         f"{type(value).__name__}")
    return value


def check_record(path: str | Path, number: int, record: dict) -> dict:
    """A job record with every field a replay reads, or a TraceError naming the line."""
    missing = [k for k in NEEDED if k not in record]
    if missing:
        raise TraceError(f"{path}:{number}: not a ds4 job record (no {', '.join(missing)})")
    if not isinstance(record["generated_tokens"], list) or \
            not isinstance(record["prompt_token_ids"], list):
        raise TraceError(f"{path}:{number}: token ids must be lists")
    return record


def read_trace(path: str | Path) -> list[dict]:
    """Records of a trace file, in the order jobs ended (the header left out)."""
    return read_trace_file(path).records
