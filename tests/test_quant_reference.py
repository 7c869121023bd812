"""The quantization simulation against independent implementations: ml_dtypes' float8_e4m3fn and
float4_e2m1fn casts for the roundings, scipy's Hadamard matrix for the indexer rotation, and a
quantised model whose logits equal those of the same model running these references (and
move by ~0.1 when the rotation or a rounding step is dropped)."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from scipy.linalg import hadamard as scipy_hadamard

from ds4.engine import Engine
from ds4.model import quant

FIXTURE = Path(__file__).parent / "fixtures" / "v4_csa_hca"
E4M3, E2M1 = ml_dtypes.float8_e4m3fn, ml_dtypes.float4_e2m1fn


def cast(x: np.ndarray, dtype) -> np.ndarray:
    """x rounded through an ml_dtypes format (nearest, ties to even) and back to fp32."""
    return x.astype(dtype).astype(np.float32)


def e4m3_grid() -> np.ndarray:
    """Every finite E4M3 value (from its 256 bit patterns), the midpoints between neighbours
    (ties) and points a quarter step either side of each, as fp32."""
    values = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    values = np.unique(values[np.isfinite(values)])
    mids = (values[1:] + values[:-1]) / 2
    quarter = (values[1:] - values[:-1]) / 4
    return np.concatenate([values, mids, mids - quarter, mids + quarter]).astype(np.float32)


def test_e4m3_rounding_matches_ml_dtypes_on_every_value_and_tie():
    x = e4m3_grid()
    np.testing.assert_array_equal(quant.round_e4m3(np, x), cast(x, E4M3))
    wide = np.random.default_rng(0).standard_normal(20000).astype(np.float32)
    wide *= np.exp2(np.random.default_rng(1).integers(-12, 9, wide.size)).astype(np.float32)
    wide = np.clip(wide, -448, 448)  # beyond the largest value ml_dtypes gives NaN, ds4 saturates
    np.testing.assert_array_equal(quant.round_e4m3(np, wide), cast(wide, E4M3))


def test_e2m1_rounding_matches_ml_dtypes_on_every_value_and_tie():
    values = np.unique(cast(np.linspace(-6, 6, 1201, dtype=np.float32), E2M1))
    assert values.tolist() == sorted({s * v for v in quant.FP4_VALUES for s in (1, -1)})
    mids = (values[1:] + values[:-1]) / 2
    x = np.concatenate([values, mids, np.nextafter(mids, np.float32(-7)),
                        np.nextafter(mids, np.float32(7))]).astype(np.float32)
    np.testing.assert_array_equal(quant.round_e2m1(np, x), cast(x, E2M1))


def test_saturation_past_the_largest_value():
    big = np.array([449.0, 1e4, -3e5], np.float32)
    np.testing.assert_array_equal(quant.round_e4m3(np, big), [448.0, 448.0, -448.0])
    np.testing.assert_array_equal(quant.round_e2m1(np, np.float32([6.5, -100.0])), [6.0, -6.0])


def blocks_reference(x: np.ndarray, block: int, dtype, max_value: float, floor: float):
    """Per block: scale 2^ceil(log2(amax / max)), cast through the format, scale back."""
    b = x.reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(b).max(axis=-1, keepdims=True), floor)
    scale = np.exp2(np.ceil(np.log2(amax / max_value))).astype(np.float32)
    return (cast(b / scale, dtype) * scale).reshape(x.shape)


def spread_rows(shape: tuple[int, ...], block: int, seed: int) -> np.ndarray:
    """Random rows whose blocks differ in magnitude by up to 2^+-10 (one all-zero block)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    mags = np.exp2(rng.integers(-10, 11, (*shape[:-1], shape[-1] // block))).astype(np.float32)
    x = (x.reshape(*shape[:-1], -1, block) * mags[..., None]).reshape(shape)
    x[0, :block] = 0.0
    return x


def test_fp8_blocks_match_the_reference_round_trip():
    x = spread_rows((6, 256), 64, seed=2)
    np.testing.assert_array_equal(quant.fp8_round_blocks(np, x),
                                  blocks_reference(x, 64, E4M3, 448.0, 1e-4))


def test_fp4_blocks_match_the_reference_round_trip():
    x = spread_rows((6, 128), 32, seed=3)
    np.testing.assert_array_equal(quant.fp4_round_blocks(np, x),
                                  blocks_reference(x, 32, E2M1, 6.0, 1e-30))


@pytest.mark.parametrize("n", [16, 64, 128])
def test_hadamard_is_scipys_normalised(n):
    np.testing.assert_array_equal(quant.hadamard(n),
                                  (scipy_hadamard(n) / np.sqrt(n)).astype(np.float32))


def kv_reference(xp, rows, rope_dim: int):
    """FP8 blocks of 64 (or one block) on the channels before the rope slice."""
    nope = rows.shape[-1] - rope_dim
    out = rows.copy()
    out[..., :nope] = blocks_reference(rows[..., :nope], 64 if nope % 64 == 0 else nope,
                                       E4M3, 448.0, 1e-4)
    return out


def indexer_reference(xp, rows, hadamard_matrix=None):
    """scipy's Hadamard rotation (whatever matrix the model passes), then FP4 blocks of 32."""
    n = rows.shape[-1]
    rotated = rows @ (scipy_hadamard(n) / np.sqrt(n)).astype(np.float32)
    return blocks_reference(rotated, 32 if n % 32 == 0 else n, E2M1, 6.0, 1e-30)


@pytest.mark.parametrize("width, rope_dim", [(192, 64), (112, 64)])
def test_kv_simulation_matches_the_reference(width, rope_dim):
    nope = width - rope_dim  # 128: two blocks of 64; 48: one block of all of them
    rope = np.random.default_rng(6).standard_normal((5, rope_dim)).astype(np.float32) * 300
    rows = np.concatenate([spread_rows((5, nope), 64 if nope % 64 == 0 else nope, 4), rope], -1)
    np.testing.assert_array_equal(quant.kv_fp8_simulation(np, rows, rope_dim),
                                  kv_reference(np, rows, rope_dim))


@pytest.mark.parametrize("width", [16, 64])
def test_indexer_simulation_rotates_then_rounds(width):
    rows = np.random.default_rng(5).standard_normal((7, 3, width)).astype(np.float32)
    got = quant.indexer_fp4_simulation(np, rows, quant.hadamard(width))
    np.testing.assert_array_equal(got, indexer_reference(np, rows))
    unrotated = blocks_reference(rows, 32 if width % 32 == 0 else width, E2M1, 6.0, 1e-30)
    assert np.abs(got - unrotated).max() > 0.5  # the rotation is not a no-op on the codes


def quantised_logits(ids: list[int]) -> np.ndarray:
    return Engine.open(FIXTURE, backend="numpy", quantize=True).new_session(128).sync(ids)


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return np.load(FIXTURE / "ref.npz")["ids"][:90].tolist()


def test_a_quantised_model_equals_one_running_the_references(ids, monkeypatch):
    got = quantised_logits(ids)
    monkeypatch.setattr(quant, "kv_fp8_simulation", kv_reference)
    monkeypatch.setattr(quant, "indexer_fp4_simulation", indexer_reference)
    np.testing.assert_allclose(got, quantised_logits(ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dropped", ["rotation", "indexer rounding", "kv rounding"])
def test_dropping_a_step_moves_the_logits(ids, monkeypatch, dropped):
    # the pieces above matter at model level: the indexer picks other blocks, KV moves ~1%
    want = quantised_logits(ids)
    if dropped == "rotation":
        monkeypatch.setattr(quant, "hadamard", lambda n: np.eye(n, dtype=np.float32))
    elif dropped == "indexer rounding":
        monkeypatch.setattr(quant, "indexer_fp4_simulation", lambda xp, rows, **_: rows)
    else:
        monkeypatch.setattr(quant, "kv_fp8_simulation", lambda xp, rows, **_: rows)
    assert np.abs(quantised_logits(ids) - want).max() > 0.03
