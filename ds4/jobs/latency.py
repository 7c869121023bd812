"""Serving latencies as vLLM's benchmarks define them, for traces, replays and load tests.

TTFT: arrival to the first token. ITL: the gaps between consecutive later tokens, pooled over
all requests. TPOT: (latency - TTFT) / (tokens - 1), per request with more than one token.
E2EL: arrival to the end of the request. Times are seconds on one clock per run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class JobTiming:
    """One request's times, in seconds from a run's common origin."""

    arrived: float
    token_times: list[float] = field(default_factory=list)
    ended: float | None = None
    started: float | None = None  # when it got a slot (None where unknown)
    prompt_tokens: int = 0
    counted: int | None = None  # output tokens where their times are unknown (non-streamed)

    @property
    def tokens(self) -> int:
        """Output tokens (one time each, or as counted)."""
        return len(self.token_times) if self.counted is None else self.counted

    @property
    def ttft(self) -> float | None:
        """Arrival to the first token."""
        return self.token_times[0] - self.arrived if self.token_times else None

    @property
    def latency(self) -> float | None:
        """Arrival to the end of the request (its last token when the end is unknown)."""
        end = self.ended if self.ended is not None else \
            (self.token_times[-1] if self.token_times else None)
        return end - self.arrived if end is not None else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.tokens < 2 or self.latency is None or self.ttft is None:
            return None
        return (self.latency - self.ttft) / (self.tokens - 1)

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def itl_mean(self) -> float | None:
        """This request's mean gap between consecutive tokens (None under two)."""
        gaps = self.itl
        return sum(gaps) / len(gaps) if gaps else None

    @property
    def queued(self) -> float | None:
        """Arrival to getting a slot."""
        return self.started - self.arrived if self.started is not None else None

    def per_job(self) -> dict:
        """The job's own figures, in seconds."""
        return {"arrived_s": self.arrived, "queue_s": self.queued, "ttft_s": self.ttft,
                "itl_s": self.itl_mean, "tpot_s": self.tpot, "e2el_s": self.latency,
                "tokens": self.tokens}


def stats(values: list[float]) -> dict | None:
    """Mean and the percentiles of some values (None when there are none)."""
    if not values:
        return None
    arr = np.asarray(values, dtype=np.float64)
    out = {"mean": float(arr.mean())}
    out.update({f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES})
    return out


def summary(timings: list[JobTiming]) -> dict:
    """Aggregates over a run: latency statistics, duration and throughputs."""
    if not timings:
        return {"requests": 0}
    start = min(t.arrived for t in timings)
    end = max(t.arrived + (t.latency or 0.0) for t in timings)
    duration = max(end - start, 1e-9)
    tokens = sum(t.tokens for t in timings)
    return {
        "requests": len(timings), "duration_s": duration, "output_tokens": tokens,
        "input_tokens": sum(t.prompt_tokens for t in timings),
        "request_throughput": len(timings) / duration, "token_throughput": tokens / duration,
        "ttft_s": stats([t.ttft for t in timings if t.ttft is not None]),
        "itl_s": stats([g for t in timings for g in t.itl]),
        "tpot_s": stats([t.tpot for t in timings if t.tpot is not None]),
        "e2el_s": stats([t.latency for t in timings if t.latency is not None]),
    }


def recorded_timing(record: dict, origin: float) -> JobTiming:
    """A trace record's times, from `origin` (the wall-clock arrival of the run's first job)."""
    arrived = record.get("arrived_at", origin) - origin
    started = record.get("started_s")
    return JobTiming(arrived, [arrived + t for t in record.get("token_times_s") or []],
                     arrived + record["ended_s"] if record.get("ended_s") is not None else None,
                     arrived + started if started is not None else None,
                     len(record.get("prompt_token_ids") or []))
