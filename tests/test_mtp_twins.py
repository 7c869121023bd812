"""The MTP block's kernel draft step (ds4/model/gpu_mtp.py), run through the kernels' NumPy
twins on the CPU, equals the block's eager model code: logits and output streams over chained
draft positions, after rejected drafts are put back, and with two sessions interleaved on one
decoder. tests/test_mtp_graph_gpu.py checks the captured graph itself on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from test_gpu_decode_twins import decoder_twins

from ds4.engine import Engine, default_model_dir
from ds4.kernels import mtp as mtp_kernels
from ds4.kernels import norm, rope
from ds4.model import gpu_mtp
from ds4.model.mtp import MtpBlock

TOL = 1e-4  # relative to the largest value: same weights, different summation order
PROMPTS = ["Tell me a story about a fox.", "2 + 2 ="]


@pytest.fixture
def twins(monkeypatch):
    """The decoder's twins, and those of the kernels only the draft step calls."""
    decoder_twins(monkeypatch, (norm, rope, mtp_kernels))


@pytest.fixture(scope="module")
def engine():
    return Engine.open(default_model_dir(), backend="numpy", mtp=True)


@pytest.fixture(scope="module")
def packed_engine(tmp_path_factory):
    from ds4.model.official_format import write_official

    path = write_official(default_model_dir(), tmp_path_factory.mktemp("mtp") / "packed")
    return Engine.open(path, backend="numpy", mtp=True)  # quantized: the FP8 KV rounding too


def kernel_block(engine) -> MtpBlock:
    """A second block over the same weights whose steps run through the kernels' twins."""
    block = MtpBlock(engine.model, engine.mtp.w)
    block.eager = False
    return block


def session(engine, text: str):
    s = engine.new_session(256)
    s.sync(engine.tokenizer.encode(text))
    return s


def host(a) -> np.ndarray:
    """A copy of a NumPy or CuPy array on the host."""
    return a.get() if hasattr(a, "get") else np.array(a)


def copy_state(engine, state):
    other = engine.mtp.new_state()
    other.load(state.export(host))
    return other


def close(got, want, tol: float = TOL) -> None:
    want = host(want)
    np.testing.assert_allclose(host(got), want, rtol=tol, atol=tol * np.abs(want).max())


def chain(block, state, hidden, token: int, start: int, count: int, tokens=None) -> list:
    """(logits, streams) of `count` chained drafts from position `start`: greedy tokens, or
    the given `tokens` after the first."""
    out = []
    for j, position in enumerate(range(start, start + count)):
        logits, hidden = block.step(state, hidden, token, position)
        out.append((host(logits), host(hidden)))
        token = int(np.argmax(out[-1][0])) if tokens is None else tokens[j]
    return out


def greedy_tokens(drafts: list) -> list[int]:
    """The tokens a chain of drafts fed itself after its first."""
    return [int(np.argmax(logits)) for logits, _ in drafts]


def assert_same_drafts(got: list, want: list, tol: float = TOL) -> None:
    """Logits and streams within tol of the largest value; the same argmax wherever the
    reference's top two logits are further apart than that."""
    for (gl, gx), (wl, wx) in zip(got, want):
        close(gl, wl, tol)
        close(gx, wx, tol)
        top2 = np.sort(wl)[-2:]
        if top2[1] - top2[0] > 4 * tol * np.abs(wl).max():
            assert int(np.argmax(gl)) == int(np.argmax(wl))


def assert_same_window(a, b, tol: float = TOL) -> None:
    np.testing.assert_array_equal(a.positions, b.positions)
    held = a.positions >= 0
    close(host(a.raw)[held], host(b.raw)[held], tol)


@pytest.mark.parametrize("which", ["tiny", "packed"])
def test_kernel_drafts_equal_the_eager_block(twins, engine, packed_engine, which):
    e = engine if which == "tiny" else packed_engine
    s = session(e, PROMPTS[0])
    ref, mine = s.mtp_state, copy_state(e, s.mtp_state)
    start = len(s.tokens)
    want = chain(e.mtp, ref, ref.hidden, 42, start, 5)
    got = chain(kernel_block(e), mine, mine.hidden, 42, start, 5)
    assert_same_drafts(got, want)
    assert_same_window(mine, ref)
    assert list(np.flatnonzero(mine.positions >= 0)) == [p % len(mine.positions)
                                                          for p in range(start, start + 5)]


