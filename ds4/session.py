"""Session: one context of an Engine (sync, decode, speculation, snapshot/restore) and the
state it keeps beside the model's (the prompt frontier, the last verify)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ds4.model.state import SessionState
from ds4.sampling import is_greedy, sample
from ds4.snapshot import (
    FRONTIER_LOGITS,
    FRONTIER_PREFIX,
    LOGITS,
    SNAPSHOT_VERSION,
    check_compatible,
    pack,
    unpack,
)

if TYPE_CHECKING:
    from ds4.engine import Engine


class ContextOverflow(ValueError):
    """The tokens would not fit in the session's context."""


@dataclass
class Speculated:
    """The last verify of a session: enough to hold fewer of its tokens (`keep_speculated`)."""

    start: int  # tokens held before it
    n: int  # state position before it
    arrays: dict  # the fixed-size state arrays before it (copies)
    tokens: list[int]  # what it appended
    kept: tuple | None  # MtpState.keep of the draft rows (None: no drafts ran)
    streams: object = None  # the pass's final streams [S, hc, D] (the next draft's input)
    rows: object = None  # one-replay verify: the logits [S, V] of every token where they live


@dataclass
class Frontier:
    """The end of the last synced prompt: regenerating it costs no prefill.

    See docs/MODEL.md, Frontier and rollback.

    Compressed rows are append-only, so besides the counters only the fixed-size arrays (raw
    rings, pending rows, overlaps) need copies.
    """

    tokens: list[int]
    logits: np.ndarray | None
    n: int
    arrays: dict  # state.frontier_arrays() name -> a copy


