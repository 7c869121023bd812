"""Each RawKernel against its NumPy twin on fresh random inputs (needs CuPy and a GPU).

Tolerances: fp32 accumulation in a different order, so relative error ~1e-5 for reductions over
thousands of terms; index outputs (top-k, routing, argmax) must match exactly."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.backend import cuda_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]

RTOL = 2e-5


@pytest.fixture
def cp():
    import cupy

    return cupy


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def both(cp, fn_gpu, fn_np, *args, out_index, **kw):
    """Run a launcher on device copies and its twin on host copies (arrays, or tuples of them);
    return (gpu, numpy) outs."""
    def copies(a, to):
        if isinstance(a, tuple):
            return tuple(copies(v, to) for v in a)
        return to(a) if isinstance(a, np.ndarray) else a

    dev = [copies(a, cp.asarray) for a in args]
    host = [copies(a, np.copy) for a in args]
    fn_gpu(*dev, **kw)
    fn_np(*host, **kw)
    return cp.asnumpy(dev[out_index]), host[out_index]


@pytest.mark.parametrize("rows,cols,group,bf16", [(512, 4096, None, True), (8192, 1024, None, True),
                                                  (8192, 4096, 1024, True), (96, 64, None, True),
                                                  (512, 4096, None, False), (96, 40, 32, False)])
@pytest.mark.parametrize("per_warp", [1, 2])
def test_gemv(cp, rng, rows, cols, group, bf16, per_warp):
    from ds4.kernels import gemv, to_bf16

    if group is None:
        rows += per_warp - 1  # an odd row count for the 2-rows-per-warp kernel
    w = randn(rng, rows, cols, scale=0.05)
    w = to_bf16(w) if bf16 else w
    x = randn(rng, (rows // group if group else 1) * cols)
    out = np.full(rows, np.nan, np.float32)
    g, n = both(cp, gemv.gemv, gemv.gemv_numpy, w, x, out, group, out_index=2,
                splits=None if per_warp == 1 else 1, rows_per_warp=per_warp)
    assert np.isfinite(g).all() and rel_err(g, n) < RTOL


def test_rms_norm_and_rope(cp, rng):
    from ds4.kernels import norm, rope

    x, w = randn(rng, 64, 512), randn(rng, 512)
    out = np.full_like(x, np.nan)
    g, n = both(cp, norm.rms_norm, norm.rms_norm_numpy, x, w, out, out_index=2)
    assert rel_err(g, n) < RTOL
    freqs = 10000.0 ** (-np.arange(32) * 2 / 64)
    pos = np.array([4093], np.int32)
    g, n = both(cp, rope.rope_tail, rope.rope_tail_numpy, x, pos, freqs, 64, 64,
                out_index=0, sign=-1.0)
    assert rel_err(g, n) < 1e-5
    assert np.array_equal(g[:, :448], x[:, :448])  # channels before the rope slice untouched


def test_hyper_connection(cp, rng):
    from ds4.kernels import hyper_connection as hc
    from ds4.kernels import to_bf16

    n, D = 4, 4096
    X = randn(rng, n, D)
    fn, mix = randn(rng, 24, n * D, scale=0.02), np.full(24, np.nan, np.float32)
    g_mix, n_mix = both(cp, hc.hc_mix, hc.hc_mix_numpy, fn, X, mix, out_index=2)
    assert rel_err(g_mix, n_mix) < RTOL
    scale, base = randn(rng, 3), randn(rng, 24)
    u, pc = np.full(D, np.nan, np.float32), np.full(n + n * n, np.nan, np.float32)
    args = (n_mix, scale, base, X, u, pc)
    g_u, n_u = both(cp, hc.hc_pre, hc.hc_pre_numpy, *args, out_index=4)
    g_pc, n_pc = both(cp, hc.hc_pre, hc.hc_pre_numpy, *args, out_index=5)
    assert rel_err(g_u, n_u) < 1e-5 and rel_err(g_pc, n_pc) < 1e-5
    comb = n_pc[n:].reshape(n, n)
    assert np.allclose(comb.sum(axis=0), 1, atol=1e-4)  # Sinkhorn: doubly stochastic
    y, Xout = randn(rng, D), np.full_like(X, np.nan)
    g, h = both(cp, hc.hc_post, hc.hc_post_numpy, X, y, n_pc, Xout, out_index=3)
    assert rel_err(g, h) < 1e-5
    norm_w, hbuf = randn(rng, D), np.full(D, np.nan, np.float32)
    g, h = both(cp, hc.hc_pre_norm, hc.hc_pre_norm_numpy, n_mix, scale, base, X, norm_w, hbuf,
                pc, out_index=5)
    assert rel_err(g, h) < 1e-5
    g, h = both(cp, hc.hc_pre, hc.hc_pre_numpy, n_mix, scale, base, X, u, pc, out_index=4,
                head=True)
    assert rel_err(g, h) < 1e-5
    embed, tok = to_bf16(randn(rng, 100, D)), np.array([37], np.int32)
    g, h = both(cp, hc.embed_streams, hc.embed_streams_numpy, embed, tok, Xout, out_index=2)
    assert np.array_equal(g, h)


@pytest.mark.parametrize("n,D,head", [(4, 4096, False), (4, 4096, True), (3, 1000, False),
                                      (2, 256, False)])
def test_hc_unit_is_post_mix_and_pre_norm(cp, rng, n, D, head):
    """One hc_unit launch against its twin, for three members: with the previous unit's
    hc_post (its post and comb computed in the launch from that unit's mix; for n = 3 by one
    thread, else by a warp) and without, launched twice (the block counters reset
    themselves)."""
    from ds4.kernels import hyper_connection as hc

    B, n_mix, prev_n = 3, n if head else (2 + n) * n, (2 + n) * n
    X, y = randn(rng, B, n, D), randn(rng, B, D)
    prev = (randn(rng, B, prev_n), randn(rng, 3), randn(rng, prev_n))
    fn, scale, base = randn(rng, n_mix, n * D, scale=0.02), randn(rng, 3), randn(rng, n_mix)
    norm_w = randn(rng, D)
    for post, before in ((y, prev), (None, None)):
        for _ in range(2):
            mix, h = np.full((B, n_mix), np.nan, np.float32), np.full((B, D), np.nan, np.float32)
            scratch = hc.unit_scratch(cp, B, D)
            args = (X, post, before, fn, scale, base, norm_w, mix, h, scratch)
            g_X, n_X = both(cp, hc.hc_unit, hc.hc_unit_numpy, *args, out_index=0)
            g_mix, n_mix_ = both(cp, hc.hc_unit, hc.hc_unit_numpy, *args, out_index=7)
            g_h, n_h = both(cp, hc.hc_unit, hc.hc_unit_numpy, *args, out_index=8)
            assert rel_err(g_X, n_X) < 1e-6 and rel_err(g_mix, n_mix_) < RTOL
            assert rel_err(g_h, n_h) < 1e-5
            assert not cp.asnumpy(scratch[1]).any()  # every member's counter back at zero


@pytest.mark.parametrize("t,ratio,use_sel", [(5, 0, False), (700, 0, False), (3000, 128, False),
                                            (4000, 4, True)])
def test_attention(cp, rng, t, ratio, use_sel):
    from ds4.kernels import attention as at

    heads, width, cap = 64, 512, 128
    q, raw, sinks = randn(rng, heads, width, scale=0.1), randn(rng, cap, width), randn(rng, heads)
    comp = randn(rng, 1024, width)
    pos = np.array([t], np.int32)
    sel = rng.choice(t // 4, 512, replace=False).astype(np.int32) if use_sel else None
    count = np.array([512], np.int32) if use_sel else None
    out = np.full((heads, width), np.nan, np.float32)
    part = np.full(at.partial_size(heads, width, 1200), np.nan, np.float32)
    g, n = both(cp, at.attention_decode, at.attention_decode_numpy, q, raw, pos,
                comp if ratio else None, sel, count, ratio, sinks, out, 1200, part, out_index=8)
    assert rel_err(g, n) < RTOL
    kv, w = randn(rng, width), randn(rng, width)
    freqs = 160000.0 ** (-np.arange(32) * 2 / 64)
    g, n = both(cp, at.attention_store_kv, at.attention_store_kv_numpy, kv, w, freqs, pos,
                raw, 64, out_index=4)
    assert rel_err(g, n) < 1e-5


@pytest.mark.parametrize("ratio,hd,overlap", [(4, 512, True), (4, 128, True), (128, 512, False)])
def test_compressor_windows(cp, rng, ratio, hd, overlap):
    """Push 3 windows of tokens through both twins and compare state and pooled rows."""
    from ds4.kernels import compressor as c

    cw = 2 * hd if overlap else hd
    bias, w = randn(rng, ratio, cw), randn(rng, hd)
    freqs = 160000.0 ** (-np.arange(32) * 2 / 64)
    host = {"pkv": np.zeros((ratio, cw), np.float32), "psc": np.zeros((ratio, cw), np.float32),
            "okv": np.zeros((ratio, hd), np.float32) if overlap else None,
            "osc": np.full((ratio, hd), -np.inf, np.float32) if overlap else None,
            "comp": np.full((4, hd), np.nan, np.float32)}
    dev = {k: None if v is None else cp.asarray(v) for k, v in host.items()}
    for t in range(3 * ratio):
        kvp, g = randn(rng, cw), randn(rng, cw)
        pos = np.array([t], np.int32)
        for fns, st, conv in (((c.compressor_push_numpy, c.compressor_pool_numpy), host,
                               np.asarray),
                              ((c.compressor_push, c.compressor_pool), dev, cp.asarray)):
            fns[0](conv(kvp), conv(g), conv(bias), conv(pos), st["pkv"], st["psc"])
            fns[1](st["pkv"], st["psc"], st["okv"], st["osc"], conv(w), conv(freqs), conv(pos),
                   st["comp"], 64)
    assert rel_err(cp.asnumpy(dev["comp"][:3]), host["comp"][:3]) < 1e-5
    assert np.isnan(cp.asnumpy(dev["comp"][3])).all()  # no fourth window closed
    if overlap:
        assert rel_err(cp.asnumpy(dev["okv"]), host["okv"]) < 1e-6


@pytest.mark.parametrize("ratio,hd,overlap", [(4, 512, True), (128, 512, False)])
def test_prefill_pools_windows_in_one_kernel_as_numpy_does(cp, rng, ratio, hd, overlap):
    """The model's pool_windows on CuPy (compressor_pool_windows: every window of a chunk in
    one launch) gives NumPy's pooled rows and carried state, chunk after chunk."""
    from ds4.model.compressor import pool_windows
    from ds4.model.state import CompressorState

    cw = 2 * hd if overlap else hd
    states = {xp: CompressorState(xp, ratio, cw, hd, overlap, 64) for xp in (np, cp)}
    start = 0
    for size in (3 * ratio + 1, 5 * ratio - 1, 2 * ratio):
        kv, score = randn(rng, size, cw), randn(rng, size, cw, scale=3.0)
        want, first = pool_windows(np, states[np], kv, score, start)
        got, d_first = pool_windows(cp, states[cp], cp.asarray(kv), cp.asarray(score), start)
        assert first == d_first
        assert rel_err(cp.asnumpy(got), want) < 1e-6
        start += size
    for name in ("pending_kv", "pending_score", "overlap_kv", "overlap_score"):
        np.testing.assert_array_equal(cp.asnumpy(getattr(states[cp], name)),
                                      getattr(states[np], name))


