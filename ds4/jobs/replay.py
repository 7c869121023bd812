"""Run a trace's jobs again in this process, through the real scheduler, from their recorded
prompt token ids, seeds and sampling settings; each job's tokens and times are kept."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ds4.jobs.events import Failed, Finished, JobRequest, SamplingOptions
from ds4.jobs.latency import JobTiming
from ds4.jobs.scheduler import Scheduler, SchedulerConfig

if TYPE_CHECKING:
    from ds4.engine import Engine
    from ds4.jobs.events import JobEvent
    from ds4.jobs.job import Job

ASAP, ORIGINAL = "asap", "original"
ENDED_ON_ITS_OWN = ("stop", "length", "tool_calls")


@dataclass
class Replayed:
    """One job run again: what it generated and when (seconds from the replay's start)."""

    seq: int
    slot: int | None
    tokens: list[int]
    finish_reason: str | None
    error: str | None
    timing: JobTiming


def ended_on_its_own(record: dict) -> bool:
    """Jobs not cancelled and not failed: their tokens must come out the same again."""
    return record.get("finish_reason") in ENDED_ON_ITS_OWN


def job_request(record: dict) -> JobRequest:
    """The recorded job's request, with its recorded seed made explicit."""
    sampling = SamplingOptions(**{**record["sampling"], "seed": record["seed"]})
    return JobRequest(
        prompt_tokens=list(record["prompt_token_ids"]), sampling=sampling,
        max_tokens=record.get("max_tokens", 256), stop=list(record.get("stop") or []),
        thinking=bool(record.get("thinking")), tools_active=bool(record.get("tools_active")),
        forced_text=record.get("forced_text") or "", streamed=bool(record.get("streamed")),
        endpoint=record.get("endpoint") or "", raw_body=record.get("raw_request") or "")


class Waiter:
    """A job's sink: notes when the job ended and frees its place for the next `asap` job."""

    def __init__(self, clock: Callable[[], float], room: threading.Semaphore,
                 on_end: Callable[[], None]):
        self.clock = clock
        self.room = room
        self.on_end = on_end
        self.ended_at: float | None = None
        self.done = threading.Event()

    def __call__(self, event: JobEvent) -> None:
        if isinstance(event, (Finished, Failed)) and not self.done.is_set():
            self.ended_at = self.clock()
            self.done.set()
            self.room.release()
            self.on_end()


class TraceRun:
    """Submits recorded jobs to a scheduler, at their recorded gaps or as slots free up."""

    def __init__(self, engine: Engine, config: SchedulerConfig, timing: str = ASAP,
                 on_end: Callable[[], None] = lambda: None):
        self.scheduler = Scheduler(engine, config, time.monotonic)
        self.timing = timing
        self.on_end = on_end  # called on the scheduler thread as each job ends
        # asap: at most `parallel` jobs in flight; original: arrivals are never held back
        self.room = threading.Semaphore(config.parallel if timing == ASAP else 10**9)

    def run(self, records: list[dict]) -> list[Replayed]:
        """Every record's job run once; results in arrival (seq) order."""
        order = sorted(records, key=lambda r: r["seq"])
        self.scheduler.start()
        try:
            self.origin = time.monotonic()
            pending = [self.submit(r, order[0]) for r in order]
            return [self.collect(r, job, waiter) for r, (job, waiter) in zip(order, pending)]
        finally:
            self.scheduler.stop()

    def submit(self, record: dict, first: dict) -> tuple[Job, Waiter]:
        """Wait for the record's turn, then queue its job."""
        if self.timing == ORIGINAL:
            gap = record.get("arrived_at", 0.0) - first.get("arrived_at", 0.0)
            time.sleep(max(0.0, self.origin + gap - time.monotonic()))
        self.room.acquire()
        waiter = Waiter(time.monotonic, self.room, self.on_end)
        return self.scheduler.submit(job_request(record), waiter), waiter

    def collect(self, record: dict, job: Job, waiter: Waiter) -> Replayed:
        """The job's outcome once it ended."""
        waiter.done.wait()
        at = self.origin
        timing = JobTiming(job.arrived - at, [t - at for t in job.token_times],
                           waiter.ended_at - at,
                           job.started - at if job.started is not None else None,
                           len(job.request.prompt_tokens))
        slot = job.slot.index if job.slot is not None else None
        return Replayed(record["seq"], slot, job.generated(), job.finish_reason,
                        job.error.message if job.error else None, timing)
