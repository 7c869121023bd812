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


WARP_ROW_MAX = 4 * 32 * 16  # floats of a row rms_norm_warp takes (WARP_PIECES in the .cu)


def rms_norm_rows(x, w, out, eps: float = 1e-6):
    """rms_norm for many short rows: one warp a row where the rows are 16-byte pieces of at most
    WARP_ROW_MAX floats (prefill's norms), else one block a row (rms_norm)."""
    rows, n = x.shape
    arrays = [a for a in (x, w, out) if a is not None]
    if n % 4 or n > WARP_ROW_MAX or any(a.data.ptr % 16 for a in arrays) or rows == 0:
        return rms_norm(x, w, out, eps)
    warps = 8
    launch("norm", "rms_norm_warp", (-(-rows // warps),), (32 * warps,),
           (ptr(x), ptr(w), ptr(out), i32(rows), i32(n), f32(eps)))
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
