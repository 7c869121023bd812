"""The MTP draft step as one replayed CUDA graph (ds4/model/gpu_mtp.py, GPU only): it runs on
the tiny and a packed model, and its drafts equal the block's eager code on the GPU and on the
NumPy engine, the same kernels run without the graph, after rejected drafts are put back and
with two sessions interleaved."""

from __future__ import annotations

import numpy as np
import pytest
from test_mtp_twins import (
    assert_same_drafts,
    assert_same_window,
    chain,
    copy_state,
    greedy_tokens,
    host,
)

from ds4.backend import cuda_available
from ds4.engine import Engine, default_model_dir
from ds4.model import gpu_mtp
from ds4.model.mtp import MtpBlock

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]

TOL = 1e-3  # relative to the largest value: the row kernels' split-bf16 products vs fp32 GEMMs
TEXT = ["Tell me a story about a fox and the sea.", "2 + 2 ="]
STEPS = 6  # the first step runs eagerly (compiles the kernels), the second captures the graph


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from ds4.model.official_format import write_official

    packed = write_official(default_model_dir(), tmp_path_factory.mktemp("mtp") / "packed")
    return {"tiny": Engine.open(default_model_dir(), backend="cupy", mtp=True),
            "packed": Engine.open(packed, backend="cupy", mtp=True),
            "numpy": Engine.open(default_model_dir(), backend="numpy", mtp=True)}


def block(engine, eager: bool, graph: bool = True) -> MtpBlock:
    """Another block over the engine's MTP weights: eager code, or the kernels (graph or not)."""
    b = MtpBlock(engine.model, engine.mtp.w)
    b.eager = eager
    if not eager:
        b.kernels.use_graph = graph
    return b


def session(engine, text: str = TEXT[0]):
    s = engine.new_session(256)
    s.sync(engine.tokenizer.encode(text))
    return s


@pytest.mark.parametrize("which", ["tiny", "packed"])
def test_the_engine_drafts_through_a_replayed_graph(engines, which):
    e = engines[which]
    assert gpu_mtp.supported(e.model, e.mtp.w) is None
    assert not e.mtp.eager
    s = session(e)
    want = chain(block(e, eager=True), copy_state(e, s.mtp_state), s.mtp_state.hidden, 42,
                 len(s.tokens), STEPS)
    got = chain(e.mtp, s.mtp_state, s.mtp_state.hidden, 42, len(s.tokens), STEPS,
                greedy_tokens(want))
    assert e.mtp.kernels.graph is not None  # steps 3.. replayed it
    assert_same_drafts(got, want, TOL)


@pytest.mark.parametrize("which", ["tiny", "packed"])
def test_the_graph_replays_the_kernels_it_captured(engines, which):
    """Graph replays equal the same kernels launched one by one (up to the order of split-K
    atomic adds)."""
    e = engines[which]
    s = session(e)
    plain = block(e, eager=False, graph=False)
    want = chain(plain, copy_state(e, s.mtp_state), s.mtp_state.hidden, 42, len(s.tokens),
                 STEPS)
    graphed = block(e, eager=False)
    mine = copy_state(e, s.mtp_state)
    got = chain(graphed, mine, mine.hidden, 42, len(s.tokens), STEPS, greedy_tokens(want))
    assert plain.kernels.graph is None and graphed.kernels.graph is not None
    assert_same_drafts(got, want, 1e-5)  # split-K atomics may add in another order


def test_graph_drafts_equal_the_numpy_engine(engines):
    cp, ref = engines["tiny"], engines["numpy"]
    a, b = session(cp), session(ref)
    want = chain(ref.mtp, b.mtp_state, b.mtp_state.hidden, 42, len(b.tokens), STEPS)
    got = chain(cp.mtp, a.mtp_state, a.mtp_state.hidden, 42, len(a.tokens), STEPS,
                greedy_tokens(want))
    assert_same_drafts(got, want, TOL)
    assert_same_window(a.mtp_state, b.mtp_state, TOL)


