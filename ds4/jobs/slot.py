"""A session lent to one job at a time (docs/ARCHITECTURE.md, Slots and tool-call continuations)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ds4.engine import Session
    from ds4.jobs.job import Job


@dataclass
class Slot:
    """A session the scheduler lends to one job at a time.

    `call_ids` are the tool-call ids of the last turn this slot finished; they stay valid only
    while the session still holds exactly `bound_tokens` tokens (Responses/Anthropic
    continuations append tool results to that frontier: docs/PROTOCOLS.md, Continuations).
    `kv_frontier` is the slot's continued-checkpoint frontier (ds4.jobs.kvstore); the last job's
    reused prefix came from `prefix_source`: "slot" (this session), "disk" or "cold" (none).
    """

    index: int
    session: Session  # only the scheduler thread touches it
    last_used: float = 0.0
    job: Job | None = None  # the Job running here, None when idle
    call_ids: frozenset[str] = field(default_factory=frozenset)
    bound_tokens: int = -1
    kv_frontier: int = 0
    prefix_source: str = "cold"
    prefix_tokens: int = 0
    decode_peers: tuple[int, ...] = ()  # slots that shared this slot's last decode step

    @property
    def busy(self) -> bool:
        """True while a job runs on this slot."""
        return self.job is not None

    @property
    def held_tokens(self) -> int:
        """Tokens the session holds now."""
        return len(self.session.tokens)

    def bind_call_ids(self, ids: list[str]) -> None:
        """Remember the ids of the turn just finished, at the session's current frontier."""
        self.call_ids = frozenset(ids)
        self.bound_tokens = self.held_tokens if ids else -1

    def note_prefix(self, source: str, tokens: int) -> None:
        """Remember where the current job's reused prefix came from (shown by GET /slots)."""
        self.prefix_source = source if tokens else "cold"
        self.prefix_tokens = tokens

    def clear_bindings(self) -> None:
        """Forget protocol state: the timeline moved on or can no longer be trusted."""
        self.call_ids = frozenset()
        self.bound_tokens = -1

    def live_call_ids(self) -> frozenset[str]:
        """Ids a continuation may still append to (empty once the frontier moved)."""
        if self.call_ids and self.bound_tokens == self.held_tokens:
            return self.call_ids
        return frozenset()

    def holds_any(self, ids: list[str]) -> bool:
        """True when one of `ids` is a live call id of this slot."""
        live = self.live_call_ids()
        return any(i in live for i in ids)

    def info(self) -> dict:
        """What GET /slots shows for this slot."""
        return {
            "id": self.index,
            "busy": self.busy,
            "tokens": self.held_tokens,
            "last_used": self.last_used,
            "prefix_source": self.prefix_source,
            "prefix_tokens": self.prefix_tokens,
            "decode_batch": list(self.decode_peers),
        }
