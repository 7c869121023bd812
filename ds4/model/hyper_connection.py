"""mHC hyper-connections and the final HyperHead, fp32 (docs/MODEL.md, Hyper-connections)."""

from __future__ import annotations

import functools

import numpy as np


def rms_scale(xp, x, eps: float):
    """rsqrt(mean(x^2) + eps) over the last axis, keepdims."""
    if xp is np:
        squares = (x * x).sum(axis=-1, keepdims=True)
    else:  # one read, no x * x array (the mHC streams are 134 MB at a 2048-token chunk)
        squares = _sum_squares(xp)(x, axis=-1, keepdims=True)
    return 1.0 / xp.sqrt(squares * (1.0 / x.shape[-1]) + eps)


@functools.cache
def _sum_squares(cp):
    """A CuPy reduction: sum of x^2 along an axis in one pass."""
    return cp.ReductionKernel("float32 x", "float32 y", "x * x", "a + b", "y = a", "0",
                              "ds4_sum_squares")


def rms_norm(xp, x, w, eps: float):
    """x * rsqrt(mean(x^2) + eps) * w over the last axis (w None: unweighted)."""
    if xp is not np:  # one pass in one kernel instead of five over the array
        from ds4.kernels.norm import rms_norm as rms_norm_kernel

        rows = xp.ascontiguousarray(x, dtype=xp.float32).reshape(-1, x.shape[-1])
        return rms_norm_kernel(rows, w, xp.empty_like(rows), eps).reshape(x.shape)
    y = x * rms_scale(xp, x, eps)
    return y if w is None else y * w


def sigmoid(xp, x):
    """Logistic function."""
    return 1.0 / (1.0 + xp.exp(-x))


def hc_weights(xp, fn, base, scale, X, iters: int, hc_eps: float, norm_eps: float):
    """(pre [S,n], post [S,n], comb [S,n,n]) of one mHC unit for streams X [S, n, D]."""
    S, n, _ = X.shape
    flat = X.reshape(S, -1)
    mix = (flat @ fn.T) * rms_scale(xp, flat, norm_eps)
    if xp is not np and n <= 8:  # one thread per token, not ~45 launches of small array ops
        from ds4.kernels.hyper_connection import hc_weights_rows

        out = hc_weights_rows(xp.ascontiguousarray(mix), scale, base,
                              xp.empty((S, (2 + n) * n), xp.float32), n, iters, hc_eps)
        return out[:, :n], out[:, n : 2 * n], out[:, 2 * n :].reshape(S, n, n)
    pre = sigmoid(xp, mix[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * sigmoid(xp, mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    logits = (mix[:, 2 * n :] * scale[2] + base[2 * n :]).reshape(S, n, n)
    logits = logits - logits.max(axis=-1, keepdims=True)
    comb = xp.exp(logits)
    comb = comb / _sum_keep(xp, comb, -1) + hc_eps
    comb /= _sum_keep(xp, comb, -2) + hc_eps
    for _ in range(iters - 1):  # Sinkhorn: rows, then columns
        comb /= _sum_keep(xp, comb, -1) + hc_eps
        comb /= _sum_keep(xp, comb, -2) + hc_eps
    return pre, post, comb


def _sum_keep(xp, a, axis: int):
    """a.sum(axis, keepdims=True). On NumPy, for a large array summed over fewer than 8 values,
    as the left-to-right adds NumPy's own loop does there (the same bits) without a reduction's
    setup a call: the Sinkhorn loop's 38 sums over a 2048-token chunk's [S, 4, 4] took ~18% of
    a long prompt's CPU prefill."""
    n = a.shape[axis]
    if xp is not np or n >= 8 or a.size < 4096:
        return a.sum(axis=axis, keepdims=True)
    parts = np.moveaxis(a, axis, 0)
    total = parts[0] + parts[1] if n > 1 else parts[0].copy()
    for i in range(2, n):
        total += parts[i]
    return np.expand_dims(total, axis)


def hc_collapse(xp, pre, X):
    """Sub-block input u = sum_i pre[i] * X[i] -> [S, D]."""
    return xp.matmul(pre[:, None, :], X)[:, 0, :]


def hc_expand(xp, X, y, post, comb):
    """New streams X'[j] = post[j] * y + sum_i comb[i, j] * X[i] (comb transposed)."""
    if xp is not np and X.shape[1] <= 8 and X.shape[0] < 65536:  # one pass, not a batched 4x4 GEMM
        from ds4.kernels.hyper_connection import hc_post_rows

        return hc_post_rows(xp.ascontiguousarray(X), xp.ascontiguousarray(y),
                            xp.ascontiguousarray(post),
                            xp.ascontiguousarray(comb), xp.empty(X.shape, xp.float32))
    return post[:, :, None] * y[:, None, :] + xp.matmul(comb.transpose(0, 2, 1), X)


def hyper_head(xp, fn, base, scale, X, hc_eps: float, norm_eps: float):
    """Final collapse of the streams X [S, n, D] before the output norm -> [S, D]."""
    S = X.shape[0]
    flat = X.reshape(S, -1)
    mix = (flat @ fn.T) * rms_scale(xp, flat, norm_eps)
    pre = sigmoid(xp, mix * scale[0] + base) + hc_eps
    return hc_collapse(xp, pre, X)
