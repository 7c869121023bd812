"""Speculative decoding on one session: MTP drafts, one-pass verification, exact rollback
(docs/MODEL.md, MTP block; docs/ARCHITECTURE.md, Speculative decoding).

`Session.draft`, `Session.verify` and `Session.keep_speculated` are these functions. A verify
of `first` + N drafts is one forward pass of N + 1 tokens (the prefill path); each row's argmax
is what greedy decoding would choose after it, so the drafts are accepted up to the first one
that differs. When some were rejected the session's fixed-size state arrays and position go
back to their copies from before the pass (compressed rows are append-only, so no other state
moved) and the accepted tokens run again as one chunk: the state is then exactly that of a
session that decoded only those tokens. The MTP window takes back the rows of rejected drafts.
"""

from __future__ import annotations

from collections.abc import Sequence


def draft(session, first: int, count: int, margin: float) -> list[int]:
    """See `Session.draft`."""
    mtp, state = session.engine.mtp, session.mtp_state
    start = len(session.tokens)
    count = min(int(count), session.ctx_size - start - 1)
    if mtp is None or count < 1 or state.hidden is None or state.hidden_at != start:
        session._draft_kept = None
        return []
    session._draft_kept = (start, state.keep(list(range(start, start + count))))
    hidden, token, drafts = state.hidden, int(first), []
    for position in range(start, start + count):
        logits, hidden = mtp.step(state, hidden, token, position)
        token, gap = mtp.pick(logits) or top_gap(session.engine.backend.xp, logits)
        if gap < margin:
            break
        drafts.append(token)
    return drafts


def top_gap(xp, logits) -> tuple[int, float]:
    """(argmax, top-1 logit minus the runner-up's) of logits [V] where they live."""
    top = int(xp.argmax(logits))
    best = float(logits[top])
    rest = xp.where(xp.arange(logits.shape[0]) == top, -xp.inf, logits)
    return top, best - float(rest.max())


def verify(session, first: int, drafts: Sequence[int]) -> list[int]:
    """See `Session.verify`."""
    from ds4.engine import Speculated

    session._check_decode(session.engine, first)
    room = max(0, session.ctx_size - len(session.tokens) - 1)
    ids = [int(first)] + [int(d) for d in drafts][:room]
    session._check_vocabulary(ids)
    start, n0 = len(session.tokens), session.state.n
    copies = _copy_state(session, session._verify_arrays)
    session._verify_arrays = copies
    rows, streams = session._run_rows(ids, every_row=True)
    picks = rows[:-1].argmax(axis=-1)  # what greedy decoding takes after each row's token
    accepted = 1
    while accepted < len(ids) and ids[accepted] == int(picks[accepted - 1]):
        accepted += 1
    kept = _draft_rows(session, start)
    speculated = Speculated(start, n0, copies, ids[:accepted], kept, streams)
    if accepted < len(ids):
        _rollback(session, speculated, accepted)
    elif kept is not None:  # rows drafted past what was verified go back too
        session.mtp_state.undo(kept, start + accepted)
    session._speculated = speculated
    return ids[:accepted]


def keep_speculated(session, count: int) -> None:
    """See `Session.keep_speculated`."""
    spec = session._speculated
    if spec is None or len(session.tokens) != spec.start + len(spec.tokens):
        raise ValueError("keep_speculated must follow a verify of this session")
    if not 1 <= count <= len(spec.tokens):
        raise ValueError(f"keep {count} of the {len(spec.tokens)} verified tokens?")
    if count < len(spec.tokens):
        _rollback(session, spec, count)
        spec.tokens = spec.tokens[:count]
        session._speculated = spec


def _rollback(session, spec, keep: int) -> None:
    """Back to the state before the verify, then the first `keep` of its tokens as one chunk
    (one token: the plain decode step, on the GPU its CUDA graph; the next draft then starts
    from the verify pass's streams of that token)."""
    for name, arr in session.state.frontier_arrays().items():
        arr[...] = spec.arrays[name]
    session.state.n = spec.n
    del session.tokens[spec.start:]
    session._run(spec.tokens[:keep])
    state = session.mtp_state
    if state is not None and state.hidden_at != len(session.tokens):
        state.hidden, state.hidden_at = spec.streams[keep - 1], len(session.tokens)
    if session.mtp_state is not None and spec.kept is not None:
        session.mtp_state.undo(spec.kept, spec.start + keep)


def _draft_rows(session, start: int):
    """The MTP rows the last draft of this position overwrote (None: it drafted nothing)."""
    kept, session._draft_kept = session._draft_kept, None
    if kept is None or kept[0] != start:
        return None
    return kept[1]


def _copy_state(session, into: dict | None) -> dict:
    """The session's fixed-size state arrays copied into `into` (allocated on first use)."""
    current = session.state.frontier_arrays()
    if into is None:
        return {name: arr.copy() for name, arr in current.items()}
    for name, arr in current.items():
        into[name][...] = arr
    return into

