"""The fused prefill attention (ds4/kernels/chunk_attention.cu): its NumPy twin against the model
code's softmax (ds4/model/attention.py:attend_keys), the kernel against the twin on the GPU at
V4-Flash and tiny dims, and CuPy prefill logits against the NumPy engine's.

Tolerances: the twin is fp32 like the model code (1e-5 relative, summation order only); the
kernel multiplies hi + lo bf16 words with fp32 accumulation (~2^-16 per product: 3e-5 relative,
as tests/test_gpu_prefill.py's GEMMs); engine logits 2e-4 absolute, as tests/test_gpu_engine.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4.backend import cuda_available
from ds4.kernels.chunk_attention import WIDTHS, chunk_attention_numpy, shared_bytes, words_size
from ds4.model.attention import attend_keys, window_bias
from ds4.model.forward import Step

FLASH = {"heads": 64, "width": 512, "window": 128, "topk": 512}
TINY = {"heads": 4, "width": 64, "window": 64, "topk": 16}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def unit_rows(rng, shape):
    """RMS-normed random rows, as the engine's roped queries and keys are."""
    x = rng.standard_normal(shape).astype(np.float32)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True))


def case(dims: dict, S: int, start: int, mode: str, seed: int = 0) -> dict:
    """Inputs of one layer's chunk: queries, ring + chunk keys, compressed rows and picks.

    mode: "sliding" (window only), "all" (every usable row, ratio 8) or "picked" (ratio 4, each
    query's picks among its usable rows, -1 past them)."""
    rng = np.random.default_rng(seed)
    H, d, W = dims["heads"], dims["width"], dims["window"]
    out = {"q": unit_rows(rng, (S, H, d)), "keys": unit_rows(rng, (W + S, d)), "rows": None,
           "picks": None, "ratio": 0, "start": start,
           "sinks": rng.uniform(-2, 2, H).astype(np.float32)}
    if mode == "sliding":
        return out
    ratio = 8 if mode == "all" else 4
    count = (start + S) // ratio
    out.update(rows=unit_rows(rng, (count, d)), ratio=ratio)
    if mode == "picked":
        out["picks"] = random_picks(rng, start, S, ratio, dims["topk"])
    return out


def random_picks(rng, start: int, S: int, ratio: int, k: int):
    """Per query k distinct ids among its usable rows (score order), -1 where fewer exist."""
    picks = np.full((S, k), -1, np.int64)
    for i in range(S):
        usable = (start + i + 1) // ratio
        take = min(k, usable)
        picks[i, :take] = rng.permutation(usable)[:take]
    return picks


def model_code(xp, c: dict):
    """The engine's own softmax over the same keys (ds4/model/attention.py:attend_keys)."""
    S = c["q"].shape[0]
    W = c["keys"].shape[0] - S
    positions = xp.arange(c["start"], c["start"] + S, dtype=xp.int64)
    step = Step(c["start"], positions, None, {}, window_bias(xp, c["start"], positions, W))
    return attend_keys(xp, c["q"], c["keys"], c["rows"], c["picks"], c["ratio"], step,
                       c["sinks"])


def twin(c: dict):
    out = np.empty_like(c["q"])
    return chunk_attention_numpy(c["q"], c["keys"], c["rows"], c["picks"], c["ratio"],
                                 c["start"], c["sinks"], out)


SHAPES = [(40, 0), (40, 100), (90, 300)]  # (chunk, start): i < W and i >= W, empty/full ring


@pytest.mark.parametrize("mode", ["sliding", "all", "picked"])
@pytest.mark.parametrize("S,start", SHAPES)
def test_twin_equals_the_model_code(mode, S, start):
    c = case(TINY, S, start, mode)
    assert rel_err(twin(c), model_code(np, c)) < 1e-5


def test_twin_sees_only_causal_window_rows():
    """A key row outside a query's window (older than t - W + 1, or later than t) is ignored:
    poisoning it with huge values leaves the query's output unchanged."""
    c = case(TINY, 90, 300, "sliding")
    W, want = TINY["window"], twin(c)
    i = 70  # sees chunk rows 7..70 only
    c["keys"][W + 6] = 1e3
    c["keys"][W + 71:] = 1e3
    c["keys"][:W] = 1e3  # every ring row is older than t - W + 1 for i >= W
    np.testing.assert_array_equal(twin(c)[i], want[i])


gpu = pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")


