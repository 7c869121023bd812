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
