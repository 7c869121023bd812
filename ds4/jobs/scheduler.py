"""The scheduler: one thread owns the engine and runs N slots' jobs (docs/ARCHITECTURE.md).

A turn reads like its description: admit queued jobs to idle slots, pick the next busy slot
round-robin, fire one transition of its job, release the slot if the job ended. When that job
decodes, every decoding job advances one burst in lock-step instead, one engine step per token
for all of them (ds4/jobs/decode_batch.py), and each fires its own transition.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ds4.jobs.decode_batch import BatchRotation, LockStepDecode
from ds4.jobs.events import JobRequest, JobSink, Queued
from ds4.jobs.job import Job, Timeslice
from ds4.jobs.kvstore import KVStore, SlotCheckpoints
from ds4.jobs.placement_policy import ReplacementPolicy
from ds4.jobs.slot import Slot
from ds4.jobs.speculative import SpeculationConfig, Speculator
from ds4.jobs.ssd_streaming import ssd_streaming_refusal
from ds4.jobs.stats import SchedulerStats
from ds4.jobs.trace import TraceWriter, job_record

if TYPE_CHECKING:
    from ds4.engine import Engine

log = logging.getLogger("ds4.jobs")

IDLE_WAIT_S = 0.5  # the thread re-checks for stop this often when nothing arrives
Setting = int | float | str | bool | None  # the value of one SchedulerConfig field


@dataclass(frozen=True)
class SchedulerConfig:
    """Slots, context and the two timeslices; read once at start-up."""

    parallel: int = 1
    ctx_size: int = 4096
    prefill_ms: float = 1500.0
    decode_tokens: int = 6
    trace_path: str | None = None
    ssd_streaming: bool = False
    mtp_draft: int = 0  # MTP drafts per round of a greedy job (0: no speculation)
    mtp_margin: float = 0.0

    def __post_init__(self) -> None:
        if self.parallel < 1:
            raise ValueError(f"--parallel must be at least 1, got {self.parallel}")
        if self.decode_tokens < 1:
            raise ValueError(f"decode burst must be at least 1 token, got {self.decode_tokens}")
        if self.ssd_streaming and (why := ssd_streaming_refusal(parallel=self.parallel)):
            raise ValueError(why)

    @classmethod
    def from_env(cls, env: dict | None = None, **overrides: Setting) -> SchedulerConfig:
        """Defaults, then DS4_SERVER_SCHED_PREFILL_MS / _DECODE_TOKENS, then overrides."""
        env = os.environ if env is None else env
        values: dict[str, Setting] = {}
        if env.get("DS4_SERVER_SCHED_PREFILL_MS"):
            values["prefill_ms"] = float(env["DS4_SERVER_SCHED_PREFILL_MS"])
        if env.get("DS4_SERVER_SCHED_DECODE_TOKENS"):
            values["decode_tokens"] = int(env["DS4_SERVER_SCHED_DECODE_TOKENS"])
        values.update(overrides)
        return cls(**values)


class Scheduler:
    """Owns the engine; runs jobs on N slots, one transition per turn."""

    def __init__(self, engine: Engine, config: SchedulerConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, kvstore: KVStore | None = None):
        self.engine = engine
        self.kvstore = kvstore  # disk checkpoints; its owner opens and closes it
        self.config = config or SchedulerConfig()
        refuse_ssd_streaming_on_gpu(engine, self.config)
        self.clock = clock
        self.stats = SchedulerStats()
        self.slots = [Slot(i, engine.new_session(ctx_size=self.config.ctx_size))
                      for i in range(self.config.parallel)]
        self.pending = PendingQueue()
        self.picker = SlotPicker()
        self.rotation = BatchRotation()  # a lock-step decode of every decoding job is one turn
        self.lockstep = LockStepDecode(engine, self.config.decode_tokens)
        self.replacement = ReplacementPolicy(engine)  # experts follow the routing counts
        self.speculator = self._speculator()  # its `oracle` may be set before start()
        self.trace = TraceWriter(self.config.trace_path) if self.config.trace_path else None
        self.turns = 0
        self._seq = 0
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # -- API for the server (thread-safe) -----------------------------------------------

    def submit(self, request: JobRequest, sink: JobSink) -> Job:
        """Queue a job; its sink gets Queued now and every later event from the scheduler."""
        with self._lock:  # stop() takes the same lock: no job slips in after shutdown
            self._seq += 1
            job = Job(request, sink, self._seq, self.clock, self.stats)
            refused = self._stopping.is_set()
            if not refused:
                sink(Queued(len(self.pending)))  # before the scheduler can see it: in order
                self.pending.push(job)
        if refused:
            job.fail_with_message("server shutting down", 503)
            return job
        self.stats.queue_depth = len(self.pending)
        self._wakeup.set()
        return job

    def cancel(self, job: Job) -> None:
        """Ask a job to stop; it does at the next chunk or token boundary."""
        job.cancel_requested.set()
        self._wakeup.set()

    def slots_info(self) -> list[dict]:
        """Per slot: id, busy, tokens held, last used, prefix source, decode batch (GET /slots)."""
        return [s.info() for s in self.slots]

    def live_call_ids(self) -> set[str]:
        """Tool-call ids a continuation can still append to, over all slots."""
        return set().union(*(s.live_call_ids() for s in self.slots))

    def start(self) -> None:
        """Run turns on a background thread until stop()."""
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="ds4-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; jobs still queued or running end failed ("shutdown requested")."""
        with self._lock:
            self._stopping.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._end_all("shutdown requested")
        self._store_slots()
        if self.trace is not None:
            self.trace.close()

    # -- one turn ------------------------------------------------------------------------

    def run_turn(self) -> bool:
        """Admit queued jobs, then advance one busy slot by one transition; False when idle."""
        acted = self._admit()
        slot = self.rotation.next(self.slots)
        if slot is not None:
            batch = self._lockstep_members(slot)
            if len(batch) > 1:
                self._advance_batch(batch)
            else:
                self.lockstep.single(slot, self._advance)
            self.turns += 1
            acted = True
            self.replacement.after_turn(self.stats)  # between steps, never inside one
        self.stats.busy_slots = sum(s.busy for s in self.slots)
        return acted

    def _lockstep_members(self, slot: Slot) -> list[Slot]:
        """Who decodes with `slot` this turn; a speculating job decodes alone (its verify is
        a pass of its own) and never joins another's batch."""
        if slot.job.speculates:
            return []
        return [s for s in self.lockstep.members(self.slots, slot) if not s.job.speculates]

    def _speculator(self) -> Speculator | None:
        """The MTP policy every greedy job shares (None without --mtp)."""
        if self.config.mtp_draft < 1:
            return None
        if getattr(self.engine, "mtp", None) is None:
            raise ValueError("MTP speculation needs an engine opened with its MTP block")
        config = SpeculationConfig(self.config.mtp_draft, self.config.mtp_margin)
        return Speculator(config, self.stats.speculation)

    def others_waiting(self, job: Job) -> bool:
        """True when someone other than `job` could run now."""
        if any(s.busy and s.job is not job for s in self.slots):
            return True
        return any(self.picker.could_start(j, self.slots) for j in self.pending.jobs()
                   if not j.cancel_requested.is_set())

    def _admit(self) -> bool:
        """Cancel queued jobs that asked to; give idle slots to the oldest jobs that fit."""
        acted = False
        for job in self.pending.jobs():
            if job.cancel_requested.is_set():
                self._end_queued(job, job.cancel)
                acted = True
                continue
            try:
                slot = self.picker.pick(job, self.slots)
            except Exception as exc:  # a broken prompt must not stall the queue behind it
                log.exception("job %d: no slot could be chosen", job.seq)
                self._end_queued(job, lambda job=job, exc=exc: job.fail_with(exc))
                acted = True
                continue
            if slot is not None:  # a job waiting for its busy bound slot lets later ones by
                self.pending.remove(job)
                self._assign(job, slot)
        self.stats.queue_depth = len(self.pending)
        return acted

    def _end_queued(self, job: Job, end: Callable[[], object]) -> None:
        """End a job that never got a slot."""
        self.pending.remove(job)
        self._reporting(job, end)
        self._record_end(job)

    def _reporting(self, job: Job, end: Callable[[], object]) -> None:
        """Fire a terminal trigger; a sink that raises on the report cannot stop the loop."""
        try:
            end()
        except Exception:  # the job reached its terminal state before its sink raised
            log.exception("job %d: its sink refused the final report", job.seq)

    def _assign(self, job: Job, slot: Slot) -> None:
        slot.job = job
        timeslice = Timeslice(self.config.prefill_ms / 1000.0, self.config.decode_tokens,
                              lambda: self.others_waiting(job))
        job.bind(slot, self.engine.tokenizer, timeslice, self._checkpoints(slot), self.speculator)

    def _checkpoints(self, slot: Slot) -> SlotCheckpoints | None:
        """The disk store as this slot's job sees it (None without a store)."""
        return SlotCheckpoints(self.kvstore, slot, self.engine) if self.kvstore else None

    def _advance(self, slot: Slot) -> None:
        job = slot.job
        try:
            if job.cancel_requested.is_set():
                job.cancel()
            else:
                job.step()
        except Exception as exc:  # any failure ends this job only, not the loop
            log.exception("job %d failed on slot %d", job.seq, slot.index)
            self._fail(job, exc)
        if job.is_terminal:
            self._release(slot, job)

    def _advance_batch(self, slots: list[Slot]) -> None:
        """One burst of every decoding job in lock-step, then each job's own decode_round."""
        failed = self.lockstep.run(slots)
        self.rotation.ran_batch(slots)
        for slot in slots:
            job = slot.job
            if job in failed:
                self._fail(job, failed[job])
                if job.is_terminal:
                    self._release(slot, job)
                continue
            job.burst_ran = True  # decode_round finds its burst done
            self._advance(slot)
            job.burst_ran = False

    def _fail(self, job: Job, exc: Exception) -> None:
        if not job.is_terminal:  # else it ended, then its sink raised: nothing left to tell
            self._reporting(job, lambda: job.fail_with(exc))

    def _release(self, slot: Slot, job: Job) -> None:
        slot.job = None
        slot.last_used = self.clock()
        self._record_end(job)

    def _record_end(self, job: Job) -> None:
        self.stats.count_end(job.state)
        if self.trace is not None:
            self.trace.write(job_record(job))

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._wakeup.clear()
            try:
                acted = self.run_turn()
            except Exception:  # a scheduler bug: keep serving the other jobs, say so loudly
                log.exception("scheduler turn failed")
                acted = False
            if not acted:
                self._wakeup.wait(IDLE_WAIT_S)

    def _store_slots(self) -> None:
        """Shutdown: every slot's state goes to the disk store (after the thread stopped)."""
        if self.kvstore is None:
            return
        for slot in self.slots:
            try:
                self._checkpoints(slot).shutdown()
            except Exception:  # a failed checkpoint must not stop the shutdown
                log.exception("slot %d: shutdown checkpoint failed", slot.index)
        self.kvstore.flush()

    def _end_all(self, message: str) -> None:
        """Fail every job still queued or on a slot (after the thread stopped)."""
        for job in self.pending.jobs():
            self._end_queued(job, lambda job=job: job.fail_with_message("server shutting down",
                                                                        503))
        for slot in self.slots:
            if slot.job is not None:
                job = slot.job
                self._reporting(job, lambda job=job: job.fail_with_message(message, 503))
                self._release(slot, job)
        self.stats.queue_depth = 0
        self.stats.busy_slots = 0
