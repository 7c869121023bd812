"""Engine.decode_batch on CuPy (needs CuPy and a GPU).

The default: the kernel decoder's graph of the batch size (1, 2, 4, 8) reads every member's
position, token and state through its member table, and each kernel computes a member's row the
same way whatever the batch, so batched logits equal single steps (the batch-of-one graph)
bitwise; greedy streams therefore equal too. Sessions sit at different positions and lengths,
windows of the CSA and HCA compressors close inside batched steps, 3 and 5 sessions run with
idle members, and one graph per size serves every member set.

The other way (`Model.batch_rows`, DS4_DECODE_BATCH=rows) is the model code run eagerly on CuPy
arrays: shared matrices as one cuBLAS GEMM over the [B, D] block, each routed expert one grouped
GEMM over the rows that picked it, attention per session. It is compared with single steps of
the same eager code (kernel decoder off), within 3e-5 of the logits' scale (measured on the
H200: 1.0-1.7e-5; cuBLAS picks another reduction order for a [B, D] block than for one row), and
with the CUDA-graph single steps, within the 2e-4 that separates the eager path from the kernels
(tests/test_gpu_engine.py) and with the same argmax.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_batch_engine import packed_tiny, prompt, twin_sessions

from ds4.backend import cuda_available
from ds4.engine import Engine, default_model_dir

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]

FIXTURES = Path(__file__).parent / "fixtures"
LENGTHS = [(15, 30), (7, 70, 22), (15, 30, 47, 63)]


def model_dir(case: str, tmp_path_factory) -> Path:
    if case == "tiny":
        return Path(default_model_dir())
    if case == "tiny-packed":
        return packed_tiny(tmp_path_factory.mktemp("official"))
    return FIXTURES / case


@pytest.fixture(scope="module", params=["v4_csa_hca", "v4_hca8", "tiny", "tiny-packed"])
def path(request, tmp_path_factory) -> Path:
    return model_dir(request.param, tmp_path_factory)


def twin_runs(engine: Engine, lengths, steps: int = 5):
    """(single-step logits, batched logits) per step, the same greedy tokens fed to both."""
    single, batched = twin_sessions(engine, list(lengths))
    for _ in range(steps):
        tokens = [int(np.argmax(s.logits)) for s in single]
        alone = [s.decode(t) for s, t in zip(single, tokens)]
        yield alone, engine.decode_batch(batched, tokens)


def graphs_of(engine: Engine) -> dict:
    """The kernel decoder's graphs by batch size (it is built on the first decode)."""
    return engine.model.kernel_decoder.decoder.graphs


def test_kernel_batch_equals_single_steps_bitwise(path):
    engine = Engine.open(path, backend="cupy", prefill_chunk=16)
    assert engine.model.kernel_decoder is not None and not engine.model.batch_rows
    for lengths in [(23,), (15, 30), (7, 70, 22), (15, 30, 47, 63), (9, 40, 17, 66, 3)]:
        for alone, together in twin_runs(engine, lengths, steps=6):
            for a, b in zip(alone, together):
                assert np.array_equal(a, b), lengths
    assert set(graphs_of(engine)) == {1, 2, 4, 8}  # 3 runs as 4, 5 as 8 (idle members)


def test_shared_expert_on_the_side_stream_keeps_every_bit(tmp_path_factory, monkeypatch):
    # the packed model's FP4 experts with an FP8 shared expert: the decoder launches the
    # shared expert ahead of the router on its side stream (rows_moe.shared_ahead); the same
    # items of the same kernel, so logits equal the fused launches' bit for bit (graphs of 1
    # and 4 members, eager first steps included)
    from ds4.kernels import rows_moe
    from ds4.model import gpu_decode

    path, real, forks = model_dir("tiny-packed", tmp_path_factory), rows_moe.shared_ahead, []
    monkeypatch.setattr(rows_moe, "shared_ahead", lambda *a: forks.append(real(*a)) or forks[-1])
    runs = {}
    for ahead in (True, False):
        monkeypatch.setattr(gpu_decode, "SHARED_AHEAD", ahead)
        engine = Engine.open(path, backend="cupy", prefill_chunk=16)
        steps = twin_runs(engine, (15, 30, 47), 4)
        runs[ahead] = [alone + list(together) for alone, together in steps]
    assert forks and all(event is not None for event in forks)  # the side branch ran
    for side, fused in zip(runs[True], runs[False]):
        assert all(np.array_equal(a, b) for a, b in zip(side, fused))


