"""RoPE launcher (ds4/kernels/rope.cu) and its NumPy twin."""

from __future__ import annotations

import numpy as np

from ds4.kernels import f32, i32, launch, ptr


def rope_tail(x, pos, freqs, rope_dim: int, rows_per_pos: int = 1, pos_offset: int = 0,
              sign: float = 1.0):
    """Rotate interleaved pairs of the last rope_dim channels of x [rows, width] in place
    (freqs: float64 [rope_dim/2])."""
    rows, width = x.shape
    total = rows * (rope_dim // 2)
    args = (ptr(x), ptr(pos), ptr(freqs), i32(rows), i32(width), i32(rope_dim),
            i32(rows_per_pos), i32(pos_offset), f32(sign))
    launch("rope", "rope_tail", ((total + 255) // 256,), (256,), args)
    return x


def rope_rows(x, cos, sin, rope_dim: int, sign: float = 1.0):
    """Rotate the trailing rope_dim channels of x [rows, width] or [rows, mid, width] (fp32,
    channels contiguous, any row and mid strides) in place by cos/sin [rows, rope_dim/2] (fp32,
    contiguous): rotate_numpy's arithmetic and bits in one launch."""
    x3 = x if x.ndim == 3 else x[:, None, :]
    rows, mid, width = x3.shape
    total = rows * mid * (rope_dim // 2)
    args = (ptr(x), np.int64(x3.strides[0] // 4), np.int64(x3.strides[1] // 4), i32(rows),
            i32(mid), i32(width), i32(rope_dim), ptr(cos), ptr(sin), f32(sign))
    launch("rope", "rope_rows", (max(1, min((total + 255) // 256, 1 << 16)),), (256,), args)
    return x


def rope_angles_numpy(positions, freqs):
    """fp32 cos and sin of the float64 angles positions x freqs, as the kernels form them."""
    angle = np.asarray(positions, dtype=np.float64)[:, None] * np.asarray(freqs, np.float64)
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def rotate_numpy(x, cos, sin, rope_dim: int, sign: float = 1.0):
    """Rotate the trailing rope_dim channels of rows x by per-row cos/sin [rows, rope_dim/2]."""
    first = x.shape[-1] - rope_dim
    a, b = x[..., first::2].copy(), x[..., first + 1::2].copy()
    s = sin * np.float32(sign)
    x[..., first::2] = a * cos - b * s
    x[..., first + 1::2] = a * s + b * cos
    return x


def rope_tail_numpy(x, pos, freqs, rope_dim: int, rows_per_pos: int = 1, pos_offset: int = 0,
                    sign: float = 1.0):
    """NumPy twin of rope_tail."""
    rows = x.shape[0]
    positions = np.asarray(pos)[np.arange(rows) // rows_per_pos] + pos_offset
    cos, sin = rope_angles_numpy(positions, freqs)
    return rotate_numpy(x, cos, sin, rope_dim, sign)
