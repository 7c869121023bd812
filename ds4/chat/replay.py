"""Exact replay of sampled DSML by tool-call id (docs/PROTOCOLS.md, Exact replay)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

MAX_BYTES = 512 * 2**20  # LRU-bounded by ids and by 512 MiB


@dataclass(eq=False)
class StoredTurn:
    """One tool-call turn's sampled block, shared by all of its call ids."""

    raw_block: str
    ids: frozenset[str]
    reasoning: str
    size: int  # UTF-8 bytes of block and reasoning
    refs: int = 0  # ids that still point here; the bytes are freed with the last one


class ToolMemory:
    """Bounded LRU map tool-call id → the raw DSML block the model sampled for its turn.

    With replay_reasoning (off in the server) a calls turn whose reasoning the
    client did not send back renders the stored reasoning instead of an empty one.
    """

    def __init__(self, max_ids: int = 100000, replay_reasoning: bool = False,
                 max_bytes: int = MAX_BYTES):
        self.max_ids = max_ids
        self.max_bytes = max_bytes
        self.replay_reasoning = replay_reasoning
        self.held_bytes = 0
        self._blocks: OrderedDict[str, StoredTurn] = OrderedDict()
        self._lock = threading.Lock()  # server threads render while the worker remembers

    def __len__(self) -> int:
        return len(self._blocks)

    def remember(self, ids: list[str], raw_block: str, reasoning: str = "") -> None:
        """Store one turn's block under every call id of the turn, evicting the oldest ids."""
        size = len(raw_block.encode("utf-8", "surrogatepass"))
        size += len(reasoning.encode("utf-8", "surrogatepass"))
        if self.max_ids <= 0 or not ids or not raw_block or size > self.max_bytes:
            return
        ids = list(dict.fromkeys(ids))  # a repeated id must not count the turn twice
        turn = StoredTurn(raw_block, frozenset(ids), reasoning, size)
        with self._lock:
            for call_id in ids:
                self._forget(call_id)
                self._blocks[call_id] = turn
                turn.refs += 1
            self.held_bytes += size
            while len(self._blocks) > self.max_ids or self.held_bytes > self.max_bytes:
                self._forget(next(iter(self._blocks)))

    def _forget(self, call_id: str) -> None:
        """Drop one id (lock held); its turn's bytes go when no id points there any more."""
        turn = self._blocks.pop(call_id, None)
        if turn is not None:
            turn.refs -= 1
            if turn.refs == 0:
                self.held_bytes -= turn.size

    def _turn(self, call_id: str) -> StoredTurn | None:
        with self._lock:
            turn = self._blocks.get(call_id)
            if turn is not None:
                self._blocks.move_to_end(call_id)
            return turn

    def lookup(self, call_id: str) -> str | None:
        """The block stored for an id, or None (refreshes the id's recency)."""
        turn = self._turn(call_id)
        return turn.raw_block if turn else None

    def _turn_for(self, ids: list[str]) -> StoredTurn | None:
        """The stored turn whose calls are exactly these ids."""
        turns = {self._turn(i) for i in ids} if ids else {None}
        if len(turns) != 1 or None in turns:
            return None
        turn = turns.pop()
        return turn if turn.ids == frozenset(ids) and len(ids) == len(turn.ids) else None

    def block_for(self, ids: list[str]) -> str | None:
        """The block to replay for a turn whose calls are exactly one stored turn's calls."""
        turn = self._turn_for(ids)
        return turn.raw_block if turn else None

    def reasoning_for(self, ids: list[str]) -> str | None:
        """The stored reasoning of that turn, when reasoning replay is on."""
        turn = self._turn_for(ids) if self.replay_reasoning else None
        return turn.reasoning if turn else None
