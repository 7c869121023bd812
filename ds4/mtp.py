"""Speculative decoding on one session: MTP drafts, verification, exact rollback
(docs/MODEL.md, MTP block; docs/ARCHITECTURE.md, Speculative decoding).

`Session.draft`, `Session.verify` and `Session.keep_speculated` are these functions. A verify
of `first` + N drafts runs all N + 1 tokens at once; each row's argmax is what greedy decoding
would choose after it, so the drafts are accepted up to the first one that differs.

- Where the model decodes through the kernel decoder (the GPU), the pass is one replay of the
  decode graph of N + 1 members that are the session's next positions (KernelDecoder.verify):
  the weights are read once for all of them, and every row is bitwise a plain decoding step,
  so the output is plain greedy decoding's exactly (a chunk pass, through other kernels, agrees
  only to ~1e-3 of the logits and picks differently at near-ties). Rejected tokens are undone
  by restoring only the state slots they wrote from the copies taken before the pass (`_undo`):
  their raw-ring rows and pending rows, and the CSA overlap when one of them closed a window.
  That needs N + 1 at most the smallest compression ratio (the tokens' slots distinct, at most
  one window closed); longer verifies decode one graph step per token, stopping at the first
  rejected draft.
- Elsewhere (NumPy) it is one forward pass of N + 1 tokens (the prefill path). When some were
  rejected the session's fixed-size state arrays and position go back to their copies from
  before the pass (compressed rows are append-only, so no other state moved) and the accepted
  tokens run again.

Either way the state is then exactly that of a session that decoded only the accepted tokens.
The MTP window takes back the rows of rejected drafts.
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
    rows = None
    if _one_replay(session, len(ids)):
        accepted, streams, rows = _graph_pass(session, ids)
    elif session.engine.model.kernel_decoder is not None:
        accepted, streams = _decode_steps(session, ids)
    else:
        accepted, streams = _one_pass(session, ids)
    kept = _draft_rows(session, start)
    speculated = Speculated(start, n0, copies, ids[:accepted], kept, streams, rows)
    if len(session.tokens) > start + accepted:  # the pass ran rejected drafts too
        _rollback(session, speculated, accepted)
    elif kept is not None:  # rows drafted past what was verified go back too
        session.mtp_state.undo(kept, start + accepted)
    session._speculated = speculated
    return ids[:accepted]


def _one_replay(session, count: int) -> bool:
    """Whether a verify of `count` tokens is one decode-graph replay: the model decodes through
    the kernel decoder and `_undo` can take back any suffix of them (see the docstring)."""
    from ds4.model.config import SLIDING
    from ds4.model.gpu_decode import VERIFY_SIZE

    if session.engine.model.kernel_decoder is None or count < 2:
        return False
    cfg = session.engine.config
    ratios = [cfg.compress_ratio(i) for i, kind in enumerate(cfg.layer_types) if kind != SLIDING]
    return count <= min([VERIFY_SIZE, cfg.sliding_window] + ratios)


def _graph_pass(session, ids: list[int]) -> tuple[int, list, object]:
    """(tokens accepted, their final streams, device logits [S, V] of every token) of one
    decode-graph replay over all of ids; only the picks and the held row come to the host."""
    graph, backend = session.engine.model.kernel_decoder, session.engine.backend
    try:
        logits = graph.verify(session.state, ids)
        picks = backend.to_numpy(backend.xp.argmax(logits[:-1], axis=-1))
    except BaseException:
        session._rewind_after_failure()
        raise
    accepted = 1
    while accepted < len(ids) and ids[accepted] == int(picks[accepted - 1]):
        accepted += 1
    session._took(ids, None, logits[-1])  # (a rollback's undo then holds row accepted - 1)
    streams = [graph.last_streams(j) for j in range(accepted)]  # what a rollback can keep
    if session.mtp_state is not None:
        session.mtp_state.hidden, session.mtp_state.hidden_at = streams[-1], len(session.tokens)
    return accepted, streams, logits


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
    if spec.rows is not None:
        _undo(session, spec, keep)
    else:
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


def _undo(session, spec, keep: int) -> None:
    """Take back the tokens of a one-replay verify after its first `keep`: the ring rows and
    pending rows they wrote, and the overlaps when one of them closed a window, come back from
    the copies taken before it (what a session that never ran them holds there)."""
    state, copies = session.state, spec.arrays
    gone = range(spec.n + keep, spec.n + len(session.tokens) - spec.start)
    for i, layer in enumerate(state.layers):
        _restore_rows(layer.raw, copies[f"{i}.raw"], gone)
        for cname, comp in layer.compressors().items():
            closed = comp.overlap and any((p + 1) % comp.ratio == 0 for p in gone)
            for name, arr in comp.small_arrays().items():
                copy = copies[f"{i}.{cname}.{name}"]
                if name.startswith("pending"):
                    _restore_rows(arr, copy, gone)
                elif closed:  # a rejected token closed a window: the overlap it moved
                    arr[...] = copy
    state.n = spec.n + keep
    del session.tokens[spec.start + keep:]
    session._took([], None, spec.rows[keep - 1])


def _restore_rows(arr, copy, positions) -> None:
    """arr's rows of these positions (row p % len(arr)) from copy."""
    n = arr.shape[0]
    for p in positions:
        r = p % n
        arr[r:r + 1] = copy[r:r + 1]


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

