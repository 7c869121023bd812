"""rows_moe.moe over placed experts (device + mapped host memory, per-expert address tables) and
with a batch graph's idle members: the NumPy twins on the CPU here, the kernels against them and
against the plain stack on the GPU (`-m gpu`).

What holds: a placed stack gives bitwise the plain stack's rows (the same codes read at other
addresses); the grouping puts host experts' units first (their PCIe reads start in the first
wave) without changing any row; members at or past the live count join no unit (no expert
read for them, no pick counted) and their rows are the shared expert alone; counts[e] grows by
the live picks of e; after a re-placement (tables rewritten in place) a captured graph reads
the experts where they now live."""

from __future__ import annotations

import numpy as np
import pytest
from test_kernels_rows_moe import picks, small_moe, v4_moe

from ds4.backend import cuda_available
from ds4.kernels import rows_moe as RM
from ds4.kernels import rows_moe_twin as RMT
from ds4.model.placement import PlacedStack

gpu_test = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")
LIMIT = 7.0


RESIDENT = np.array([True, False, True, True, False, False, True, False])  # of 8 experts


def case(seed: int, batch: int, k: int = 3):
    rng = np.random.default_rng(seed)
    gu, down, shared = small_moe(rng, experts=8, inter=64, hidden=128)
    idx, wts = picks(rng, batch, k, 8)
    x = rng.standard_normal((batch, 128), dtype=np.float32)
    return gu, down, shared, idx, wts, x


def twin(gu, down, shared, idx, wts, x, batch, **kw) -> np.ndarray:
    y = np.full((batch, 128), np.nan, np.float32)
    RMT.moe_numpy(gu, down, idx, wts, x, None, y, batch, 64, LIMIT, shared, **kw)
    return y


# --- the twins (CPU) ---


def test_placed_twin_is_the_plain_stacks_rows_and_counts_every_pick():
    gu, down, shared, idx, wts, x = case(1, 4)
    idx[2, 0] = idx[0, 1]  # two members sharing an expert
    placed = (PlacedStack.copy_of(np, gu, RESIDENT), PlacedStack.copy_of(np, down, RESIDENT))
    counts = np.zeros(8, np.int64)
    got = twin(*placed, shared, idx, wts, x, 4, counts=counts)
    assert np.array_equal(got, twin(gu, down, shared, idx, wts, x, 4))
    assert counts.tolist() == np.bincount(idx.ravel(), minlength=8).tolist()


def test_grouping_puts_host_experts_first_and_leaves_idle_members_out():
    idx = np.array([[1, 6, 4], [6, 0, 5], [2, 4, 7], [3, 5, 1]], np.int32)  # 4 members, k = 3
    host = ~RESIDENT  # 1, 4, 5, 7 in host memory
    counts = np.zeros(8, np.int64)
    units = RMT.moe_group_numpy(idx, 12, 3, 8, host, np.array([3], np.int32), counts)
    # host experts (ascending) then resident ones; member 3's pairs 9..11 are idle
    assert units == [(1, [0]), (4, [2, 7]), (5, [5]), (7, [8]), (0, [4]), (2, [6]), (6, [1, 3])]
    assert counts.tolist() == [1, 1, 1, 0, 2, 1, 2, 1]
    plain = RMT.moe_group_numpy(idx, 12, 3, 8)  # no flags, no live count: every pair, by id
    assert [e for e, _ in plain] == list(range(8)) and plain[3] == (3, [9])


def test_idle_members_get_the_shared_expert_alone_and_count_nothing():
    gu, down, shared, idx, wts, x = case(2, 4)
    placed = (PlacedStack.copy_of(np, gu, RESIDENT), PlacedStack.copy_of(np, down, RESIDENT))
    counts = np.zeros(8, np.int64)
    got = twin(*placed, shared, idx, wts, x, 4, counts=counts, live=np.array([2], np.int32))
    assert np.array_equal(got[:2], twin(gu, down, shared, idx[:2], wts[:2], x[:2], 2))
    for b in (2, 3):  # the idle rows: no routed part, nothing uninitialised
        assert np.array_equal(got[b], RMT._shared_numpy(shared, x[b:b + 1], LIMIT))
    assert counts.tolist() == np.bincount(idx[:2].ravel(), minlength=8).tolist()
    alone = twin(gu, down, None, idx, wts, x, 4, live=np.array([0], np.int32))
    assert not alone.any()  # no live member, no shared expert: zeros