def test_one_graph_per_size_serves_every_member_set():
    engine = Engine.open(default_model_dir(), backend="cupy", prefill_chunk=16)
    pool = [engine.new_session(128) for _ in range(6)]
    twins = [engine.new_session(128) for _ in range(6)]
    for k, (s, t) in enumerate(zip(pool, twins)):
        s.sync(prompt(k, 10 + 7 * k))
        t.sync(prompt(k, 10 + 7 * k))
    seen = []
    for members in ([0, 1, 2, 3], [2, 3, 4, 5], [5, 0, 3], [1, 4, 2, 0], [4, 5, 1]):
        tokens = [int(np.argmax(pool[m].logits)) for m in members]
        together = engine.decode_batch([pool[m] for m in members], tokens)
        alone = [twins[m].decode(t) for m, t in zip(members, tokens)]
        assert all(np.array_equal(a, b) for a, b in zip(alone, together))
        seen.append(graphs_of(engine).get(4))
    assert seen[1] is not None and all(g is seen[1] for g in seen[1:])  # captured once


def test_larger_state_recaptures_the_graph():
    """A member whose compressed rows outgrow the graph's bounds makes it re-capture; its rows
    still equal single steps bitwise, and so do the small members'."""
    engine = Engine.open(default_model_dir(), backend="cupy", prefill_chunk=16)
    ctxs = [128, 128, 1024]
    sets = [[engine.new_session(c) for c in ctxs] for _ in range(2)]
    for group in sets:
        for k, s in enumerate(group):
            s.sync(prompt(k, 20 + 9 * k))
    single, batched = sets
    before = None
    for step, members in enumerate([[0, 1], [0, 1], [0, 2], [0, 1, 2], [1, 2]]):
        tokens = [int(np.argmax(single[m].logits)) for m in members]
        alone = [single[m].decode(t) for m, t in zip(members, tokens)]
        together = engine.decode_batch([batched[m] for m in members], tokens)
        assert all(np.array_equal(a, b) for a, b in zip(alone, together)), step
        if step == 1:
            before = graphs_of(engine).get(2)
    after = graphs_of(engine).get(2)
    assert before is not None and after is not None and after is not before


@pytest.mark.parametrize("lengths", LENGTHS)
def test_cupy_batched_step_equals_single_eager_steps(path, lengths):
    # the packed model's FP8/FP4 rounding simulation would turn summation-order noise into
    # whole rounding steps: compare the plain math (tests/test_packed_gpu.py covers it)
    engine = Engine.open(path, backend="cupy", prefill_chunk=16, quantize=False)
    engine.model.kernel_decoder = None  # single steps through the same model code
    engine.model.batch_rows = True
    for alone, together in twin_runs(engine, lengths):
        for a, b in zip(alone, together):
            assert np.abs(b - a).max() <= 3e-5 * np.abs(a).max()


@pytest.mark.parametrize("lengths", LENGTHS[1:])
def test_cupy_batched_step_tracks_graph_decode(path, lengths):
    engine = Engine.open(path, backend="cupy", prefill_chunk=16, quantize=False)
    assert engine.model.kernel_decoder is not None
    engine.model.batch_rows = True
    for alone, together in twin_runs(engine, lengths):
        # the graph's row kernels split x into bf16 hi + lo words (tests/test_gpu_engine.py
        # ROWS_TOL: measured 2.3e-4 from the fp32 model code on the tiny model)
        for a, b in zip(alone, together):
            np.testing.assert_allclose(b, a, atol=5e-4, rtol=0)
            assert int(np.argmax(a)) == int(np.argmax(b))


