"""One request's generation: its state, its machine's phase work, and what it reports."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ds4.chat.events import ParsedOutput, ToolCallStart
from ds4.engine import ContextOverflow
from ds4.jobs.decoding import DecodeAttempt, DecodeTarget
from ds4.jobs.events import (
    Failed,
    Finished,
    JobEvent,
    JobRequest,
    JobSink,
    Progress,
    Started,
    TokenEvents,
    Usage,
)
from ds4.jobs.machine import TERMINAL, attach_machine, turn_triggers
from ds4.jobs.stats import SchedulerStats
from ds4.sampling import make_rng
from ds4.tokenizer import EOS_ID

if TYPE_CHECKING:
    from transitions import EventData

    from ds4.engine import Session
    from ds4.jobs.kvstore import SlotCheckpoints
    from ds4.jobs.slot import Slot
    from ds4.jobs.speculative import Speculator
    from ds4.tokenizer import Tokenizer

MAX_REDECODES = 2
log = logging.getLogger("ds4.jobs")


class Job:
    """One request's generation state, advanced one machine transition per scheduler turn."""

    state: str  # set by the machine

    def __init__(self, request: JobRequest, sink: JobSink, seq: int = 0,
                 clock: Callable[[], float] = time.monotonic,
                 stats: SchedulerStats | None = None):
        attach_machine(self)
        self.request = request
        self.sink = sink
        self.seq = seq
        self.clock = clock
        self.stats = stats or SchedulerStats()
        self.cancel_requested = threading.Event()
        self.arrived = clock()
        self.arrived_wall = time.time()
        self.started: float | None = None  # when it got a slot (traces: its queue time)
        seed = request.sampling.seed
        self.seed = seed if seed is not None else secrets.randbits(63)  # recorded for replay
        self.id_seed = secrets.token_hex(8)  # tool-call ids unique per job, stable on redecode
        self.slot: Slot | None = None
        self.tokenizer: Tokenizer | None = None
        self.timeslice: Timeslice | None = None
        self.checkpoints: SlotCheckpoints | None = None  # when a disk store is on
        self.cached = 0
        self.reached = 0  # prompt tokens the session holds after the last slice
        self.prompt_complete = False
        self.attempt: DecodeAttempt | None = None
        self.redecodes = 0
        self.finish_reason: str | None = None
        self.error: Failed | None = None
        self.token_times: list[float] = []
        self.announced: set[int] = set()  # indexes of tool calls whose start was emitted
        self.burst_ran = False  # set by a lock-step decode turn before it fires decode_round
        self.speculator: Speculator | None = None  # MTP drafts (greedy jobs of an MTP engine)

    # -- driving -------------------------------------------------------------------------

    @property
    def is_terminal(self) -> bool:
        """True once the job is done, failed or cancelled."""
        return self.state in TERMINAL

    def bind(self, slot: Slot, tokenizer: Tokenizer, timeslice: Timeslice,
             checkpoints: SlotCheckpoints | None = None,
             speculator: Speculator | None = None) -> None:
        """Give the job its slot (and the disk checkpoints, the MTP speculator when its sampling
        lets drafts be verified); its next turn fires `begin`."""
        if speculator is not None and speculator.applies(self.request.sampling):
            self.speculator = speculator
        self.slot = slot
        self.tokenizer = tokenizer
        self.timeslice = timeslice
        self.checkpoints = checkpoints

    def step(self) -> str:
        """Fire the one transition this turn owes; returns the trigger fired."""
        for trigger in turn_triggers(self.state):
            if getattr(self, trigger)():
                return trigger
        raise RuntimeError(f"job {self.seq}: no transition from {self.state}")

    def fail_with(self, exc: BaseException) -> None:
        """End the job failed: a context overflow is the client's 400, anything else a 500."""
        if isinstance(exc, ContextOverflow):
            self.error = Failed(str(exc) or "context overflow", 400, "context_overflow")
        else:
            self.error = Failed(f"{type(exc).__name__}: {exc}", 500, "server_error")
        self.fail()

    def fail_with_message(self, message: str, status: int = 500) -> None:
        """End the job failed with a given message (shutdown, refused admission)."""
        self.error = Failed(message, status, "server_error")
        self.fail()

    # -- phase work (ds4/jobs/machine.py:JobPhases) -------------------------------------

    def begin_work(self, _event: EventData | None = None) -> None:
        """Decide what the slot's session can reuse, or restore a longer prefix from disk; the
        timeline's old bindings go away."""
        prompt = self.request.prompt_tokens
        self.started = self.clock()
        self.cached = self.slot.session.reusable_prefix(prompt)
        source = "slot"
        if self.checkpoints is not None:
            restored = self.checkpoints.restore(prompt, self.cached)
            if restored:
                self.cached, source = restored, "disk"
        self.slot.note_prefix(source, self.cached)
        self.reached = self.cached
        self.slot.clear_bindings()
        self.stats.prompt_tokens_reused += self.cached
        self._emit(Started(self.slot.index, len(prompt), self.cached))

    def prefill_slice(self, _event: EventData | None = None) -> None:
        """Evaluate prompt chunks until done, or until the slice is over and others wait."""
        prompt = self.request.prompt_tokens
        session = self.slot.session
        deadline = self.clock() + self.timeslice.prefill_s
        waiting = self.timeslice.others_waiting

        def should_stop() -> bool:
            if self.cancel_requested.is_set():
                return True
            return self.clock() >= deadline and waiting()

        self.prompt_complete = self._sync_prompt(session, prompt, should_stop)
        reached = len(prompt) if self.prompt_complete else min(len(session.tokens), len(prompt))
        self.stats.prompt_tokens_computed += max(0, reached - self.reached)
        self.reached = max(self.reached, reached)
        self._emit(Progress(reached, len(prompt)))

    def _sync_prompt(self, session: Session, prompt: list[int],
                     should_stop: Callable[[], bool]) -> bool:
        """Sync toward the whole prompt, pausing at each checkpoint frontier; True when done."""
        kv = self.checkpoints
        if kv is None:
            return session.sync(prompt, should_stop=should_stop) is not None
        held = self.reached
        while True:
            target = kv.next_stop(held, len(prompt))
            if session.sync(prompt[:target], should_stop=should_stop) is None:
                return False
            held = target
            kv.reached(prompt, target)
            if target == len(prompt):
                return True
            if should_stop():
                return False

    def prompt_done(self, _event: EventData | None = None) -> bool:
        """True once the whole prompt is evaluated."""
        return self.prompt_complete

    def start_decode_work(self, _event: EventData | None = None) -> None:
        """Open the first decode attempt: rng from the seed, cap from max_tokens and ctx room."""
        self.attempt = self._new_attempt(make_rng(self.seed), greedy=False)
        self._emit_all(self.attempt.start())

    def decode_burst(self, _event: EventData | None = None) -> None:
        """Up to decode_tokens tokens; a cancel request ends the burst at a token boundary."""
        if self.burst_ran:  # the scheduler ran this burst in lock-step with other jobs
            self.burst_ran = False
            return
        start = len(self.attempt.tokens)  # a burst counts emitted tokens, not rounds
        while (left := self.timeslice.decode_tokens - (len(self.attempt.tokens) - start)) > 0:
            if not self.burst_token(self.slot.session, left):
                break

    @property
    def speculates(self) -> bool:
        """True when the job decodes in MTP draft/verify rounds (then never in a batch)."""
        return self.speculator is not None

    def burst_token(self, session: DecodeTarget, room: int = 1) -> bool:
        """One step of a burst through `session` (a speculating job may take up to `room`
        tokens); False (nothing done) once it must end."""
        if self.attempt.over or self.cancel_requested.is_set():
            return False
        if self.checkpoints is not None:
            self.checkpoints.decoding()
        self._emit_all(self.attempt.step(session, room))
        return True

    def decode_over(self, _event: EventData | None = None) -> bool:
        """True once the attempt stopped decoding."""
        return self.attempt.over

    def needs_redecode(self, _event: EventData | None = None) -> bool:
        """True when the DSML block failed and recovery attempts remain."""
        return self.redecodes < MAX_REDECODES and self.attempt.recoverable()

    def redecode_work(self, _event: EventData | None = None) -> None:
        """Roll the session back to the last valid DSML token and decode greedily from there."""
        self.redecodes += 1
        old = self.attempt
        kept = old.tokens[: old.recovery_tokens()]
        self.slot.session.sync(self.request.prompt_tokens + kept)
        self.attempt = self._new_attempt(old.rng, greedy=True)
        self.attempt.replay(kept)
        self._emit_all(self.attempt.start())

    def finish_work(self, _event: EventData | None = None) -> None:
        """Settle the finish reason; a closed tool-call turn binds its ids to the slot."""
        out = self.attempt.result()
        reason = self.attempt.finish_reason
        if reason == "malformed":  # recovery gave up: the turn is plain text
            log.warning("job %d: invalid tool call (%s); returned as text", self.seq,
                        out.malformed)
            reason = "length" if len(self.attempt.tokens) >= self.attempt.cap else "stop"
        self.finish_reason = reason
        if out.tool_calls and self.finish_reason != "length":
            self.finish_reason = "tool_calls"
            self.slot.bind_call_ids([c.id for c in out.tool_calls])

    def unterminated(self, _event: EventData | None = None) -> bool:
        """True when a tool-call block never closed (docs/PROTOCOLS.md, Malformed DSML), or a
        streamed turn announced a call that its final parse lacks: a client that saw the call
        begin cannot take it back, so success would be a lie."""
        out = self.attempt.result()
        if self.request.tools_active and out.unterminated:
            self.error = Failed("unterminated tool call", 500, "server_error")
        elif self.request.streamed and self.announced - set(range(len(out.tool_calls))):
            why = out.malformed or "the tool-call block was not completed"
            self.error = Failed(f"invalid tool call: {why}", 500, "server_error")
        return self.error is not None

    # -- reports (state entry callbacks) -------------------------------------------------

    def report_finished(self, _event: EventData | None = None) -> None:
        """Done: the parsed turn, the raw text and usage go to the sink."""
        self._emit(Finished(self.finish_reason, self.output(), self.text(), self.usage(),
                            stop_sequence=self.stop_hit()))

    def report_failed(self, _event: EventData | None = None) -> None:
        """Failed: the slot's bindings can no longer be trusted; the sink gets the error."""
        self.finish_reason = "error"
        if self.slot is not None:
            self.slot.clear_bindings()
        self._emit(self.error or Failed("job failed"))

    def report_cancelled(self, _event: EventData | None = None) -> None:
        """Cancelled: the session keeps only evaluated tokens; the sink hears it ended."""
        self.finish_reason = "cancelled"
        if self.slot is not None:
            self.slot.clear_bindings()
        self._emit(Finished("cancelled", self.output(), self.text(), self.usage()))

    # -- results -------------------------------------------------------------------------

    def output(self) -> ParsedOutput:
        """The parsed turn so far (empty before decoding)."""
        return self.attempt.result() if self.attempt else ParsedOutput()

    def text(self) -> str:
        """The generated text so far."""
        return self.attempt.text() if self.attempt else ""

    def stop_hit(self) -> str | None:
        """The stop string that ended the answer (None for any other ending)."""
        return self.attempt.stop.hit if self.attempt and self.finish_reason == "stop" else None

    def generated(self) -> list[int]:
        """Generated token ids (EOS excluded)."""
        return list(self.attempt.tokens) if self.attempt else []

    def usage(self) -> Usage:
        """Token counts for the response."""
        reasoning = self.attempt.reasoning_tokens if self.attempt else 0
        return Usage(len(self.request.prompt_tokens), self.cached, len(self.generated()),
                     reasoning)

    def first_token_at(self) -> float | None:
        """Scheduler-clock time of the first emitted token."""
        return self.token_times[0] if self.token_times else None

    # -- plumbing ------------------------------------------------------------------------

    def _new_attempt(self, rng: np.random.Generator, greedy: bool) -> DecodeAttempt:
        room = self.slot.session.ctx_size - len(self.request.prompt_tokens)
        cap = max(0, min(self.request.max_tokens, room))
        return DecodeAttempt(self.request, self.tokenizer, rng, cap, greedy=greedy,
                             id_seed=self.id_seed, speculator=self.speculator)

    def _emit_all(self, events: list[TokenEvents]) -> None:
        for event in events:
            self._emit(event)

    def _emit(self, event: JobEvent) -> None:
        if isinstance(event, TokenEvents):
            self.announced.update(e.index for e in event.events if isinstance(e, ToolCallStart))
            if event.token_id != EOS_ID:
                self._time_token()
        self.sink(event)

    def _time_token(self) -> None:
        now = self.clock()
        if self.token_times:
            self.stats.observe_gap(now - self.token_times[-1])
        else:
            self.stats.observe_ttft(now - self.arrived)
        self.token_times.append(now)
        self.stats.generated_tokens += 1


@dataclass
class Timeslice:
    """What a job needs from the scheduler while on a slot (docs/ARCHITECTURE.md, The scheduler)."""

    prefill_s: float
    decode_tokens: int
    others_waiting: Callable[[], bool]