def kernel(c: dict, parts: int = 2, exact: int = 0):
    import cupy

    from ds4.kernels.chunk_attention import chunk_attention

    dev = {k: cupy.asarray(v) if isinstance(v, np.ndarray) else v for k, v in c.items()}
    words = cupy.empty(words_size(dev["keys"], dev["rows"], parts), cupy.uint16)
    out = chunk_attention(dev["q"], dev["keys"], dev["rows"], dev["picks"], dev["ratio"],
                          dev["start"], dev["sinks"], cupy.empty_like(dev["q"]), words, parts,
                          exact)
    return cupy.asnumpy(out)


def test_blocks_fit_in_shared_memory():
    """Every built head dim's block fits the 227 KiB an sm_90 block may have."""
    assert all(shared_bytes(d, p) <= 227 * 1024 for d in WIDTHS for p in (1, 2))


# (dims, chunk, start): more queries than blocks (each block walks several), i < W and i >= W,
# an empty and a full ring
KERNEL_SHAPES = [(FLASH, 200, 0), (FLASH, 300, 2000), (TINY, 300, 0), (TINY, 90, 300),
                 (TINY, 40, 0)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["sliding", "all", "picked"])
@pytest.mark.parametrize("dims,S,start", KERNEL_SHAPES)
def test_kernel_equals_its_twin(dims, S, start, mode):
    c = case(dims, S, start, mode, seed=S + start)
    got, want = kernel(c), twin(c)
    assert np.isfinite(got).all()
    assert rel_err(got, want) < 3e-5
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-4 * float(np.abs(want).max()))


def fp8_keys(c: dict, rope: int = 64) -> dict:
    """The case with its keys and rows FP8-rounded as the official KV is (the dims before the
    last `rope` ones: exact in bf16)."""
    from ds4.model.quant import kv_fp8_simulation

    for name in ("keys", "rows"):
        if c[name] is not None:
            c[name] = kv_fp8_simulation(np, c[name], rope)
    return c


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["sliding", "all", "picked"])
@pytest.mark.parametrize("dims,S,start", [(FLASH, 300, 2000), (FLASH, 200, 0),
                                          ({**TINY, "width": 128}, 90, 300)])
def test_lo_words_skipped_where_fp8_keys_make_them_zero(dims, S, start, mode):
    """With FP8-rounded keys and rows the kernel that stages and multiplies lo words only for
    the RoPE dims gives the very bits of the one that takes every dim's, and its twin's sums."""
    d = dims["width"]
    plain = case(dims, S, start, mode, seed=S + start + 1)
    # unrounded keys: their lo words matter, so the split kernel must differ (it skips them)
    assert not np.array_equal(kernel(plain, exact=d - 64), kernel(plain))
    c = fp8_keys(plain)
    got, full = kernel(c, exact=d - 64), kernel(c)
    np.testing.assert_array_equal(got, full)
    assert rel_err(got, twin(c)) < 3e-5


def test_lo_tails_only_where_built():
    """The split build is chosen only for a built (head dim, tail) with hi + lo words."""
    from ds4.kernels.chunk_attention import kernel_name

    assert kernel_name(512, 2, 448) == "chunk_attention_d512_x2_r64"
    assert kernel_name(512, 2, 0) == kernel_name(512, 2, 512 - 128) == "chunk_attention_d512_x2"
    assert kernel_name(512, 1, 448) == "chunk_attention_d512_x1"
    assert kernel_name(64, 2, 0) == "chunk_attention_d64_x2"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["sliding", "picked"])
def test_kernel_with_one_bf16_rounding_is_close_to_its_twin(mode):
    """parts = 1 (DS4_GEMM=bf16): one rounding of q, keys and p, ~3e-3 relative."""
    c = case(FLASH, 300, 2000, mode, seed=5)
    assert rel_err(kernel(c, parts=1), twin(c)) < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("chunks", [[300], [23, 150, 127]])
def test_cupy_prefill_logits_equal_the_numpy_engine(chunks):
    """The tiny model (head dim 64: the kernel's path) prefilled in chunks on CuPy: every chunk's
    last logits equal the NumPy engine's (CSA layers pick 16 of up to 75 rows, HCA sees all)."""
    import cupy
    from test_gpu_engine import TOL, open_model, prompt

    from ds4.model.state import SessionState

    ref, dev = open_model("tiny", "numpy"), open_model("tiny", "cupy")
    dev.kernel_decoder = None
    ids = prompt(ref.cfg, sum(chunks), 7)
    ref_state, dev_state = SessionState(np, ref.cfg, 512), SessionState(cupy, dev.cfg, 512)
    at = 0
    for n in chunks:
        want = np.asarray(ref.forward(ref_state, ids[at:at + n]))
        got = cupy.asnumpy(dev.forward(dev_state, ids[at:at + n]))
        at += n
        assert int(got.argmax()) == int(want.argmax())
        assert float(np.abs(got - want).max()) < TOL, f"chunk ending at {at}"