def _member_states(cp, cfg, positions):
    """The same random states on the GPU and the host, at the given positions."""
    from ds4.model.state import SessionState

    rng = np.random.default_rng(3)
    gpu = [SessionState(cp, cfg, 128) for _ in positions]
    host = [SessionState(np, cfg, 128) for _ in positions]
    for g, h, n in zip(gpu, host, positions):
        g.n = h.n = n
        for lg, lh in zip(g.layers, h.layers):
            pairs = [(lg.raw, lh.raw)] + [
                (getattr(cg, a), getattr(lh.compressors()[name], a))
                for name, cg in lg.compressors().items()
                for a in ("pending_kv", "pending_score", "overlap_kv", "overlap_score", "rows")]
            for a, b in pairs:
                b[...] = rng.standard_normal(b.shape).astype(np.float32)
                a[...] = cp.asarray(b)
    return gpu, host


def test_fused_member_kernels_match_their_twins():
    """The batch graph's fused kernels (query norm + RoPE, compressor push + pool, attention
    with the output's inverse RoPE) on two members equal their NumPy twins (fp32 sums)."""
    import cupy as cp

    from ds4.kernels import attention as at
    from ds4.kernels import compressor as cm
    from ds4.kernels import norm
    from ds4.model.config import CSA, ModelConfig
    from ds4.model.gpu_batch import COMPRESSOR, COMPRESSOR_ROWS, RAW, MemberTable

    cfg = ModelConfig.from_dir(default_model_dir())
    i = cfg.layer_types.index(CSA)
    m, d, r = cfg.compress_ratio(i), cfg.head_dim, cfg.qk_rope_head_dim
    positions = [m - 1, 3 * m + 1]  # the first closes a window, the second does not
    gpu, host = _member_states(cp, cfg, positions)
    tables = []
    for xp, states in ((cp, gpu), (np, host)):
        t = MemberTable(xp, cfg.num_hidden_layers, 2)
        t.fill(states, [5, 9])
        tables.append(t)
    rng = np.random.default_rng(4)
    freqs = (10000.0 ** (-np.arange(r // 2) * 2 / r)).astype(np.float64)
    q = rng.standard_normal((2, cfg.num_attention_heads, d)).astype(np.float32)
    qg = cp.asarray(q)
    norm.rms_norm_rope(qg.reshape(-1, d), None, 1e-6, tables[0].pos, cp.asarray(freqs), r,
                       cfg.num_attention_heads)
    norm.rms_norm_rope_numpy(q.reshape(-1, d), None, 1e-6, tables[1].pos, freqs, r,
                             cfg.num_attention_heads)
    np.testing.assert_allclose(cp.asnumpy(qg), q, atol=1e-5, rtol=1e-5)
    kv = rng.standard_normal((2, 2 * d)).astype(np.float32)
    bias = rng.standard_normal((m, 2 * d)).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    cm.compressor_step_m(cp.asarray(kv), cp.asarray(kv[:, ::-1].copy()), cp.asarray(bias),
                         tables[0], i, COMPRESSOR, cp.asarray(w), cp.asarray(freqs), m, 2 * d,
                         d, r)
    cm.compressor_step_m_numpy(kv, kv[:, ::-1].copy(), bias, tables[1], i, COMPRESSOR, w, freqs,
                               m, 2 * d, d, r)
    for g, h in zip(gpu, host):
        cg, ch = g.layers[i].compressor, h.layers[i].compressor
        for a in ("pending_kv", "pending_score", "overlap_kv", "overlap_score", "rows"):
            np.testing.assert_allclose(cp.asnumpy(getattr(cg, a)), getattr(ch, a), atol=1e-5)
    keys = cfg.sliding_window + m * 4
    out = [np.zeros_like(q), cp.zeros(q.shape, cp.float32)]
    part = cp.zeros((2, at.partial_size(cfg.num_attention_heads, d, keys)), cp.float32)
    at.attention_decode_m(qg, tables[0], i, RAW, COMPRESSOR_ROWS, cfg.sliding_window, None, None,
                          m, cp.asarray(w[:cfg.num_attention_heads]), out[1], keys, part,
                          cp.asarray(freqs), r)
    at.attention_decode_m_numpy(q, tables[1], i, RAW, COMPRESSOR_ROWS, cfg.sliding_window, None,
                                None, m, w[:cfg.num_attention_heads], out[0], keys, None, freqs,
                                r)
    np.testing.assert_allclose(cp.asnumpy(out[1]), out[0], atol=1e-5, rtol=1e-4)
