"""Exact replay of sampled DSML by tool-call id (spec encoding §6.1)."""

from __future__ import annotations

import threading
from collections import OrderedDict

Turn = tuple[str, frozenset, str]  # raw block, the turn's call ids, the turn's reasoning


class ToolMemory:
    """Bounded LRU map tool-call id → the raw DSML block the model sampled for its turn.

    With replay_reasoning (the spec's proposed extension) a calls turn whose reasoning the
    client did not send back renders the stored reasoning instead of an empty one.
    """

    def __init__(self, max_ids: int = 100000, replay_reasoning: bool = False):
        self.max_ids = max_ids
        self.replay_reasoning = replay_reasoning
        self._blocks: OrderedDict[str, Turn] = OrderedDict()
        self._lock = threading.Lock()  # server threads render while the worker remembers

    def __len__(self) -> int:
        return len(self._blocks)

    def remember(self, ids: list[str], raw_block: str, reasoning: str = "") -> None:
        """Store one turn's block under every call id of the turn, evicting the oldest ids."""
        if self.max_ids <= 0 or not raw_block:
            return
        turn = (raw_block, frozenset(ids), reasoning)
        with self._lock:
            for call_id in ids:
                self._blocks[call_id] = turn
                self._blocks.move_to_end(call_id)
            while len(self._blocks) > self.max_ids:
                self._blocks.popitem(last=False)

    def _turn(self, call_id: str) -> Turn | None:
        with self._lock:
            turn = self._blocks.get(call_id)
            if turn is not None:
                self._blocks.move_to_end(call_id)
            return turn

    def lookup(self, call_id: str) -> str | None:
        """The block stored for an id, or None (refreshes the id's recency)."""
        turn = self._turn(call_id)
        return turn[0] if turn else None

    def _turn_for(self, ids: list[str]) -> Turn | None:
        """The stored turn whose calls are exactly these ids."""
        turns = {self._turn(i) for i in ids} if ids else {None}
        if len(turns) != 1 or None in turns:
            return None
        turn = turns.pop()
        return turn if turn[1] == frozenset(ids) and len(ids) == len(turn[1]) else None

    def block_for(self, ids: list[str]) -> str | None:
        """The block to replay for a turn whose calls are exactly one stored turn's calls."""
        turn = self._turn_for(ids)
        return turn[0] if turn else None

    def reasoning_for(self, ids: list[str]) -> str | None:
        """The stored reasoning of that turn, when reasoning replay is on."""
        turn = self._turn_for(ids) if self.replay_reasoning else None
        return turn[2] if turn else None