def test_graph_drafts_after_undo_and_interleaved_sessions(engines):
    """Two sessions drafting in turn on one graph, each putting back rejected drafts, equal
    each session drafting alone through the eager code."""
    e = engines["tiny"]
    graphed, eager = block(e, eager=False), block(e, eager=True)
    sessions = [session(e, text) for text in TEXT]
    ref = {id(s): copy_state(e, s.mtp_state) for s in sessions}
    out = {id(s): {"graph": [], "eager": []} for s in sessions}
    for rnd in range(3):
        for s in sessions:
            start = len(s.tokens) + rnd
            for name, b, state in (("eager", eager, ref[id(s)]), ("graph", graphed, s.mtp_state)):
                kept = state.keep(list(range(start, start + 3)))
                hidden = (state.hidden if rnd == 0
                          else e.backend.xp.asarray(out[id(s)][name][-3][1]))  # host copy
                tokens = None if name == "eager" else greedy_tokens(out[id(s)]["eager"][-3:])
                out[id(s)][name] += chain(b, state, hidden, 42 + rnd, start, 3, tokens)
                state.undo(kept, start + 1)  # only the first draft was accepted
    for s in sessions:
        assert_same_drafts(out[id(s)]["graph"], out[id(s)]["eager"], TOL)
        assert_same_window(s.mtp_state, ref[id(s)], TOL)
    assert graphed.kernels.graph is not None
    assert host(sessions[0].mtp_state.raw).any()


class Window:
    """A session's MTP window as WindowTable.fill reads it."""

    def __init__(self, raw, positions):
        self.raw, self.positions = raw, positions


@pytest.mark.parametrize("cap, heads, width, fused", [(64, 4, 64, True), (128, 64, 512, True),
                                                     (128, 8, 36, False)])
def test_window_kernels_equal_their_twins(cap, heads, width, fused):
    """The masked window attention (empty, stale and visible slots; the new row) and the row
    store equal their NumPy twins."""
    import cupy as cp

    from ds4.kernels import mtp as mk

    rng = np.random.default_rng(cap + width)
    t, rope_dim = 300, 8
    raw = rng.standard_normal((cap, width)).astype(np.float32)
    positions = np.where(rng.random(cap) < 0.3, -1, t - rng.integers(0, 2 * cap, cap))
    positions[t % cap] = t  # a stale row of this very position: still a key, as in the model
    positions[(t + 3) % cap] = t + 3  # a row ahead of the query: masked
    q = rng.standard_normal((heads, width)).astype(np.float32)
    kv = rng.standard_normal((1, width)).astype(np.float32)
    sinks = rng.standard_normal(heads).astype(np.float32)
    freqs = 1.0 / 10000.0 ** (np.arange(rope_dim // 2) * 2 / rope_dim)
    got = {}
    for xp in (cp, np):
        window = Window(xp.asarray(raw.copy()), positions.copy())
        table = gpu_mtp.WindowTable(xp, cap)
        table.fill(window, 0, t)
        out = xp.zeros((heads, width), xp.float32)
        part = xp.zeros(mk.partial_size(heads, width, cap), xp.float32)
        attend = mk.window_attention if xp is cp else mk.window_attention_numpy
        store = mk.window_store if xp is cp else mk.window_store_numpy
        attend(xp.asarray(q), xp.asarray(kv), table, xp.asarray(sinks), out, part,
               xp.asarray(freqs) if fused else None, rope_dim)
        store(xp.asarray(kv), table)
        got[xp] = host(out), host(window.raw)
    np.testing.assert_allclose(got[cp][0], got[np][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[cp][1], got[np][1])
    assert not np.array_equal(got[np][1][t % cap], raw[t % cap])


def test_the_pick_kernel_equals_the_host_reduction():
    import cupy as cp

    from ds4.kernels import mtp as mk
    from ds4.mtp import top_gap

    rng = np.random.default_rng(4)
    wide = rng.standard_normal(129280).astype(np.float32)
    tied = wide.copy()
    tied[[90000, 500]] = wide.max() + 1  # a tie: the lower index, margin 0
    for x in (wide, tied, wide[:1000], wide[::-1].copy()):
        out = cp.zeros(3, cp.int32)
        mk.top_gap(cp.asarray(x), out)
        assert mk.read_top_gap(out.get()) == top_gap(np, x)


def test_a_draft_reads_the_graph_pick(engines):
    from ds4.mtp import top_gap

    e = engines["tiny"]
    s = session(e)
    state = s.mtp_state
    for position in range(len(s.tokens), len(s.tokens) + 3):  # eager, capture, replay
        logits, _ = e.mtp.step(state, state.hidden, 42, position)
        assert e.mtp.pick(logits) == top_gap(e.backend.xp, logits)