def test_the_per_member_placed_twin_counts_live_members_only():
    """The fallback (placed.cu once per member, for formats rows_moe.cu lacks) skips idle rows'
    counts too."""
    from ds4.kernels.placed import moe_placed_numpy

    gu, down, _, idx, wts, x = case(3, 2)
    placed = (PlacedStack.copy_of(np, gu, RESIDENT), PlacedStack.copy_of(np, down, RESIDENT))
    counts, live = np.zeros(8, np.int64), np.array([1], np.int32)
    for b in range(2):
        y, act = np.zeros(128, np.float32), np.zeros((3, 64), np.float32)
        moe_placed_numpy(*placed, 64, idx[b], wts[b], x[b], act, y, LIMIT, counts, live, b)
    assert counts.tolist() == np.bincount(idx[0], minlength=8).tolist()


# --- the kernels (GPU) ---


@pytest.fixture(scope="module")
def v4_placed():
    """V4 shapes (256 FP4 experts, FP8 shared expert), the same experts as a plain stack and as
    a placed one with every third expert in mapped host memory."""
    if not cuda_available():
        pytest.skip("needs CuPy + CUDA")
    import cupy as cp

    cp.random.seed(21)
    gu, down, shared, inter, hidden = v4_moe(cp, np.random.default_rng(21))
    resident = np.arange(256) % 3 != 0
    placed = (PlacedStack.copy_of(cp, gu, resident), PlacedStack.copy_of(cp, down, resident))
    return gu, down, shared, placed


def run(cp, gu, down, shared, idx, wts, x, batch, **kw):
    scratch = RM.moe_scratch(cp, 8, idx.shape[1], 2048, 4096, 2048)
    y = cp.full((batch, 4096), cp.nan, cp.float32)
    RM.moe(gu, down, cp.asarray(idx[:batch]), cp.asarray(wts[:batch]), cp.asarray(x[:batch]),
           scratch, y, batch, 2048, 10.0, shared, **kw)
    return y, scratch


