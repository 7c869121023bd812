"""The job machine as data: one table of states and transitions (docs/ARCHITECTURE.md).

Each scheduler turn fires exactly one trigger of a job. A trigger that can end in several
states lists one row per destination; the first row whose conditions hold wins. The phase's
work runs in the `prepare` callback of the trigger's FIRST row only, before any condition is
checked, so the conditions see its outcome. Names in the rows are methods of `Job`.
"""

from __future__ import annotations

from typing import Any

from transitions import Machine

INITIAL = "queued"
TERMINAL = ("done", "failed", "cancelled")
LIVE = ("queued", "prefilling", "prefilled", "decoding", "decoded")

STATES: list[dict[str, Any]] = [
    {"name": "queued"},
    {"name": "prefilling"},
    {"name": "prefilled"},
    {"name": "decoding"},
    {"name": "decoded"},
    {"name": "done", "on_enter": "report_finished", "final": True},
    {"name": "failed", "on_enter": "report_failed", "final": True},
    {"name": "cancelled", "on_enter": "report_cancelled", "final": True},
]

TRANSITIONS: list[dict[str, Any]] = [
    # begin: the slot's session keeps what it can reuse of the prompt; Started is reported.
    {"trigger": "begin", "source": "queued", "dest": "prefilling", "prepare": "begin_work"},
    # prefill: ONE slice of chunks; it may stop early when another job waits.
    {"trigger": "prefill", "source": "prefilling", "dest": "prefilled",
     "prepare": "prefill_slice", "conditions": "prompt_done"},
    {"trigger": "prefill", "source": "prefilling", "dest": "prefilling"},
    # start_decode: parser, rng and counters of one decode attempt.
    {"trigger": "start_decode", "source": "prefilled", "dest": "decoding",
     "prepare": "start_decode_work"},
    # decode_round: ONE burst of up to decode_tokens tokens.
    {"trigger": "decode_round", "source": "decoding", "dest": "decoded",
     "prepare": "decode_burst", "conditions": "decode_over"},
    {"trigger": "decode_round", "source": "decoding", "dest": "decoding"},
    # redecode: tool-call recovery truncates to the last valid DSML offset and decodes again.
    {"trigger": "redecode", "source": "decoded", "dest": "decoding",
     "conditions": "needs_redecode", "after": "redecode_work"},
    # finish: a DSML block still open after recovery fails the turn (docs/PROTOCOLS.md).
    {"trigger": "finish", "source": "decoded", "dest": "failed",
     "prepare": "finish_work", "conditions": "unterminated"},
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


def attach_machine(model: object) -> Machine:
    """Give `model` the job machine (state attribute `state`, one method per trigger)."""
    return Machine(
        model=model,
        states=STATES,
        transitions=TRANSITIONS,
        initial=INITIAL,
        auto_transitions=False,
        queued=False,
    )
