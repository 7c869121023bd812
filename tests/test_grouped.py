"""Grouped expert GEMMs on packed weights (ds4/kernels/grouped.cu): the bit tricks, the fragment
order and the whole routed MoE through the NumPy twins on CPU; the kernels against the twins
and the engine's packed prefill against NumPy on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.backend import cuda_available
from ds4.kernels import grouped, widen
from ds4.kernels.packed import E2M1, E4M3, dequant_fp4, dequant_fp8
from ds4.model import moe
from ds4.model.expert_bank import ExpertBank
from ds4.model.packed import PackedMatrix

needs_cuda = pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a) - b).max() / (np.abs(b).max() + 1e-30))


def halves(word: int) -> np.ndarray:
    return widen(np.array([word & 0xFFFF, word >> 16], np.uint16)).astype(np.float64)


def random_packed(rng, fmt: str, shape: tuple, block: int = 128) -> PackedMatrix:
    """Random codes of every value (no FP8 NaN) and E8M0 scales near 2^-6, as a checkpoint's."""
    *lead, rows, cols = shape
    if fmt == "fp4":
        codes = rng.integers(0, 256, (*lead, rows, cols // 2), dtype=np.uint8)
        scale = rng.integers(118, 124, (*lead, rows, cols // 32), dtype=np.uint8)
    else:
        codes = rng.integers(0, 256, (*lead, rows, cols), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x3E
        scale = rng.integers(118, 124, (*lead, -(-rows // block), -(-cols // block)),
                             dtype=np.uint8)
    return PackedMatrix(fmt, codes, scale, cols, (block, block))


def test_fp4_bit_trick_is_the_value_times_2_to_the_minus_126():
    for byte in range(256):  # nibble pairs (i, i + 4) of a word: codes `byte & 15`, `byte >> 4`
        q = [(byte & 15) | ((byte >> 4) << 16)] * 4
        b0, _ = grouped.decode_numpy("fp4", q, 0, 0)
        want = np.array([E2M1[byte & 15], E2M1[byte >> 4]]) * 2.0 ** -126
        assert (halves(b0) == want).all(), byte


def test_fp8_bit_trick_is_the_value_times_2_to_the_minus_120():
    for code in range(256):
        if code & 0x7F == 0x7F:  # E4M3 NaN: no checkpoint holds it
            continue
        b0, b1 = grouped.decode_numpy("fp8", [code | (code << 8), 0, 0, 0], 0, 0)
        assert halves(b0)[0] == E4M3[code] * 2.0 ** -120, code
        assert halves(b1)[0] == E4M3[code] * 2.0 ** -120, code


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_fragment_order_of_weights_and_activations_agrees(fmt):
    """Emulate one 128-column stage lane by lane as mma.sync pairs the fragments: the sum of
    a-halves times decoded b-halves over 8 k-steps and 4 lanes is the row's dot product."""
    rng = np.random.default_rng(1)
    a = widen(rng.integers(0, 1 << 16, 128).astype(np.uint16) & 0xBFFF)  # bf16, hi only
    w = random_packed(rng, fmt, (1, 128))
    w.scale[...] = 127  # scale 1: the dot product of the values
    units = grouped.split_words_numpy(a[None], grouped.new_words(np, 1, 128), parts=1)[0]
    code_words = np.asarray(w.codes).reshape(-1).view("<u4")
    per_lane = 4 if fmt == "fp4" else 8
    total = 0.0
    for s in range(8):
        j, h = s >> 1, s & 1
        for t in range(4):
            ax, ay = (int(v) for v in units[grouped._unit(j, h, 0, t)])
            b0, b1 = grouped.decode_numpy(fmt, code_words[per_lane * t:], j, h)
            total += halves(ax) @ halves(b0) + halves(ay) @ halves(b1)
    dense = dequant_fp4(w.codes, w.scale) if fmt == "fp4" else dequant_fp8(w.codes, w.scale, 128)
    total *= 2.0 ** (126 if fmt == "fp4" else 120)
    assert total == pytest.approx(float(a.astype(np.float64) @ dense[0]), rel=1e-12)


def test_split_words_keep_fp32_class_values_and_zero_the_padding():
    x = np.random.default_rng(2).standard_normal((5, 200)).astype(np.float32)
    words = grouped.split_words_numpy(x, grouped.new_words(np, 5, 200))
    assert words.shape == (5, 2 * grouped.UNITS, 2)
    assert rel_err(grouped.words_values(words, 200), x) < 2e-5
    assert not grouped.words_values(words, 256)[:, 200:].any()
    one = grouped.split_words_numpy(x, grouped.new_words(np, 5, 200), parts=1)
    assert 1e-5 < rel_err(grouped.words_values(one, 200), x) < 1e-2  # hi only: one rounding


def test_wgmma_order_holds_every_column_once_with_the_same_words():
    """The wgmma words permute a stage's 128 columns (each once) and hold the very hi and lo
    words of the mma.sync order: their values read back the same, bit for bit."""
    assert sorted(grouped.WG_COLUMNS.ravel().tolist()) == list(range(128))
    x = np.random.default_rng(2).standard_normal((5, 200)).astype(np.float32)
    for parts in (1, 2):
        wg = grouped.split_words_wg_numpy(x, grouped.new_words(np, 5, 200, wg=True), parts)
        old = grouped.split_words_numpy(x, grouped.new_words(np, 5, 200), parts)
        np.testing.assert_array_equal(grouped.words_values(wg, 200),
                                      grouped.words_values(old, 200))
    assert not grouped.words_values(wg, 256)[:, 200:].any()


def test_routed_twin_in_wgmma_order_gives_the_same_bits():
    gate_up, down = experts("fp4", 8, 256, 128)
    x, ids, weights = routing(40, 8, 6, 256)
    want = grouped.routed(np, gate_up, down, x, ids, weights, 7.0, wg=False)
    got = grouped.routed(np, gate_up, down, x, ids, weights, 7.0, wg=True)
    np.testing.assert_array_equal(got, want)


def test_expert_tiles_cover_every_row_once_in_expert_order():
    counts = np.array([0, 17, 3, 0, 64, 1], np.int64)
    tiles = np.zeros((grouped.max_tiles(int(counts.sum()), 6, 16), 4), np.int32)
    n = np.zeros(1, np.int32)
    grouped.expert_tiles_numpy(counts, 16, tiles, n)
    got = tiles[: n[0]]
    assert got[:, 0].tolist() == [1, 1, 2, 4, 4, 4, 4, 5]
    assert (got[:, 2] <= 16).all() and got[:, 2].sum() == counts.sum()
    assert (np.diff(got[:, 1]) == got[:-1, 2]).all()


class _Cfg:
    def __init__(self, inter: int, limit: float = 7.0):
        self.moe_intermediate_size, self.swiglu_limit = inter, limit


def experts(fmt: str, E: int, D: int, inter: int, seed: int = 4, block: int = 128):
    rng = np.random.default_rng(seed)
    return (random_packed(rng, fmt, (E, 2 * inter, D), block),
            random_packed(rng, fmt, (E, D, inter), block))


def routing(S: int, E: int, k: int, D: int, seed: int = 5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((S, D)).astype(np.float32)
    ids = np.argsort(rng.random((S, E)), axis=1)[:, :k]
    return x, ids, rng.random((S, k)).astype(np.float32)


@pytest.mark.parametrize("fmt,E,D,inter,S,k,block", [
    ("fp4", 5, 96, 64, 7, 3, 128), ("fp8", 4, 160, 96, 9, 2, 32), ("fp4", 8, 256, 128, 40, 6, 128)])
def test_routed_twin_equals_the_per_expert_loop(fmt, E, D, inter, S, k, block):
    """Odd shapes: columns off the 128-column stage, partial tiles, experts nobody picked."""
    gate_up, down = experts(fmt, E, D, inter, block=block)
    x, ids, weights = routing(S, E, k, D)
    want = moe._routed_many(np, _Cfg(inter), ExpertBank.from_stacks(np, gate_up, down), x, ids,
                            weights, ids)
    got = grouped.routed(np, gate_up, down, x, ids, weights, 7.0)
    assert rel_err(got, want) < 3e-5


def test_fits_takes_kernel_ready_packed_experts_only():
    gate_up, down = experts("fp4", 2, 64, 32)
    assert grouped.fits(gate_up, 64) and grouped.fits(down, 32)
    assert not grouped.fits(gate_up, 96)
    hot = PackedMatrix("fp4", gate_up.codes, np.full_like(gate_up.scale, 200), 64)
    assert not grouped.fits(hot, 64)  # a scale the folded bf16 factor cannot hold
    assert not grouped.fits(np.zeros((2, 64, 64), np.uint16), 64)


# --- GPU: the kernels against their twins, the engine against NumPy ---------------------------


def _on_device(cp, m: PackedMatrix) -> PackedMatrix:
    return PackedMatrix(m.fmt, cp.asarray(m.codes), cp.asarray(m.scale), m.shape[-1], m.block)


@pytest.mark.gpu
@needs_cuda
def test_expert_counts_on_the_device_equal_bincount():
    """The device count (no host round trip) gives bincount's figures; id E, a skipped pick,
    is not counted."""
    import cupy as cp

    flat = np.random.default_rng(3).integers(0, 9, 5000)
    want = np.bincount(flat, minlength=9)[:8].tolist()
    assert grouped.expert_counts(cp, cp.asarray(flat), 8).get().tolist() == want
    assert grouped.expert_counts(np, flat, 8).tolist() == want


@pytest.mark.gpu
@needs_cuda
def _tiles(xp, ids, E: int, mt: int, tiles_of):
    flat = ids.reshape(-1)
    order = (np.argsort(flat, kind="stable") if xp is np else xp.argsort(flat)).astype(xp.int32)
    counts = xp.bincount(flat, minlength=E).astype(xp.int64)
    tiles = xp.zeros((grouped.max_tiles(flat.size, E, 16 * mt), 4), xp.int32)
    n = xp.zeros(1, xp.int32)
    tiles_of(counts, 16 * mt, tiles, n)
    return order, tiles, n


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt,E,D,inter,S,k,block,parts", [
    ("fp4", 5, 96, 64, 7, 3, 128, 2), ("fp8", 4, 160, 96, 9, 2, 32, 2),
    ("fp4", 9, 256, 160, 70, 6, 128, 1), ("fp8", 6, 384, 128, 33, 4, 128, 2)])
@pytest.mark.parametrize("mt,variant", [(1, ""), (4, ""), (1, "s4"), (2, "s4")])
def test_kernels_equal_their_twins(fmt, E, D, inter, S, k, block, parts, mt, variant):
    """Each launch against its twin on the same inputs: words bit for bit, the tile table
    exactly, gate/up and down within fp32 summation noise."""
    import cupy as cp

    if variant and fmt != "fp4":
        pytest.skip("the variants are built for FP4 only")
    gate_up, down = experts(fmt, E, D, inter, block=block)
    dev_up, dev_down = _on_device(cp, gate_up), _on_device(cp, down)
    x, ids, weights = routing(S, E, k, D)
    words = grouped.split_words(cp.asarray(x), grouped.new_words(cp, S, D), parts)
    want_words = grouped.split_words_numpy(x, grouped.new_words(np, S, D), parts)
    assert (cp.asnumpy(words) == want_words).all()
    order, tiles, n = _tiles(np, ids, E, mt, grouped.expert_tiles_numpy)
    d_order, d_tiles, d_n = _tiles(cp, cp.asarray(ids), E, mt, grouped.expert_tiles)
    assert int(d_n[0]) == n[0] and (cp.asnumpy(d_tiles)[: n[0]] == tiles[: n[0]]).all()
    assert (cp.asnumpy(d_order) == order).all()
    wts = weights.reshape(-1)
    act = grouped.gate_up_numpy(gate_up, want_words, order, k, wts, tiles, n, mt,
                                np.empty((S * k, inter), np.float32), 7.0, parts)
    got = grouped.gate_up(dev_up, words, d_order, k, cp.asarray(wts), d_tiles, d_n, mt,
                          cp.empty((S * k, inter), cp.float32), 7.0, parts, variant)
    assert rel_err(cp.asnumpy(got), act) < 2e-5
    act_words = grouped.split_words_numpy(act, grouped.new_words(np, S * k, inter), parts)
    want = grouped.gemm_numpy(down, act_words, order, tiles, n, mt,
                              np.empty((S * k, D), np.float32), parts)
    got = grouped.gemm(dev_down, cp.asarray(act_words), d_order, d_tiles, d_n, mt,
                       cp.empty((S * k, D), cp.float32), parts, variant)
    assert rel_err(cp.asnumpy(got), want) < 2e-5


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("E,D,inter,S,k,parts", [
    (5, 96, 64, 7, 3, 2), (9, 256, 160, 70, 6, 1), (6, 384, 320, 90, 4, 2)])
@pytest.mark.parametrize("mt", [1, 4])
def test_wgmma_kernels_equal_their_twins(E, D, inter, S, k, parts, mt):
    """grouped_wg.cu (compute capability 9.0 only) against the twins: its words bit for bit,
    gate/up and down within fp32 summation noise, on odd shapes (partial stages and bands,
    tiles of 1..64 rows)."""
    import cupy as cp

    if not grouped.builds_here("grouped_wg"):
        pytest.skip("wgmma needs a compute capability 9.0 device")
    gate_up, down = experts("fp4", E, D, inter)
    dev_up, dev_down = _on_device(cp, gate_up), _on_device(cp, down)
    x, ids, weights = routing(S, E, k, D)
    words = grouped.split_words_wg(cp.asarray(x), grouped.new_words(cp, S, D, True), parts)
    want_words = grouped.split_words_wg_numpy(x, grouped.new_words(np, S, D, True), parts)
    assert (cp.asnumpy(words) == want_words).all()
    order, tiles, n = _tiles(np, ids, E, mt, grouped.expert_tiles_numpy)
    d_order, d_tiles, d_n = _tiles(cp, cp.asarray(ids), E, mt, grouped.expert_tiles)
    wts = weights.reshape(-1)
    act = grouped.gate_up_numpy(gate_up, want_words, order, k, wts, tiles, n, mt,
                                np.empty((S * k, inter), np.float32), 7.0, parts)
    got = grouped.gate_up(dev_up, words, d_order, k, cp.asarray(wts), d_tiles, d_n, mt,
                          cp.empty((S * k, inter), cp.float32), 7.0, parts)
    assert rel_err(cp.asnumpy(got), act) < 2e-5
    act_words = grouped.split_words_wg_numpy(act, grouped.new_words(np, S * k, inter, True),
                                             parts)
    want = grouped.gemm_numpy(down, act_words, order, tiles, n, mt,
                              np.empty((S * k, D), np.float32), parts)
    got = grouped.gemm(dev_down, cp.asarray(act_words), d_order, d_tiles, d_n, mt,
                       cp.empty((S * k, D), cp.float32), parts)
    assert rel_err(cp.asnumpy(got), want) < 2e-5


@pytest.mark.gpu
@needs_cuda
def test_routed_on_wgmma_matches_the_mma_sync_kernels():
    """The default routed path (wgmma on an H100/H200) against grouped.cu's kernels at Flash
    widths: the same products, within fp32 summation noise."""
    import cupy as cp

    if not grouped.wgmma_ready(experts("fp4", 1, 64, 32)[0]):
        pytest.skip("wgmma needs a compute capability 9.0 device (and DS4_WGMMA not 0)")
    gate_up, down = (_on_device(cp, m) for m in experts("fp4", 32, 4096, 2048))
    x, ids, weights = (cp.asarray(a) for a in routing(700, 32, 6, 4096))
    want = grouped.routed(cp, gate_up, down, x, ids, weights, 7.0, wg=False)
    got = grouped.routed(cp, gate_up, down, x, ids, weights, 7.0)
    assert rel_err(cp.asnumpy(got), cp.asnumpy(want)) < 1e-5


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt,code", [("fp4", 0x11), ("fp8", 0x01)])
def test_subnormal_codes_survive_the_scale_multiply(fmt, code):
    """FP4 +-0.5 and the smallest FP8 subnormal decode to bf16 subnormals (value * 2^-126 or
    2^-120) before the scale multiply: they must come out exact, not flushed to zero."""
    import cupy as cp

    w = random_packed(np.random.default_rng(6), fmt, (1, 16, 128))
    w.codes[...] = code
    x = np.ones((3, 128), np.float32)
    order, tiles, n = _tiles(np, np.zeros((3, 1), np.int64), 1, 1, grouped.expert_tiles_numpy)
    words = grouped.split_words_numpy(x, grouped.new_words(np, 3, 128))
    want = grouped.gemm_numpy(w, words, order, tiles, n, 1, np.empty((3, 16), np.float32))
    got = grouped.gemm(_on_device(cp, w), cp.asarray(words), cp.asarray(order),
                       cp.asarray(tiles), cp.asarray(n), 1, cp.empty((3, 16), cp.float32))
    assert np.abs(want).min() > 0
    np.testing.assert_array_equal(cp.asnumpy(got), want)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_flash_sized_experts_match_the_widened_products(fmt):
    """Hidden 4096, expert intermediate 2048, top-6 over 64 experts, 300 tokens: the grouped
    kernels against the current path (a widened bf16 slab per expert, cuBLAS on the hi + lo
    rows) within the bf16x2 tolerance of the GPU prefill tests."""
    import cupy as cp

    E, D, inter, S, k = 64, 4096, 2048, 300, 6
    gate_up, down = (_on_device(cp, m) for m in experts(fmt, E, D, inter))
    x, ids, weights = (cp.asarray(a) for a in routing(S, E, k, D))
    bank = ExpertBank.from_stacks(cp, gate_up, down)
    cfg = _Cfg(inter)
    got = grouped.routed(cp, gate_up, down, x, ids, weights, cfg.swiglu_limit)
    saved, moe.GROUPED_KERNELS = moe.GROUPED_KERNELS, False
    try:
        want = moe._routed_grouped(cp, cfg, bank, x, ids, weights, cp.asnumpy)
    finally:
        moe.GROUPED_KERNELS = saved
    assert rel_err(cp.asnumpy(got), cp.asnumpy(want)) < 3e-5
    again = grouped.routed(cp, gate_up, down, x, ids, weights, cfg.swiglu_limit)
    assert (cp.asnumpy(again) == cp.asnumpy(got)).all()  # no atomics: the same bits every run


@pytest.fixture(scope="module")
def official_tiny(tmp_path_factory):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path_factory.mktemp("official") / "tiny"
    subprocess.run([sys.executable, str(root / "tools" / "make_official.py"), "tiny", str(out),
                    "--shard-mb", "8"], check=True, cwd=root, capture_output=True)
    return out


@pytest.mark.gpu
@needs_cuda
def test_packed_prefill_logits_through_the_grouped_kernels(monkeypatch, official_tiny):
    """The official-format tiny model's prefill on CuPy takes the grouped kernels for its FP4
    experts and still gives the NumPy engine's logits (test_packed_gpu's tolerance)."""
    from ds4.engine import Engine

    calls = []
    real = grouped.routed
    monkeypatch.setattr(grouped, "routed", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ids = [0] + list(range(7, 4000, 41))
    logits = {}
    for backend in ("cupy", "numpy"):
        s = Engine.open(official_tiny, backend=backend, prefill_chunk=16,
                        quantize=False).new_session(256)
        logits[backend] = np.stack([s.sync(ids[:37]), s.sync(ids[:70])])
    assert calls, "the packed experts did not take the grouped kernels"
    np.testing.assert_allclose(logits["cupy"], logits["numpy"], atol=2e-4, rtol=0)
