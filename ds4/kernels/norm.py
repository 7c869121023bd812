"""RMSNorm launcher (ds4/kernels/norm.cu) and its NumPy twin."""

from __future__ import annotations

import numpy as np

from ds4.kernels import f32, i32, launch, ptr


def rms_norm(x, w, out, eps: float = 1e-6):
    """out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w for x [rows, n]; w None = unweighted."""
    rows, n = x.shape
    block = min(1024, max(32, (n + 31) // 32 * 32))
    launch("norm", "rms_norm", (rows,), (block,), (ptr(x), ptr(w), ptr(out), i32(n), f32(eps)))
    return out


def rms_norm_numpy(x, w, out, eps: float = 1e-6):
    """NumPy twin of rms_norm."""
    x = np.asarray(x, dtype=np.float32)
    r = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + np.float32(eps))
    out[...] = x * r * (1.0 if w is None else w)
    return out


def rms_norm_rope(x, w, eps: float, pos, freqs, rope_dim: int, rows_per_pos: int = 1):
    """x[r] = rope(RMSNorm_w(x[r])) in place, row r at position pos[r // rows_per_pos]: rms_norm
    then ds4/kernels/rope.py's rope_tail in one launch."""
    rows, n = x.shape
    block = min(1024, max(32, (n + 31) // 32 * 32))
    launch("norm", "rms_norm_rope", (rows,), (block,),
           (ptr(x), ptr(w), i32(n), f32(eps), ptr(pos), ptr(freqs), i32(rope_dim),
            i32(rows_per_pos)), shared=4 * n)
    return x


def rms_norm_rope_numpy(x, w, eps: float, pos, freqs, rope_dim: int, rows_per_pos: int = 1):
    """NumPy twin of rms_norm_rope."""
    from ds4.kernels.rope import rope_tail_numpy

    rms_norm_numpy(x, w, x, eps)
    return rope_tail_numpy(x, pos, freqs, rope_dim, rows_per_pos)
