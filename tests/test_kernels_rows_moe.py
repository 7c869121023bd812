"""The MoE on tensor cores (ds4/kernels/rows_moe.py): its NumPy twin against the packed expert
twins on CPU, and on the GPU the kernels against the twin at V4-Flash shapes, a token's row
bitwise the same in any batch and launch shape, and graph replay = eager."""

from __future__ import annotations

import numpy as np
import pytest
from test_kernels_rows import MAKERS, device_case, fp8_matrix, gpu_test, on_device

from ds4.backend import cuda_available
from ds4.kernels import packed as P
from ds4.kernels import rows as R
from ds4.kernels import rows_moe as RM
from ds4.kernels import rows_moe_twin as RMT
from ds4.model.packed import FP4, FP8, PackedMatrix


def small_moe(rng, fmt=FP4, experts=8, inter=64, hidden=128, shared_fmt=FP8):
    """Experts with checkpoint-like scales (weights below ~0.2, so SwiGLU is not saturated)."""
    def make(f, shape):
        return MAKERS[f](rng, shape) if f == "bf16" else MAKERS[f](rng, shape, lo=112, hi=122)

    gu, down = make(fmt, (experts, 2 * inter, hidden)), make(fmt, (experts, hidden, inter))
    shared = (make(shared_fmt, (inter, hidden)), make(shared_fmt, (inter, hidden)),
              make(shared_fmt, (hidden, inter)))
    return gu, down, shared


def picks(rng, batch, k, experts):
    idx = np.stack([rng.choice(experts, k, replace=False) for _ in range(batch)])
    wts = rng.uniform(0.1, 0.5, (batch, k)).astype(np.float32)
    return idx.astype(np.int32), wts


