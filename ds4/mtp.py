"""Speculative decoding on one session: MTP drafts, verification, exact rollback
(docs/MODEL.md, MTP block; docs/ARCHITECTURE.md, Speculative decoding).

`Session.draft`, `Session.verify` and `Session.keep_speculated` are these functions. Where the
model decodes through the kernel decoder (the GPU), a verify of `first` + N drafts decodes them
one token at a time through the decode graph, stopping at the first draft that the previous
step's argmax disagrees with: each step is bitwise a plain decoding step, so the output is
plain greedy decoding's exactly (a chunk pass, through other kernels, agrees only to ~1e-3 of
the logits and picks differently at near-ties), and nothing rejected ever enters the state.
Elsewhere (NumPy) it is one forward pass of N + 1 tokens (the prefill path); each row's argmax
is what greedy decoding would choose after it, so the drafts are accepted up to the first one
that differs. When some were rejected the session's fixed-size state arrays and position go
back to their copies from before the pass (compressed rows are append-only, so no other state
moved) and the accepted tokens run again: the state is then exactly that of a session that
decoded only those tokens. The MTP window takes back the rows of rejected drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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
    from ds4.session import Speculated

    session._check_decode(session.engine, first)
    room = max(0, session.ctx_size - len(session.tokens) - 1)
    ids = [int(first)] + [int(d) for d in drafts][:room]
    session._check_vocabulary(ids)
    start, n0 = len(session.tokens), session.state.n
    copies = _copy_state(session, session._verify_arrays)
    session._verify_arrays = copies
    stepwise = session.engine.model.kernel_decoder is not None
    accepted, streams = (_decode_steps if stepwise else _one_pass)(session, ids)
    kept = _draft_rows(session, start)
    speculated = Speculated(start, n0, copies, ids[:accepted], kept, streams)
    if len(session.tokens) > start + accepted:  # the pass ran rejected drafts too
        _rollback(session, speculated, accepted)
    elif kept is not None:  # rows drafted past what was verified go back too
        session.mtp_state.undo(kept, start + accepted)
    session._speculated = speculated
    return ids[:accepted]


def _one_pass(session, ids: list[int]) -> tuple[int, object]:
    """(tokens accepted, final streams [S, hc, D]) of one chunk pass over all of ids."""
    rows, streams = session._run_rows(ids, every_row=True)
    picks = rows[:-1].argmax(axis=-1)  # what greedy decoding takes after each row's token
    accepted = 1
    while accepted < len(ids) and ids[accepted] == int(picks[accepted - 1]):
        accepted += 1
    return accepted, streams


def _decode_steps(session, ids: list[int]) -> tuple[int, list]:
    """(tokens accepted, their final streams) decoding ids one step at a time, up to the
    first draft the previous step's argmax disagrees with."""
    streams: list = []
    for j, token in enumerate(ids):
        session._run([token])
        streams.append(session.mtp_state.hidden if session.mtp_state is not None else None)
        if j + 1 < len(ids) and int(np.argmax(session.logits)) != ids[j + 1]:
            break
    return len(streams), streams


def _replay(session, tokens: list[int]) -> None:
    """Run tokens again the way verify ran them (one step at a time through the decode graph,
    else as one chunk)."""
    if session.engine.model.kernel_decoder is None:
        session._run(tokens)
        return
    for token in tokens:
        session._run([token])


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
    """Back to the state before the verify, then the first `keep` of its tokens again (the
    next draft then starts from the verify's streams of the last one)."""
    for name, arr in session.state.frontier_arrays().items():
        arr[...] = spec.arrays[name]
    session.state.n = spec.n
    del session.tokens[spec.start:]
    _replay(session, spec.tokens[:keep])
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