class Session:
    """One context: the tokens held, their state, the last logits, and the last prompt frontier."""

    def __init__(self, engine: Engine, ctx_size: int):
        self.engine = engine
        self.ctx_size = ctx_size
        self.state = SessionState(engine.backend.xp, engine.config, ctx_size)
        self.tokens: list[int] = []
        self._host_logits: np.ndarray | None = None  # copied from the device on first read
        self._device_logits = None  # the same logits where the backend left them (GPU: CuPy)
        self._greedy: int | None = None  # their argmax, when a batched step took it already
        self._frontier: Frontier | None = None
        self.mtp_state = engine.mtp.new_state() if engine.mtp is not None else None
        self._speculated: Speculated | None = None  # the last verify, while it may be trimmed
        self._draft_kept = None  # (position, MtpState.keep) of the last draft
        self._verify_arrays: dict | None = None  # state copies a verify rolls back to

    @property
    def logits(self) -> np.ndarray | None:
        """The last logits (float32 [vocab], read-only) on the host; on the GPU they are copied
        from the device on first read, so a step whose job only samples (on the device) moves
        no vocabulary row."""
        if self._host_logits is None and self._device_logits is not None:
            self._host_logits = host_logits(self.engine.backend, self._device_logits)
        return self._host_logits

    @logits.setter
    def logits(self, value: np.ndarray | None) -> None:
        self._host_logits, self._greedy = value, None

    def reusable_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of token_ids sync would keep without recomputing."""
        ids = list(token_ids)
        if _is_prefix(self.tokens, ids):
            return len(self.tokens)
        if self._frontier is not None and _is_prefix(self._frontier.tokens, ids):
            return len(self._frontier.tokens)
        return 0

    def sync(self, token_ids: Sequence[int], should_stop: Callable[[], bool] | None = None):
        """Hold exactly token_ids; returns logits after the last one, or None if stopped early."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("sync needs at least one token")
        if len(ids) > self.ctx_size:
            raise ContextOverflow(f"prompt of {len(ids)} tokens exceeds the context size "
                                  f"{self.ctx_size}")
        self._check_vocabulary(ids)  # before the rewind: a bad prompt must not cost the held one
        self._rewind_to(self.reusable_prefix(ids))
        chunk, start = self.engine.prefill_chunk, len(self.tokens)
        for begin in range(start, len(ids), chunk):
            if begin > start and should_stop is not None and should_stop():
                return None
            self._run(ids[begin : begin + chunk])
        self._save_frontier()
        return self.logits

    def decode(self, token_id: int) -> np.ndarray:
        """Append one token and return its logits (float32 [vocab])."""
        self._check_decode(self.engine, token_id)
        self._run([int(token_id)])
        return self.logits

    def draft(self, first: int, count: int, margin: float = 0.0) -> list[int]:
        """Up to `count` MTP drafts of the tokens after `first` (the token the held logits
        chose), each the block's argmax; drafting stops at the first whose top-1 logit beats
        the runner-up by less than `margin`. Empty without an MTP block or without the main
        model's streams of the last held token (e.g. after a batched step)."""
        from ds4.mtp import draft

        return draft(self, first, count, margin)

    def verify(self, first: int, drafts: Sequence[int]) -> list[int]:
        """Append `first` and the longest prefix of `drafts` that greedy decoding confirms;
        returns the tokens appended. Verified in one forward pass of 1 + len(drafts) tokens
        (where the model decodes through CUDA graphs, one decode-graph replay whose rows are
        plain decoding steps bitwise). A rejected suffix is rolled back exactly (the state is
        that of never drafting)."""
        from ds4.mtp import verify

        return verify(self, first, drafts)

    def keep_speculated(self, count: int) -> None:
        """Right after `verify`, hold only the first `count` (>= 1) of the tokens it appended
        (their consumer stopped early: a stop string, a forced text)."""
        from ds4.mtp import keep_speculated

        keep_speculated(self, count)

    def sample(self, opts, rng: np.random.Generator) -> int:
        """Next token drawn from the last logits where they live (GPU: only the id comes back)."""
        # the same seed gives the same tokens as ds4.sampling.sample on s.logits
        if self._greedy is not None and is_greedy(opts):
            return self._greedy  # (greedy draws no random number either way)
        logits = self._device_logits if self._device_logits is not None else self.logits
        if logits is None:
            raise ValueError("no logits yet: sync a prompt first")
        return sample(logits, opts, rng)

    def snapshot(self) -> bytes:
        """Exact resumable state as bytes (tokens, logits, every live state row)."""
        arrays = self.state.export(self.engine.backend.to_numpy)
        if self.mtp_state is not None:
            arrays.update(self.mtp_state.export(self.engine.backend.to_numpy))
        meta = {"version": SNAPSHOT_VERSION, "fingerprint": self.engine.fingerprint(),
                "n": self.state.n,
                "tokens": self.tokens}
        if self._frontier is not None:  # so a restored session can still regenerate for free
            f = self._frontier
            meta["frontier"] = {"tokens": len(f.tokens), "n": f.n}
            arrays.update({f"{FRONTIER_PREFIX}{k}": self.engine.backend.to_numpy(v)
                           for k, v in f.arrays.items()})
            if f.logits is not None:
                arrays[FRONTIER_LOGITS] = f.logits
        if self.logits is not None:
            arrays[LOGITS] = self.logits
        return pack(meta, arrays)

    def restore(self, blob: bytes) -> Session:
        """Load a snapshot of a compatible engine's session; returns self
        (ValueError if not one)."""
        arrays, meta = unpack(blob)
        check_compatible(meta, self.engine.fingerprint())
        if meta["n"] > self.ctx_size:
            raise ContextOverflow(f"snapshot holds {meta['n']} tokens, more than the context size "
                                  f"{self.ctx_size}")
        try:
            self._load(arrays, meta)
        except KeyError as missing:
            self._reset()  # part of the state was overwritten already
            raise ValueError(f"session snapshot lacks array {missing}") from None
        return self

    def _load(self, arrays: dict, meta: dict) -> None:
        self.state.load(arrays, meta["n"])
        self.tokens = list(meta["tokens"])
        self._speculated = None
        if self.mtp_state is not None:
            self.mtp_state.load(arrays)
        self.logits, self._device_logits = _read_only(arrays.get(LOGITS)), None
        self._save_frontier()
        if "frontier" in meta:
            f = meta["frontier"]
            copies = self._frontier.arrays
            for name in copies:
                copies[name][...] = self.engine.backend.asarray(arrays[FRONTIER_PREFIX + name])
            self._frontier = Frontier(self.tokens[: f["tokens"]],
                                      _read_only(arrays.get(FRONTIER_LOGITS)),
                                      f["n"], copies)

    # ---- internals

    def _check_vocabulary(self, ids: list[int]) -> None:
        vocab = self.engine.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise ValueError(f"token id {bad} is outside the model's vocabulary (0..{vocab - 1})")

    def _check_decode(self, engine: Engine, token_id: int) -> None:
        """Raise unless one more token `token_id` fits this session of `engine`."""
        if engine is not self.engine:
            raise ValueError("the session belongs to another engine")
        if len(self.tokens) + 1 > self.ctx_size:
            raise ContextOverflow(f"context is full ({self.ctx_size} tokens); cannot decode more")
        self._check_vocabulary([int(token_id)])

    def _run(self, ids: list[int]) -> None:
        self._speculated = None
        model = self.engine.model
        if self.mtp_state is not None and (len(ids) > 1 or model.kernel_decoder is None):
            self._run_rows(ids)  # keeps the streams the next draft starts from
            return
        try:
            logits = model.forward(self.state, ids)
        except BaseException:
            self._rewind_after_failure()
            raise
        self._took(ids, None, logits)
        if self.mtp_state is not None:  # the decode graph's streams: the next draft's input
            self.mtp_state.hidden = model.kernel_decoder.last_streams()
            self.mtp_state.hidden_at = len(self.tokens)

    def _run_rows(self, ids: list[int], every_row: bool = False):
        """`_run` through the model code, noting the last token's final streams for the MTP;
        returns (logits of every token (host, [S, V]) when every_row, final streams)."""
        try:
            logits, X = self.engine.model.forward_rows(self.state, ids, every_row)
            host = np.asarray(self.engine.backend.to_numpy(logits), dtype=np.float32)
        except BaseException:
            self._rewind_after_failure()
            raise
        self._took(ids, host[-1].copy(), logits[-1])
        if self.mtp_state is not None:
            self.mtp_state.hidden, self.mtp_state.hidden_at = X[-1], len(self.tokens)
        return host, X

    def _took(self, ids: list[int], host: np.ndarray | None, device_logits,
              greedy: int | None = None) -> None:
        """The state now covers `ids` too; its logits are `device_logits` where the backend
        left them (the GPU: copied to the host on first read) and `host` there when already
        copied (None on NumPy: a copy of them now); `greedy` their argmax when taken."""
        self.tokens.extend(ids)
        gpu = self.engine.backend.is_gpu
        if host is None and not gpu and device_logits is not None:
            host = np.array(device_logits, dtype=np.float32)
        self.logits = _read_only(host)
        self._device_logits = device_logits if gpu else None
        self._greedy = greedy

    def _rewind_after_failure(self) -> None:
        # earlier layers may have written rows and moved pending/overlap state: fall back
        # to a point whose state is whole (the frontier's rows lie below this step's)
        self._rewind_to(len(self._frontier.tokens) if self._frontier is not None else 0, force=True)

    def _rewind_to(self, keep: int, force: bool = False) -> None:
        """Make the held state cover exactly the first `keep` tokens it can reuse (force: even
        when that is every held token, because the arrays no longer match them)."""
        if keep == len(self.tokens) and not force:
            return
        self._speculated = None
        if self.mtp_state is not None:
            self.mtp_state.forget_from(keep)
        if self._frontier is not None and keep == len(self._frontier.tokens) and keep > 0:
            self._restore_frontier()
        else:
            self._reset()

    def _restore_frontier(self) -> None:
        f = self._frontier
        for name, arr in self.state.frontier_arrays().items():
            arr[...] = f.arrays[name]
        self.state.n = f.n
        self.tokens, self.logits, self._device_logits = list(f.tokens), f.logits, None

    def _reset(self) -> None:
        self.state.reset()
        if self.mtp_state is not None:
            self.mtp_state.reset()
        self.tokens, self.logits, self._device_logits = [], None, None
        self._frontier = None  # its compressed rows are about to be overwritten

    def _save_frontier(self) -> None:
        """Remember this point (the end of a synced prompt) so a retry can roll back to it."""
        current = self.state.frontier_arrays()
        copies = (self._frontier.arrays if self._frontier is not None
                  else {k: v.copy() for k, v in current.items()})
        for name, arr in current.items():
            copies[name][...] = arr
        self._frontier = Frontier(list(self.tokens), self.logits, self.state.n, copies)


def host_logits(backend, device_logits) -> np.ndarray:
    """Logits from where the backend left them, as the read-only float32 host array a
    session holds."""
    return _read_only(np.asarray(backend.to_numpy(device_logits), dtype=np.float32))


def _read_only(logits: np.ndarray | None) -> np.ndarray | None:
    """Logits a caller gets are the ones the frontier keeps for a regenerate: no writing."""
    if logits is not None:
        logits.flags.writeable = False
    return logits


def _is_prefix(held: list[int], ids: list[int]) -> bool:
    return len(held) <= len(ids) and ids[: len(held)] == held