@gpu_test
@needs_cuda
def test_placed_kernel_rows_are_the_plain_stacks_bitwise_in_any_batch(v4_placed):
    import cupy as cp

    gu, down, shared, placed = v4_placed
    rng = np.random.default_rng(22)
    idx, wts = picks(rng, 8, 6, 256)
    idx[3, :3] = idx[0, :3]
    x = rng.standard_normal((8, 4096), dtype=np.float32)
    alone = cp.concatenate([run(cp, gu, down, shared, idx[b:], wts[b:], x[b:], 1)[0]
                            for b in range(8)])
    for batch in (1, 2, 4, 8):
        counts = cp.zeros(256, cp.int32)
        y, _ = run(cp, *placed, shared, idx, wts, x, batch, counts=counts)
        assert cp.array_equal(y, alone[:batch]), batch
        assert counts.get().tolist() == np.bincount(idx[:batch].ravel(), minlength=256).tolist()
    want = np.zeros((2, 4096), np.float32)
    RMT.moe_numpy(*placed, idx[:2], wts[:2], x[:2], None, want, 2, 2048, 10.0, shared)
    assert np.allclose(alone[:2].get(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@gpu_test
@needs_cuda
def test_the_kernels_grouping_equals_its_twin_host_experts_first(v4_placed):
    import cupy as cp

    _, _, shared, placed = v4_placed
    rng = np.random.default_rng(23)
    idx, wts = picks(rng, 8, 6, 256)
    x = rng.standard_normal((8, 4096), dtype=np.float32)
    for live in (8, 5, 0):
        counts = cp.zeros(256, cp.int32)
        y, scratch = run(cp, *placed, shared, idx, wts, x, 8, counts=counts,
                         live=cp.asarray([live], cp.int32))
        want_counts = np.zeros(256, np.int64)
        units = RMT.moe_group_numpy(idx, 48, 6, 256, RMT.host_flags(placed[0]),
                                   np.array([live]), want_counts)
        assert RMT.units_of(scratch.units) == units, live
        assert counts.get().tolist() == want_counts.tolist()
        host = [not placed[0].resident[e] for e, _ in units]
        assert host == sorted(host, reverse=True)  # host experts' units first
        assert bool(cp.isfinite(y).all())  # idle rows hold the shared expert, not garbage


@gpu_test
@needs_cuda
def test_idle_members_rows_are_the_shared_expert_and_live_rows_unchanged(v4_placed):
    import cupy as cp

    gu, down, shared, placed = v4_placed
    rng = np.random.default_rng(24)
    idx, wts = picks(rng, 4, 6, 256)
    x = rng.standard_normal((4, 4096), dtype=np.float32)
    full, _ = run(cp, *placed, shared, idx, wts, x, 4)
    part, _ = run(cp, *placed, shared, idx, wts, x, 4, live=cp.asarray([3], cp.int32))
    assert cp.array_equal(part[:3], full[:3])
    zero_w = np.zeros_like(wts)  # routed products times weight 0: the shared expert alone
    only_shared, _ = run(cp, gu, down, shared, idx, zero_w, x, 4)
    np.testing.assert_allclose(part[3].get(), only_shared[3].get(), rtol=0, atol=1e-6)


@gpu_test
@needs_cuda
def test_a_captured_graph_follows_a_re_placement_and_keeps_counting(v4_placed):
    import cupy as cp

    gu, down, shared, placed = v4_placed
    rng = np.random.default_rng(25)
    idx_h, wts_h = picks(rng, 4, 6, 256)
    away = [e for e in np.nonzero(~placed[0].resident)[0] if e not in idx_h[0]]
    idx_h[0, 0] = away[0]  # a host expert, moved onto the device below
    idx, wts = cp.asarray(idx_h), cp.asarray(wts_h)
    x = cp.asarray(rng.standard_normal((4, 4096), dtype=np.float32))
    scratch = RM.moe_scratch(cp, 4, 6, 2048, 4096, 2048)
    y, counts = cp.zeros((4, 4096), cp.float32), cp.zeros(256, cp.int32)
    live = cp.zeros(1, cp.int32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        def step():
            RM.moe(*placed, idx, wts, x, scratch, y, 4, 2048, 10.0, shared, counts=counts,
                   live=live)

        live.fill(4)
        step()
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        going = int(np.nonzero(placed[0].resident)[0][0])
        coming = int(idx_h[0, 0])
        for s in placed:  # what ExpertPlacement.replace does between steps
            s.swap(going, coming)
        live.fill(3)
        counts.fill(0)
        graph.launch(stream)
        stream.synchronize()
    want, _ = run(cp, gu, down, shared, idx_h, wts_h, x.get(), 3)
    assert cp.array_equal(y[:3], want)
    assert counts.get().tolist() == np.bincount(idx_h[:3].ravel(), minlength=256).tolist()
    assert placed[0].resident[coming] and not placed[0].resident[going]
    for s in placed:
        s.swap(coming, going)  # back as the fixture had it


@gpu_test
@needs_cuda
def test_the_per_member_placed_kernel_counts_live_members_only(v4_placed):
    import cupy as cp

    from ds4.kernels import placed as kernels

    placed = v4_placed[3]
    rng = np.random.default_rng(26)
    idx, wts = picks(rng, 2, 6, 256)
    x = rng.standard_normal((2, 4096), dtype=np.float32)
    counts, live = cp.zeros(256, cp.int32), cp.asarray([1], cp.int32)
    for b in range(2):
        y, act = cp.zeros(4096, cp.float32), cp.zeros((6, 2048), cp.float32)
        kernels.moe_placed(*placed, 2048, cp.asarray(idx[b]), cp.asarray(wts[b]),
                           cp.asarray(x[b]), act, y, 10.0, counts, live, b)
    assert counts.get().tolist() == np.bincount(idx[0], minlength=256).tolist()