def test_moe_twin_matches_the_packed_expert_twins():
    rng = np.random.default_rng(4)
    inter, hidden, k, batch, limit = 64, 128, 3, 4, 10.0
    gu, down, shared = small_moe(rng, inter=inter, hidden=hidden)
    idx, wts = picks(rng, batch, k, 8)
    x = rng.standard_normal((batch, hidden), dtype=np.float32)
    y = np.zeros((batch, hidden), np.float32)
    RMT.moe_numpy(gu, down, idx, wts, x, None, y, batch, inter, limit, shared)
    for b in range(batch):
        act = np.zeros((k, inter), np.float32)
        P.moe_gate_up_fp4_numpy(gu.codes[:, :inter], gu.scale[:, :inter], gu.codes[:, inter:],
                                gu.scale[:, inter:], idx[b], wts[b], x[b], act, limit)
        ref = np.zeros(hidden, np.float32)
        P.moe_down_fp4_numpy(down.codes, down.scale, idx[b], act, ref)
        sact = np.zeros((1, inter), np.float32)
        g, u, d = shared
        P.moe_gate_up_fp8_numpy(g.codes, g.scale, u.codes, u.scale, 128, None, None, x[b],
                                sact, limit)
        P.moe_down_fp8_numpy(d.codes, d.scale, 128, None, sact, ref, accumulate=True)
        assert np.allclose(y[b], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def v4_moe(cp, rng):
    """256 experts of 2 x 2048 x 4096 (FP4) and an FP8 shared expert, on the device."""
    experts, inter, hidden = 256, 2048, 4096
    codes = cp.random.randint(0, 256, (experts, 2 * inter, hidden // 2), dtype=cp.int32)
    scale = cp.random.randint(112, 122, (experts, 2 * inter, hidden // 32), dtype=cp.int32)
    gu = PackedMatrix(FP4, codes.astype(cp.uint8), scale.astype(cp.uint8), hidden)
    del codes, scale
    codes = cp.random.randint(0, 256, (experts, hidden, inter // 2), dtype=cp.int32)
    scale = cp.random.randint(112, 122, (experts, hidden, inter // 32), dtype=cp.int32)
    down = PackedMatrix(FP4, codes.astype(cp.uint8), scale.astype(cp.uint8), inter)
    shared = tuple(on_device(cp, fp8_matrix(rng, s, lo=112, hi=122)) for s in
                   ((inter, hidden), (inter, hidden), (hidden, inter)))
    return gu, down, shared, inter, hidden


def make_moe_case():
    """The V4 experts of the MoE tests (skips without CuPy + CUDA)."""
    if not cuda_available():
        pytest.skip("needs CuPy + CUDA")
    import cupy as cp

    cp.random.seed(8)
    return v4_moe(cp, np.random.default_rng(8))


@pytest.fixture(scope="module")
def moe_case():
    return make_moe_case()


def run_moe(cp, case, idx, wts, x, batch, shared=True, words=True, ahead=False, **kw):
    """rows_moe.moe's y for the first `batch` tokens (ahead: the shared expert launched first
    on a side stream, rows_moe.shared_ahead)."""
    gu, down, sh, inter, hidden = case
    scratch = RM.moe_scratch(cp, 8, idx.shape[1], inter, hidden, inter)
    if not words:  # the kernels that split x themselves
        scratch.words = scratch.act_words = None
    y = cp.zeros((batch, hidden), cp.float32)
    idx, x = cp.asarray(idx[:batch]), cp.asarray(x[:batch])
    if ahead:
        kw["shared_done"] = RM.shared_ahead(gu, down, idx, x, scratch, batch, inter, 10.0, sh,
                                            cp.cuda.Stream(non_blocking=True))
        assert kw["shared_done"] is not None
    RM.moe(gu, down, idx, cp.asarray(wts[:batch]), x, scratch, y, batch, inter, 10.0,
           sh if shared else None, **kw)
    return y


@gpu_test
def test_moe_kernel_matches_twin_at_v4_shapes(moe_case):
    import cupy as cp

    rng = np.random.default_rng(9)
    idx, wts = picks(rng, 8, 6, 256)
    idx[1, 2] = idx[0, 0]  # two tokens sharing an expert
    crowded(idx)
    x = rng.standard_normal((8, 4096), dtype=np.float32)
    gu, down, sh, inter, _ = moe_case
    for batch in (2, 8):
        y = run_moe(cp, moe_case, idx, wts, x, batch).get()
        want = np.zeros((batch, 4096), np.float32)
        RMT.moe_numpy(gu, down, idx[:batch], wts[:batch], x[:batch], None, want, batch, inter,
                     10.0, sh)
        assert np.allclose(y, want, rtol=1e-4, atol=1e-4 * np.abs(want).max()), batch


def crowded(idx) -> None:
    """Tokens 2..7 all pick one expert (slot 5): a unit of 6 tokens, two passes of the
    kernels (4 columns a pass)."""
    e = next(e for e in range(256) if e not in idx[:, :5])
    idx[2:, 5] = e


@gpu_test
def test_moe_row_is_bitwise_the_same_in_any_batch(moe_case, monkeypatch):
    import cupy as cp

    rng = np.random.default_rng(10)
    idx, wts = picks(rng, 8, 6, 256)
    idx[3, :3] = idx[0, :3]  # overlapping picks
    crowded(idx)
    x = rng.standard_normal((8, 4096), dtype=np.float32)
    alone = cp.concatenate([run_moe(cp, moe_case, idx[b:b + 1], wts[b:b + 1], x[b:b + 1], 1)
                            for b in range(8)])
    for batch in (2, 4, 8):
        assert cp.array_equal(run_moe(cp, moe_case, idx, wts, x, batch), alone[:batch])
    # other launch shapes, the same sums: a persistent grid, the shared expert in launches of
    # its own, or first on a side stream
    for kw in ({"persistent": True}, {"fuse_shared": False}, {"ahead": True}):
        assert cp.array_equal(run_moe(cp, moe_case, idx, wts, x, 8, **kw), alone)
        assert cp.array_equal(run_moe(cp, moe_case, idx, wts, x, 1, **kw), alone[:1])
    routed = cp.concatenate([run_moe(cp, moe_case, idx[b:b + 1], wts[b:b + 1], x[b:b + 1], 1,
                                     shared=False) for b in range(8)])
    assert cp.array_equal(run_moe(cp, moe_case, idx, wts, x, 8, shared=False), routed)
    # blocks of 4 or 2 warps (ITEM_WARPS): the same rows and sums in more items
    for warps in (4, 2):
        monkeypatch.setattr(RM, "ITEM_WARPS", warps)
        for kw in ({}, {"persistent": True}, {"ahead": True}):
            assert cp.array_equal(run_moe(cp, moe_case, idx, wts, x, 8, **kw), alone)
            assert cp.array_equal(run_moe(cp, moe_case, idx, wts, x, 1, **kw), alone[:1])
        assert cp.array_equal(run_moe(cp, moe_case, idx, wts, x, 8, shared=False), routed)


@gpu_test
@pytest.mark.parametrize("fmt,shared_fmt", [(FP8, FP8), ("bf16", "bf16"), (FP4, "bf16")])
def test_small_moe_kernel_matches_twin(fmt, shared_fmt):
    import cupy as cp

    rng = np.random.default_rng(11)
    gu, down, shared = small_moe(rng, fmt, experts=8, inter=128, hidden=256,
                                 shared_fmt=shared_fmt)
    idx, wts = picks(rng, 5, 3, 8)
    x = rng.standard_normal((5, 256), dtype=np.float32)
    dev = [on_device(cp, m) for m in (gu, down, *shared)]
    scratch = RM.moe_scratch(cp, 5, 3, 128, 256, 128)
    y = cp.zeros((5, 256), cp.float32)
    RM.moe(dev[0], dev[1], cp.asarray(idx), cp.asarray(wts), cp.asarray(x), scratch, y, 5, 128,
          7.0, tuple(dev[2:]))
    want = np.zeros((5, 256), np.float32)
    RMT.moe_numpy(gu, down, idx, wts, x, None, want, 5, 128, 7.0, shared)
    assert np.allclose(y.get(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@gpu_test
def test_graph_replay_equals_eager(moe_case):
    import cupy as cp

    rng = np.random.default_rng(12)
    _, w, x, _ = device_case(cp, "q_a", seed=12)
    gu, down, sh, inter, hidden = moe_case
    xd, y = cp.asarray(x[:4]), cp.zeros((4, 1024), cp.float32)
    idx, wts = (cp.asarray(a[:4]) for a in picks(rng, 4, 6, 256))
    h = cp.asarray(rng.standard_normal((4, hidden), dtype=np.float32))
    scratch, ym = RM.moe_scratch(cp, 4, 6, inter, hidden, inter), cp.zeros((4, hidden), cp.float32)

    def step():
        R.matvec(w, xd, y, 4)
        RM.moe(gu, down, idx, wts, h, scratch, ym, 4, inter, 10.0, sh)

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        step()
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        xd[...] = cp.asarray(rng.standard_normal((4, 4096), dtype=np.float32))
        idx[...] = cp.asarray(picks(rng, 4, 6, 256)[0])
        graph.launch(stream)
        stream.synchronize()
        got = (y.copy(), ym.copy())
        step()
        stream.synchronize()
    assert cp.array_equal(got[0], y) and cp.array_equal(got[1], ym)
