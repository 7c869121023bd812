"""Lock-step decode turns: every decoding job advances one burst, one engine step per token.

Each token of the burst, every job still decoding chooses its next token from its own logits
with its own sampling settings (through a `DeferredDecode` stand-in for its session); then one
`Engine.decode_batch` call evaluates all those tokens at once. After the burst each job fires its
own `decode_round` transition, so the job machine is the same as for a turn of one job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ds4.jobs.events import SamplingOptions
from ds4.jobs.slot import Slot

if TYPE_CHECKING:
    from ds4.engine import Engine, Session
    from ds4.jobs.job import Job

log = logging.getLogger("ds4.jobs")


class LockStepDecode:
    """Runs the decoding jobs' bursts in lock-step; records the size of each engine step."""

    def __init__(self, engine: Engine, burst: int):
        self.engine = engine
        self.burst = burst
        self.observers: list[Callable[[int], None]] = []  # called with each step's batch size

    def members(self, slots: list[Slot], picked: Slot) -> list[Slot]:
        """The slots that decode together when `picked` has its turn (empty: not a decode)."""
        if not decoding(picked):
            return []
        return [s for s in slots if decoding(s)]

    def run(self, slots: list[Slot]) -> dict[Job, Exception]:
        """One burst for the slots' jobs; the jobs that failed on the way, with why."""
        failed: dict[Job, Exception] = {}
        live = list(slots)
        for _ in range(self.burst):
            stepping = self._choose(live, failed)
            live = [s for s in live if s.job not in failed and not s.job.attempt.over
                    and not s.job.cancel_requested.is_set()]
            if not stepping:
                break
            self._evaluate(stepping, failed)
        return failed

    def single(self, slot: Slot, advance: Callable[[Slot], None]) -> None:
        """A turn of one job (`advance`); its decode burst counts as steps of one session."""
        if not decoding(slot):
            advance(slot)
            return
        session, before = slot.session, len(slot.session.tokens)
        advance(slot)
        for _ in range(max(0, len(session.tokens) - before)):
            self.observe(1, (slot.index,), [slot])

    def observe(self, size: int, peers: tuple[int, ...], slots: list[Slot]) -> None:
        """Count an engine decode step of `size` sessions; the slots remember who shared it."""
        for slot in slots:
            slot.decode_peers = peers
        for observe in self.observers:
            observe(size)

    def _choose(self, live: list[Slot], failed: dict) -> list[tuple[Slot, int]]:
        """Each live job takes its next token; those that are evaluated, with the token."""
        stepping = []
        for slot in live:
            deferred = DeferredDecode(slot.session)
            try:
                took = slot.job.burst_token(deferred)
            except Exception as exc:  # this job only: the others go on
                log.exception("job %d failed on slot %d", slot.job.seq, slot.index)
                failed[slot.job] = exc
                continue
            if took and deferred.token is not None:
                stepping.append((slot, deferred.token))
        return stepping

    def _evaluate(self, stepping: list[tuple[Slot, int]], failed: dict) -> None:
        """One engine step for the chosen tokens; a failure fails the jobs that were in it."""
        slots = [slot for slot, _ in stepping]
        try:
            self._decode([s.session for s in slots], [t for _, t in stepping])
        except Exception as exc:
            log.exception("a batched decode step of slots %s failed", [s.index for s in slots])
            failed.update((s.job, exc) for s in slots)
            return
        self.observe(len(slots), tuple(s.index for s in slots), slots)


    def _decode(self, sessions: list, tokens: list[int]) -> None:
        """The batched engine step; one session after another for an engine without one."""
        batched = getattr(self.engine, "decode_batch", None)
        if batched is not None:
            batched(sessions, tokens)
            return
        for session, token in zip(sessions, tokens):
            session.decode(token)


class DeferredDecode:
    """A job's session for one lock-step token: sampling reads the session's own logits; the
    token the job decodes is only noted, for the batched engine step that follows."""

    def __init__(self, session: Session):
        self.session = session
        self.token: int | None = None

    def sample(self, opts: SamplingOptions, rng: np.random.Generator) -> int:
        """The job's next token, drawn from its session's last logits."""
        return self.session.sample(opts, rng)

    def decode(self, token_id: int) -> None:
        """Note the token; its logits come from the batched step."""
        self.token = int(token_id)


def decoding(slot: Slot) -> bool:
    """True when the slot's job decodes and did not ask to stop."""
    job = slot.job
    return job is not None and job.state == "decoding" and not job.cancel_requested.is_set()


class BatchRotation:
    """Round-robin over busy slots where one lock-step decode is one turn: after it, the next
    turn goes to a busy slot outside that batch (a prefilling newcomer) when there is one."""

    def __init__(self) -> None:
        self._last = -1
        self._batched: frozenset[int] = frozenset()

    def next(self, slots: list[Slot]) -> Slot | None:
        """The busy slot whose turn it is, or None when all are idle."""
        for skip in (self._batched, frozenset()):
            n = len(slots)
            for k in range(1, n + 1):
                slot = slots[(self._last + k) % n]
                if slot.busy and slot.index not in skip:
                    self._last, self._batched = slot.index, frozenset()
                    return slot
        return None

    def ran_batch(self, slots: list[Slot]) -> None:
        """The slots just advanced together: they had this round's turn."""
        self._batched = frozenset(s.index for s in slots)