def refuse_ssd_streaming_on_gpu(engine: Engine, config: SchedulerConfig) -> None:
    """The CuPy backend cannot stream experts from disk yet: say so instead of pretending."""
    backend = getattr(engine, "backend", None)
    name = getattr(backend, "name", backend)
    if config.ssd_streaming and name == "cupy":  # the engine's backend is resolved already
        raise ValueError(ssd_streaming_refusal(backend="cupy"))


class PendingQueue:
    """Jobs waiting for a slot, oldest first; shared with submitting threads."""

    def __init__(self) -> None:
        self._jobs: deque[Job] = deque()
        self._lock = threading.Lock()

    def push(self, job: Job) -> None:
        """Append a job."""
        with self._lock:
            self._jobs.append(job)

    def jobs(self) -> list[Job]:
        """The waiting jobs, oldest first (a copy)."""
        with self._lock:
            return list(self._jobs)

    def remove(self, job: Job) -> None:
        """Take a job out (it got a slot, or was cancelled)."""
        with self._lock:
            self._jobs.remove(job)

    def __len__(self) -> int:
        return len(self._jobs)


class SlotPicker:
    """Where a queued job runs: its call-id slot, else the best reusable prefix, else LRU."""

    def bound_slot(self, job: Job, slots: list[Slot]) -> Slot | None:
        """The slot holding one of the job's continued call ids, busy or not."""
        ids = job.request.call_ids
        if not ids:
            return None
        return next((s for s in slots if s.holds_any(ids)), None)

    def pick(self, job: Job, slots: list[Slot]) -> Slot | None:
        """An idle slot for the job, or None when it must wait (its bound slot is busy)."""
        bound = self.bound_slot(job, slots)
        if bound is not None:
            return None if bound.busy else bound
        idle = [s for s in slots if not s.busy]
        if not idle:
            return None
        prompt = job.request.prompt_tokens
        reuse = {s.index: s.session.reusable_prefix(prompt) for s in idle}
        best = max(idle, key=lambda s: (reuse[s.index], -s.last_used))
        if reuse[best.index] > 0:
            return best
        # a slot still bound to call ids awaits that conversation's tool results: keep it
        return min(idle, key=lambda s: (bool(s.live_call_ids()), s.last_used))

    def could_start(self, job: Job, slots: list[Slot]) -> bool:
        """Cheap test: would the job get a slot now? (No prefix scoring.)"""
        bound = self.bound_slot(job, slots)
        if bound is not None:
            return not bound.busy
        return any(not s.busy for s in slots)


