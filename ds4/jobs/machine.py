"""The job machine as data: one table of states and transitions (docs/ARCHITECTURE.md).

Each scheduler turn fires exactly one trigger of a job. A trigger that can end in several
states lists one row per destination; the first row whose conditions hold wins. The phase's
work runs in the `prepare` callback of the trigger's FIRST row only, before any condition is
checked, so the conditions see its outcome. The rows hold the callbacks' names (transitions
looks them up on the job, and the diagram prints them), taken from `JobPhases`, the protocol
`Job` implements: an editor jumps from a row to the method's contract.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from transitions import EventData, Machine


class JobPhases(Protocol):
    """The callbacks the table names (ds4/jobs/job.py:Job implements them). transitions calls
    each with the trigger's arguments, none here, so `_event` stays None."""

    def begin_work(self, _event: EventData | None = None) -> None:
        """Phase work of `begin`: what the slot reuses; Started."""

    def prefill_slice(self, _event: EventData | None = None) -> None:
        """Phase work of `prefill`: one slice of prompt chunks."""

    def prompt_done(self, _event: EventData | None = None) -> bool:
        """Condition: the whole prompt is evaluated."""

    def start_decode_work(self, _event: EventData | None = None) -> None:
        """Phase work of `start_decode`: the first decode attempt."""

    def decode_burst(self, _event: EventData | None = None) -> None:
        """Phase work of `decode_round`: one burst of tokens."""

    def decode_over(self, _event: EventData | None = None) -> bool:
        """Condition: the attempt stopped decoding."""

    def needs_redecode(self, _event: EventData | None = None) -> bool:
        """Condition: a failed DSML block may be decoded again."""

    def redecode_work(self, _event: EventData | None = None) -> None:
        """After `redecode`: roll back to the last valid DSML token, decode greedily."""

    def finish_work(self, _event: EventData | None = None) -> None:
        """Phase work of `finish`: settle the finish reason."""

    def unterminated(self, _event: EventData | None = None) -> bool:
        """Condition: a tool-call block never closed (the turn fails)."""

    def report_finished(self, _event: EventData | None = None) -> None:
        """On entering done: Finished to the sink."""

    def report_failed(self, _event: EventData | None = None) -> None:
        """On entering failed: the error to the sink."""

    def report_cancelled(self, _event: EventData | None = None) -> None:
        """On entering cancelled: Finished("cancelled") to the sink."""


def named(callback: Callable[..., object]) -> str:
    """The name a table row holds for `callback` (one of JobPhases' methods)."""
    return callback.__name__


P = JobPhases  # short, so each row of the table stays on one line
INITIAL = "queued"
TERMINAL = ("done", "failed", "cancelled")
LIVE = ("queued", "prefilling", "prefilled", "decoding", "decoded")

STATES: list[dict[str, str | bool]] = [
    {"name": "queued"},
    {"name": "prefilling"},
    {"name": "prefilled"},
    {"name": "decoding"},
    {"name": "decoded"},
    {"name": "done", "on_enter": named(P.report_finished), "final": True},
    {"name": "failed", "on_enter": named(P.report_failed), "final": True},
    {"name": "cancelled", "on_enter": named(P.report_cancelled), "final": True},
]

TRANSITIONS: list[dict[str, str | list[str]]] = [
    # begin: the slot's session keeps what it can reuse of the prompt; Started is reported.
    {"trigger": "begin", "source": "queued", "dest": "prefilling", "prepare": named(P.begin_work)},
    # prefill: ONE slice of chunks; it may stop early when another job waits.
    {"trigger": "prefill", "source": "prefilling", "dest": "prefilled",
     "prepare": named(P.prefill_slice), "conditions": named(P.prompt_done)},
    {"trigger": "prefill", "source": "prefilling", "dest": "prefilling"},
    # start_decode: parser, rng and counters of one decode attempt.
    {"trigger": "start_decode", "source": "prefilled", "dest": "decoding",
     "prepare": named(P.start_decode_work)},
    # decode_round: ONE burst of up to decode_tokens tokens.
    {"trigger": "decode_round", "source": "decoding", "dest": "decoded",
     "prepare": named(P.decode_burst), "conditions": named(P.decode_over)},
    {"trigger": "decode_round", "source": "decoding", "dest": "decoding"},
    # redecode: tool-call recovery truncates to the last valid DSML offset and decodes again.
    {"trigger": "redecode", "source": "decoded", "dest": "decoding",
     "conditions": named(P.needs_redecode), "after": named(P.redecode_work)},
    # finish: a DSML block still open after recovery fails the turn (docs/PROTOCOLS.md).
    {"trigger": "finish", "source": "decoded", "dest": "failed",
     "prepare": named(P.finish_work), "conditions": named(P.unterminated)},
    {"trigger": "finish", "source": "decoded", "dest": "done"},
    {"trigger": "fail", "source": list(LIVE), "dest": "failed"},
    {"trigger": "cancel", "source": list(LIVE), "dest": "cancelled"},
]

# Triggers the scheduler never fires as a turn: they answer errors and cancellation.
OUT_OF_BAND = ("fail", "cancel")


def turn_triggers(state: str) -> list[str]:
    """Triggers a turn may fire from `state`, in table order (first that fires wins)."""
    names: list[str] = []
    for row in TRANSITIONS:
        sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
        if state in sources and row["trigger"] not in OUT_OF_BAND and row["trigger"] not in names:
            names.append(row["trigger"])
    return names


def attach_machine(model: JobPhases) -> Machine:
    """Give `model` the job machine (state attribute `state`, one method per trigger)."""
    return Machine(
        model=model,
        states=STATES,
        transitions=TRANSITIONS,
        initial=INITIAL,
        auto_transitions=False,
        queued=False,
    )