def test_indexer_scores_and_topk(cp, rng):
    from ds4.kernels import indexer, sampling

    heads, hd, cap = 64, 128, 4096
    q, wts, keys = randn(rng, heads, hd), randn(rng, heads), randn(rng, cap, hd)
    pos = np.array([4 * 3000 + 2], np.int32)
    scores = np.full(cap, np.nan, np.float32)
    g, n = both(cp, indexer.indexer_scores, indexer.indexer_scores_numpy, q, wts, keys, pos, 4,
                scores, out_index=5)
    assert rel_err(g[:3000], n[:3000]) < RTOL
    sel, count = np.full(512, -1, np.int32), np.zeros(1, np.int32)
    g_sel, n_sel = both(cp, sampling.topk_select, sampling.topk_select_numpy, n, 512, sel,
                        count, pos, 4, out_index=2)
    assert np.array_equal(g_sel, n_sel)
    ties = np.repeat(randn(rng, 100), 20)  # 2000 values, each repeated: ties at the threshold
    g_sel, n_sel = both(cp, sampling.topk_select, sampling.topk_select_numpy, ties, 333, sel,
                        count, out_index=2)
    assert np.array_equal(g_sel[:333], n_sel[:333])
    few = np.full(512, -1, np.int32)
    g_sel, n_sel = both(cp, sampling.topk_select, sampling.topk_select_numpy, ties, 512, few,
                        count, np.array([4 * 100], np.int32), 4, out_index=2)
    assert np.array_equal(g_sel[:100], np.arange(100))


