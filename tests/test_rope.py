"""RoPE far into the context: the cos/sin tables and the rotated heads at positions beyond 100k
match a float64 reference written from the YaRN formula, tightly enough that forming the
angles in float32 (an error of up to ~0.03 rad at position 1e6) fails."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ds4.backend import cuda_available
from ds4.model.config import RopeSpec
from ds4.model.rope import Rope, inverse_frequencies

# V4-Flash's compressed-attention rope, and a plain one with a cos/sin magnitude factor
FLASH_YARN = RopeSpec(theta=160000.0, rope_type="yarn", factor=16.0,
                      original_max_position_embeddings=65536, attention_factor=0.75)
PLAIN = RopeSpec(theta=10000.0)
FAR = np.array([0, 1, 100_003, 262_143, 777_777, 1_048_575])


def yarn_reference(spec: RopeSpec, dim: int) -> np.ndarray:
    """Inverse frequencies of YaRN in float64: interpolated (divided by factor) above the
    correction range, extrapolated below it, a linear ramp across it."""
    pos_freqs = spec.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if spec.rope_type != "yarn":
        return 1.0 / pos_freqs

    def dim_of(rotations: float) -> float:
        wavelength_ratio = spec.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelength_ratio) / (2 * math.log(spec.theta))

    low, high = dim_of(spec.beta_fast), dim_of(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    return (1.0 / (spec.factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * (1 - ramp)


YARN_VARIANTS = {
    "flash": FLASH_YARN,
    "plain": PLAIN,
    "untruncated": RopeSpec(theta=10000.0, rope_type="yarn", factor=8.0,
                            original_max_position_embeddings=4096, truncate=False),
    "zero-width ramp": RopeSpec(theta=10000.0, rope_type="yarn", factor=4.0,
                                original_max_position_embeddings=4096, beta_fast=8.0,
                                beta_slow=8.0, truncate=False),
    "clamped low": RopeSpec(theta=10000.0, rope_type="yarn", factor=4.0,
                            original_max_position_embeddings=64, beta_slow=1e-3),
    "clamped high": RopeSpec(theta=10000.0, rope_type="yarn", factor=4.0,
                             original_max_position_embeddings=65536, beta_slow=1e-5),
}


@pytest.mark.parametrize("spec", YARN_VARIANTS.values(), ids=YARN_VARIANTS.keys())
def test_inverse_frequencies_follow_the_reference(spec):
    got = inverse_frequencies(spec, 64)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, yarn_reference(spec, 64), rtol=1e-14)


@pytest.mark.parametrize("spec", [FLASH_YARN, PLAIN], ids=["yarn", "plain"])
def test_cos_sin_far_into_the_context_match_float64(spec):
    cos, sin = Rope(np, spec, 64).cos_sin(FAR)
    assert cos.dtype == sin.dtype == np.float32
    angles = FAR[:, None].astype(np.float64) * yarn_reference(spec, 64)[None, :]
    scale = spec.attention_factor
    # float32 rounding of the result is 6e-8; float32 angles are off by up to 3e-2 here
    np.testing.assert_allclose(cos, np.cos(angles) * scale, rtol=0, atol=2e-7)
    np.testing.assert_allclose(sin, np.sin(angles) * scale, rtol=0, atol=2e-7)


def rotate_reference(x: np.ndarray, positions: np.ndarray, spec: RopeSpec, rope_dim: int):
    """The trailing rope_dim channels as complex pairs (2k + i 2k+1) times e^(i angle)."""
    angles = positions[:, None].astype(np.float64) * yarn_reference(spec, rope_dim)[None, :]
    tail = x[..., -rope_dim:].astype(np.float64)
    pairs = (tail[..., 0::2] + 1j * tail[..., 1::2]) * (np.exp(1j * angles)[:, None, :]
                                                        * spec.attention_factor)
    out = x.astype(np.float64)
    out[..., -rope_dim::2], out[..., -rope_dim + 1::2] = pairs.real, pairs.imag
    return out


def test_heads_rotated_far_into_the_context_match_float64():
    rope = Rope(np, FLASH_YARN, 64)
    x = np.random.default_rng(1).standard_normal((FAR.size, 3, 96)).astype(np.float32)
    got = rope.apply(x, *rope.cos_sin(FAR))
    np.testing.assert_allclose(got, rotate_reference(x, FAR, FLASH_YARN, 64), rtol=0, atol=2e-6)
    back = rope.apply(got, *Rope(np, PLAIN, 64).cos_sin(FAR), inverse=True)
    assert not np.allclose(back, x, atol=1e-2)  # another table does not undo it
    plain = Rope(np, PLAIN, 64)
    restored = plain.apply(plain.apply(x, *plain.cos_sin(FAR)), *plain.cos_sin(FAR), inverse=True)
    np.testing.assert_allclose(restored, x, atol=2e-5)


def test_attention_scores_depend_only_on_the_distance_even_past_a_million():
    # what attention sees: q.k of tokens 7 apart is the same at position 10 and at 1e6
    rope = Rope(np, PLAIN, 64)
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((2, 1, 1, 64)).astype(np.float32)
    pos = np.array([17, 10, 1_000_007, 1_000_000])
    cos, sin = rope.cos_sin(pos)
    rq = rope.apply(np.repeat(q, 4, 0), cos, sin)[:, 0]
    rk = rope.apply(np.repeat(k, 4, 0), cos, sin)[:, 0]
    near, far = float(rq[0] @ rk[1]), float(rq[2] @ rk[3])
    assert abs(near - far) < 1e-4 * (1 + abs(near))


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")
def test_the_gpu_kernel_rotates_far_positions_as_float64_does():
    import cupy

    from ds4.kernels.rope import rope_tail

    x = np.random.default_rng(3).standard_normal((FAR.size, 96)).astype(np.float32)
    got = rope_tail(cupy.asarray(x), cupy.asarray(FAR, dtype=cupy.int32),
                    cupy.asarray(yarn_reference(PLAIN, 64)), 64)
    want = rotate_reference(x[:, None, :], FAR, PLAIN, 64)[:, 0]
    np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=0, atol=2e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")
@pytest.mark.parametrize("shape,view", [((37, 96), None), ((37, 5, 96), None),
                                        ((37, 5, 128), (slice(None), slice(1, 4), slice(0, 96))),
                                        ((37, 1, 96), None)])
@pytest.mark.parametrize("inverse", [False, True])
def test_prefill_rotation_in_one_launch_keeps_the_array_ops_bits(shape, view, inverse,
                                                                 monkeypatch):
    """Rope.rotate on the GPU (one rope_rows launch) gives the bits of its array operations,
    also on a strided view of a wider array, and leaves the channels outside the view alone."""
    import cupy

    from ds4.model import rope as rope_module

    rope = Rope(cupy, PLAIN, 64)
    pos = cupy.asarray(np.arange(1000, 1037) * 977)
    cos, sin = rope.cos_sin(pos)
    base = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    out, real = {}, rope_module._one_launch
    for one_launch in (True, False):
        monkeypatch.setattr(rope_module, "_one_launch",
                            lambda x, c, keep=one_launch: keep and real(x, c))
        x = cupy.asarray(base)
        rope.rotate(x if view is None else x[view], cos, sin, inverse)
        out[one_launch] = cupy.asnumpy(x)
    np.testing.assert_array_equal(out[True], out[False])
    assert not np.array_equal(out[True], base)