def test_kernel_drafts_after_rejected_ones_are_put_back(twins, engine):
    """Draft 4, put back all but the first (as a verify rejecting the second does), draft on
    from there with another token; then draft over positions whose rows are still held."""
    s = session(engine, PROMPTS[0])
    states = {"eager": s.mtp_state, "kernels": copy_state(engine, s.mtp_state)}
    blocks = {"eager": engine.mtp, "kernels": kernel_block(engine)}
    start, out = len(s.tokens), {}
    for name, state in states.items():
        kept = state.keep(list(range(start, start + 4)))
        first = chain(blocks[name], state, state.hidden, 42, start, 4)
        state.undo(kept, start + 1)
        again = chain(blocks[name], state, first[0][1], 7, start + 1, 3)
        stale = chain(blocks[name], state, first[1][1], 9, start + 2, 2)  # rows of start + 2..
        out[name] = first + again + stale
    assert_same_drafts(out["kernels"], out["eager"])
    assert_same_window(states["kernels"], states["eager"])


def test_two_interleaved_sessions_see_only_their_own_window(twins, engine):
    a, b = session(engine, PROMPTS[0]), session(engine, PROMPTS[1])
    block = kernel_block(engine)
    want = {id(s): chain(engine.mtp, copy_state(engine, s.mtp_state), s.mtp_state.hidden, 5,
                         len(s.tokens), 4) for s in (a, b)}
    got: dict = {id(a): [], id(b): []}
    tokens, hidden = {id(a): 5, id(b): 5}, {id(a): a.mtp_state.hidden, id(b): b.mtp_state.hidden}
    for j in range(4):
        for s in (a, b):
            logits, hidden[id(s)] = block.step(s.mtp_state, hidden[id(s)], tokens[id(s)],
                                               len(s.tokens) + j)
            got[id(s)].append((np.array(logits), np.array(hidden[id(s)])))
            tokens[id(s)] = int(np.argmax(logits))
    for s in (a, b):
        assert_same_drafts(got[id(s)], want[id(s)])


def test_the_block_steps_eagerly_where_the_kernels_do_not_run(engine, monkeypatch):
    assert engine.mtp.eager  # NumPy: the main decode has no kernel decoder either
    assert "kernels" in gpu_mtp.supported(engine.model, engine.mtp.w)
    monkeypatch.setattr(engine.model, "kernel_decoder", object())
    assert gpu_mtp.supported(engine.model, engine.mtp.w) is None
    assert not MtpBlock(engine.model, engine.mtp.w).eager
    monkeypatch.setenv("DS4_MTP_EAGER", "1")
    assert MtpBlock(engine.model, engine.mtp.w).eager


def test_masked_window_attention_twin_reads_only_held_rows():
    """The twin of the window kernel: rows of slots holding no visible position are ignored."""
    rng = np.random.default_rng(3)
    cap, heads, width = 8, 2, 16
    table = gpu_mtp.WindowTable(np, cap)
    state = type("S", (), {})()
    state.raw = rng.standard_normal((cap, width)).astype(np.float32)
    state.positions = np.array([8, 1, 10, -1, 4, 13, 6, 7])  # at t = 13: 6..13 visible
    q = rng.standard_normal((heads, width)).astype(np.float32)
    kv = rng.standard_normal((1, width)).astype(np.float32)
    sinks = np.zeros(heads, np.float32)
    table.fill(state, 0, 13)
    out = mtp_kernels.window_attention_numpy(q, kv, table, sinks, np.empty_like(q))
    keys = np.concatenate([state.raw[[0, 2, 5, 6, 7]], kv])
    logits = q @ keys.T / np.sqrt(width)
    p = np.exp(logits)
    np.testing.assert_allclose(out, p @ keys / (p.sum(axis=1) + 1)[:, None], rtol=1e-5)


def test_the_graph_pick_equals_the_host_reduction(twins, engine):
    """A kernel step's own pick (what a draft reads back instead of its logits) is the argmax
    and margin ds4/mtp.py's top_gap takes; other logits get no pick."""
    from ds4.mtp import top_gap

    s = session(engine, PROMPTS[0])
    block = kernel_block(engine)
    logits, _ = block.step(s.mtp_state, s.mtp_state.hidden, 42, len(s.tokens))
    assert block.pick(logits) == top_gap(np, logits)
    assert block.pick(logits.copy()) is None and engine.mtp.pick(logits) is None


@pytest.mark.parametrize("x, want", [([1.0, 5.0, 3.5, -2.0], (1, 1.5)),
                                     ([2.0, 7.0, 7.0, 1.0], (1, 0.0)),
                                     ([-3.0], (0, float("inf")))])
def test_top_gap_twin(x, want):
    out = mtp_kernels.top_gap_numpy(np.array(x, np.float32), np.zeros(3, np.int32))
    assert mtp_kernels.read_top_gap(out) == want