@pytest.mark.parametrize("case", ["vocabulary", "ties_everywhere", "all_equal", "batch"])
def test_topk_select_lists_the_twins_entries(cp, rng, case):
    """topk_select lists the k largest in ascending order with ties at the threshold taken
    lowest index first, as its twin, where the equal entries span many warps' chunks: a
    vocabulary row (k 40 and 1024), 16 values repeated over 129280 entries, a row of one
    value, and batched rows each with its own count (pos)."""
    from ds4.kernels import sampling

    if case == "batch":
        x = randn(rng, 3, 20000)
        x[1, 5000:15000] = 0.5  # an equal run across chunks
        pos = np.array([4 * 20000 - 1, 4 * 7000 + 3, 4 * 100], np.int32)
        sel, count = np.full((3, 512), -1, np.int32), np.zeros(3, np.int32)
        g, n = both(cp, sampling.topk_select, sampling.topk_select_numpy, x, 512, sel, count,
                    pos, 4, out_index=2)
        for b, m in enumerate((512, 512, 100)):
            assert np.array_equal(g[b, :m], n[b, :m]), b
        return
    x = {"vocabulary": randn(rng, 129280), "all_equal": np.full(50000, 1.5, np.float32),
         "ties_everywhere": np.tile(randn(rng, 16), 129280 // 16)}[case]
    for k in (40, 1024):
        sel, count = np.full(k, -1, np.int32), np.zeros(1, np.int32)
        g, n = both(cp, sampling.topk_select, sampling.topk_select_numpy, x, k, sel, count,
                    out_index=2)
        assert np.array_equal(g, n), (case, k)


def test_argmax_ties(cp, rng):
    from ds4.kernels import sampling

    x = randn(rng, 129280)
    x[[777, 90000]] = x.max() + 1  # lowest index wins a tie
    out = np.zeros(1, np.int32)
    g, n = both(cp, sampling.argmax, sampling.argmax_numpy, x, out, out_index=1)
    assert g[0] == n[0] == 777


@pytest.mark.parametrize("hashed", [False, True])
def test_moe_route_of_a_batch_is_each_members_own(cp, rng, hashed):
    """One launch for B = 5 members equals the twin row by row (and so five single launches)."""
    from ds4.kernels import moe

    B, E, top_k = 5, 256, 6
    logits, bias = randn(rng, B, E), randn(rng, E, scale=0.1)
    tid2eid = rng.integers(0, E, (50, top_k)).astype(np.int32) if hashed else None
    token = rng.integers(0, 50, B).astype(np.int32)
    idx, wts = np.zeros((8, top_k), np.int32), np.zeros((8, top_k), np.float32)
    args = (logits, bias, tid2eid, token, top_k, 1.5, idx[:B], wts[:B])
    g_idx, n_idx = both(cp, moe.moe_route, moe.moe_route_numpy, *args, out_index=6)
    g_w, n_w = both(cp, moe.moe_route, moe.moe_route_numpy, *args, out_index=7)
    assert np.array_equal(g_idx, n_idx) and rel_err(g_w, n_w) < 1e-6
    assert len({tuple(row) for row in g_idx}) == B  # each row routed by its own logits


@pytest.mark.parametrize("E", [72, 256, 1000])
def test_moe_route_breaks_ties_to_the_lower_expert(cp, rng, E):
    """Experts of equal choice (in one lane's slots and across lanes) go in expert order, as
    the twin's stable sort; any count of experts up to 1024, and no bias."""
    from ds4.kernels import moe

    top_k = 8
    logits = np.round(randn(rng, 3, E), 1)  # many equal values
    logits[0, [5, 37, 69, E - 1]] = 9.0  # one lane (5, 37, 69) and another (E - 1) tie
    idx, wts = np.zeros((3, top_k), np.int32), np.zeros((3, top_k), np.float32)
    args = (logits, None, None, np.zeros(3, np.int32), top_k, 2.5, idx, wts)
    g_idx, n_idx = both(cp, moe.moe_route, moe.moe_route_numpy, *args, out_index=6)
    g_w, n_w = both(cp, moe.moe_route, moe.moe_route_numpy, *args, out_index=7)
    assert np.array_equal(g_idx, n_idx) and rel_err(g_w, n_w) < 1e-6
    assert list(g_idx[0, :4]) == [5, 37, 69, E - 1]


@pytest.mark.parametrize("hashed", [False, True])
def test_prefill_route_on_the_gpu_equals_numpys(cp, rng, hashed):
    """The model's route() of a prefill chunk on CuPy (one moe_route launch for every token)
    picks NumPy's experts, in its order, with its weights (1e-6 relative)."""
    from types import SimpleNamespace

    from ds4.model.moe import route

    S, E, D, top_k = 300, 256, 64, 6
    cfg = SimpleNamespace(scoring_func="sqrtsoftplus", num_experts_per_tok=top_k,
                          routed_scaling_factor=1.5, norm_topk_prob=True)
    # small integers times eighths: the router's logits are exact on both backends, so only
    # the softplus' last bit may differ
    lw = {"mlp.gate.weight": (rng.integers(-8, 9, (E, D)) / 8).astype(np.float32),
          "mlp.gate.e_score_correction_bias": randn(rng, E, scale=0.1),
          "mlp.gate.tid2eid": rng.integers(0, E, (50, top_k))}
    x, tokens = rng.integers(-3, 4, (S, D)).astype(np.float32), rng.integers(0, 50, S)
    n_ids, n_w = route(np, cfg, lw, x, tokens, hashed)
    g_ids, g_w = route(cp, cfg, {k: cp.asarray(v) for k, v in lw.items()}, cp.asarray(x),
                       cp.asarray(tokens), hashed)
    assert np.array_equal(cp.asnumpy(g_ids), n_ids)
    assert rel_err(cp.asnumpy(g_w), n_w) < 1e-6


@pytest.mark.parametrize("hashed,bf16", [(False, True), (True, True), (False, False)])
def test_moe(cp, rng, hashed, bf16):
    from ds4.kernels import moe, to_bf16

    conv = to_bf16 if bf16 else (lambda a: a)
    E, top_k, inter, D = 64, 6, 256, 1024
    logits, bias = randn(rng, E), randn(rng, E, scale=0.1)
    tid2eid = rng.integers(0, E, (50, top_k)).astype(np.int32) if hashed else None
    token = np.array([17], np.int32)
    idx, wts = np.zeros(top_k, np.int32), np.zeros(top_k, np.float32)
    args = (logits, bias, tid2eid, token, top_k, 1.5, idx, wts)
    g_idx, n_idx = both(cp, moe.moe_route, moe.moe_route_numpy, *args, out_index=6)
    g_w, n_w = both(cp, moe.moe_route, moe.moe_route_numpy, *args, out_index=7)
    assert np.array_equal(g_idx, n_idx) and rel_err(g_w, n_w) < 1e-6
    gate_up = conv(randn(rng, E, 2 * inter, D, scale=0.1))
    down = conv(randn(rng, E, D, inter, scale=0.05))
    x, act = randn(rng, D), np.full((top_k, inter), np.nan, np.float32)
    d_gu = cp.asarray(gate_up)
    d_idx, d_w, d_x, d_act = (cp.asarray(a) for a in (n_idx, n_w, x, act))
    moe.moe_gate_up(d_gu[:, :inter], d_gu[:, inter:], d_idx, d_w, d_x, d_act, 10.0)
    moe.moe_gate_up_numpy(gate_up[:, :inter], gate_up[:, inter:], n_idx, n_w, x, act, 10.0)
    assert rel_err(cp.asnumpy(d_act), act) < RTOL
    y = randn(rng, D)
    g, n = both(cp, moe.moe_down, moe.moe_down_numpy, down, n_idx, act, y, out_index=3,
                accumulate=True)
    assert rel_err(g, n) < RTOL
    # the shared expert as one more row of the same launches
    sg, su, sd = conv(randn(rng, inter, D, scale=0.1)), conv(randn(rng, inter, D, scale=0.1)), \
        conv(randn(rng, D, inter, scale=0.05))
    act7 = np.full((top_k + 1, inter), np.nan, np.float32)
    g, n = both(cp, moe.moe_gate_up, moe.moe_gate_up_numpy, gate_up[:, :inter],
                gate_up[:, inter:], n_idx, n_w, x, act7, 10.0, sg, su, out_index=5)
    assert rel_err(g, n) < RTOL
    g, n = both(cp, moe.moe_down, moe.moe_down_numpy, down, n_idx, n, y, False, sd, out_index=3)
    assert rel_err(g, n) < RTOL


@pytest.mark.parametrize("bf16", [True, False])
def test_gemv_many(cp, rng, bf16):
    from ds4.kernels import gemv, to_bf16

    shapes = [(1024, 512), (512, 512), (256, 512), (64, 512), (3, 512)]
    conv = to_bf16 if bf16 else (lambda a: a)
    ws = [conv(randn(rng, r, c, scale=0.05)) for r, c in shapes]
    x = randn(rng, 512)
    outs = [np.full(r, np.nan, np.float32) for r, _ in shapes]
    d_ws, d_outs = [cp.asarray(w) for w in ws], [cp.asarray(y) for y in outs]
    gemv.gemv_many(gemv.gemv_table(cp, d_ws, d_outs), d_ws, cp.asarray(x), d_outs)
    gemv.gemv_many_numpy(None, ws, x, outs)
    for g, n in zip(d_outs, outs):
        assert rel_err(cp.asnumpy(g), n) < RTOL


def test_hc_weights_rows(cp, rng):
    from ds4.kernels.hyper_connection import hc_weights_rows, hc_weights_rows_numpy

    n = 4
    mix = randn(rng, 33, (2 + n) * n)
    scale, base = randn(rng, 3), randn(rng, (2 + n) * n)
    out = np.zeros((33, (2 + n) * n), np.float32)
    got, want = both(cp, hc_weights_rows, hc_weights_rows_numpy, mix, scale, base, out, n,
                     out_index=3)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-6)


def test_hc_post_rows(cp, rng):
    from ds4.kernels.hyper_connection import hc_post_rows, hc_post_rows_numpy

    S, n, D = 5, 4, 300
    X, y = randn(rng, S, n, D), randn(rng, S, D)
    post, comb = randn(rng, S, n), randn(rng, S, n, n)
    out = np.zeros((S, n, D), np.float32)
    got, want = both(cp, hc_post_rows, hc_post_rows_numpy, X, y, post, comb, out, out_index=4)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("limit", [0.0, 1.5])
def test_swiglu_rows(cp, rng, limit):
    from ds4.kernels.moe import swiglu_rows, swiglu_rows_numpy

    y, scale = randn(rng, 37, 2 * 48, scale=3.0), randn(rng, 37)
    act = np.zeros((37, 48), np.float32)
    got, want = both(cp, swiglu_rows, swiglu_rows_numpy, y, scale, act, limit, out_index=2)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-6)
