"""Interleaved partial RoPE on a head's last channels, plain or YaRN (docs/MODEL.md, Attention)."""

from __future__ import annotations

import math

import numpy as np

from ds4.model.config import RopeSpec


def inverse_frequencies(spec: RopeSpec, rope_dim: int) -> np.ndarray:
    """f_k for the rope_dim/2 pairs (float64), YaRN-blended when the RopeSpec says so."""
    base = spec.theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    extrapolation = 1.0 / base
    if spec.rope_type != "yarn":
        return extrapolation
    interpolation = 1.0 / (spec.factor * base)
    low, high = _correction_range(spec, rope_dim)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return interpolation * ramp + extrapolation * (1.0 - ramp)


def _correction_range(spec: RopeSpec, dim: int) -> tuple[float, float]:
    def corr(rotations: float) -> float:
        ctx = spec.original_max_position_embeddings
        return dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    low, high = corr(spec.beta_fast), corr(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


class Rope:
    """cos/sin tables of one rope kind, applied to the trailing rope_dim channels."""

    def __init__(self, xp, spec: RopeSpec, rope_dim: int):
        self.xp = xp
        self.rope_dim = rope_dim
        self.factor = spec.attention_factor
        self.inv_freq = xp.asarray(inverse_frequencies(spec, rope_dim))

    def cos_sin(self, positions):
        """(cos, sin) [S, rope_dim/2] fp32 for integer positions [S]; angles formed in float64."""
        angles = positions.astype(self.xp.float64)[:, None] * self.inv_freq[None, :]
        cos = (self.xp.cos(angles) * self.factor).astype(self.xp.float32)
        sin = (self.xp.sin(angles) * self.factor).astype(self.xp.float32)
        return cos, sin

    def apply(self, x, cos, sin, inverse: bool = False):
        """`rotate` on a copy of x: x itself is left as it was."""
        return self.rotate(x.copy(), cos, sin, inverse)

    def rotate(self, x, cos, sin, inverse: bool = False):
        """Rotate pairs (2k, 2k+1) of the trailing slice of x [S, ..., d] in place; returns x.

        cos/sin are [S, rope_dim/2] and broadcast over any middle axes (heads). Only the rope
        slice is read and written (an eighth of a V4 head), which is why the model code
        rotates the arrays it has just made instead of copying them whole.
        """
        if self.xp is not np and _one_launch(x, cos):  # ~8 array ops and their temporaries
            from ds4.kernels.rope import rope_rows

            cos, sin = (self.xp.ascontiguousarray(t, dtype=np.float32) for t in (cos, sin))
            return rope_rows(x, cos, sin, self.rope_dim, -1.0 if inverse else 1.0)
        if inverse:
            sin = -sin
        shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
        cos, sin = cos.reshape(shape), sin.reshape(shape)
        a = x[..., -self.rope_dim :: 2]
        b = x[..., -self.rope_dim + 1 :: 2]
        even, odd = a * cos - b * sin, a * sin + b * cos
        a[...] = even
        b[...] = odd
        return x


def _one_launch(x, cos) -> bool:
    """Whether rope_rows takes x: fp32 [S, width] or [S, mid, width] with contiguous channels and
    non-negative strides, one table row a row of x."""
    return (x.dtype == np.float32 and x.ndim in (2, 3) and x.strides[-1] == 4
            and min(x.strides) >= 0 and cos.ndim == 2 and cos.shape[0] == x.shape[0] > 0)
