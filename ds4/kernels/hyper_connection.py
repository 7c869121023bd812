"""Hyper-connection launchers (ds4/kernels/hyper_connection.cu, the decode unit hc_unit.cu) and
their NumPy twins."""

from __future__ import annotations

import functools

import numpy as np

from ds4.kernels import f32, i32, kernel, launch, ptr, resident_blocks, widen
from ds4.kernels.gemv import weight_kind
from ds4.kernels.norm import rms_norm_numpy


def embed_streams(embed, token, X):
    """X[i] = embed[token[0]] for every stream i (embed: bf16 words or fp32 [vocab, D]);
    X [B, streams, D] with token [B]: each member's own token."""
    batch, (streams, D) = _batch(X), X.shape[-2:]
    launch("hyper_connection", "embed_streams_" + weight_kind(embed), ((D + 255) // 256, 1, batch),
           (256,), (ptr(embed), ptr(token), ptr(X), i32(D), i32(streams)))
    return X


def _batch(X) -> int:
    """Members of a batch in residual streams X ([B, streams, D]; [streams, D] is one)."""
    return 1 if X.ndim == 2 else X.shape[0]


def embed_streams_numpy(embed, token, X):
    """NumPy twin of embed_streams."""
    if X.ndim == 3:
        for b in range(X.shape[0]):
            embed_streams_numpy(embed, token[b:b + 1], X[b])
        return X
    X[...] = widen(embed[int(np.asarray(token)[0])])[None, :]
    return X


def hc_mix(fn, X, mix, eps: float = 1e-6):
    """mix = (fn @ flatten(X)) * rsqrt(mean(X^2) + eps) for fp32 fn [n_mix, streams * D];
    X [B, streams, D] with mix [B, >= n_mix]: each member's own."""
    n_mix, width = fn.shape
    launch("hyper_connection", "hc_mix", (n_mix, 1, _batch(X)), (512,),
           (ptr(fn), ptr(X), ptr(mix), i32(width), f32(eps), i32(mix.shape[-1])))
    return mix


def hc_mix_numpy(fn, X, mix, eps: float = 1e-6):
    """NumPy twin of hc_mix."""
    if X.ndim == 3:
        for b in range(X.shape[0]):
            hc_mix_numpy(fn, X[b], mix[b, :fn.shape[0]], eps)
        return mix
    x = np.asarray(X, np.float32).reshape(-1)
    mix[...] = (fn @ x) / np.sqrt((x * x).mean() + np.float32(eps))
    return mix


def hc_pre(mix, scale, base, X, u, post_comb, iters: int = 20, eps: float = 1e-6,
           head: bool = False):
    """u = sum_i pre_i X[i]; post_comb = [post (n), comb (n*n)] unless head (pre only).
    X [B, streams, D]: every operand [B, ...], mix [B, n] for the head, else [B, (2 + n) n]."""
    streams, D = X.shape[-2:]
    args = (ptr(mix), ptr(scale), ptr(base), ptr(X), ptr(u), ptr(post_comb), i32(D),
            i32(streams), i32(iters), f32(eps), i32(int(head)))
    launch("hyper_connection", "hc_pre", ((D + 255) // 256, 1, _batch(X)), (256,), args)
    return u


def hc_weights_numpy(mix, scale, base, n: int, iters: int, eps: float):
    """pre [n], post [n] and the Sinkhorn comb [n, n] from one mix vector."""
    def sig(v):
        return 1.0 / (1.0 + np.exp(-v))

    pre = sig(mix[:n] * scale[0] + base[:n]) + eps
    post = 2.0 * sig(mix[n:2 * n] * scale[1] + base[n:2 * n])
    c = (mix[2 * n:2 * n + n * n] * scale[2] + base[2 * n:2 * n + n * n]).reshape(n, n)
    c = np.exp(c - c.max(axis=1, keepdims=True))
    c = c / c.sum(axis=1, keepdims=True) + eps
    c = c / (c.sum(axis=0, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(axis=1, keepdims=True) + eps)
        c = c / (c.sum(axis=0, keepdims=True) + eps)
    return pre.astype(np.float32), post.astype(np.float32), c.astype(np.float32)


def hc_pre_numpy(mix, scale, base, X, u, post_comb, iters: int = 20, eps: float = 1e-6,
                 head: bool = False):
    """NumPy twin of hc_pre."""
    if X.ndim == 3:
        for b in range(X.shape[0]):
            hc_pre_numpy(mix[b], scale, base, X[b], u[b], post_comb[b], iters, eps, head)
        return u
    n = X.shape[0]
    if head:
        pre = 1.0 / (1.0 + np.exp(-(mix[:n] * scale[0] + base[:n]))) + eps
    else:
        pre, post, comb = hc_weights_numpy(mix, scale, base, n, iters, eps)
        post_comb[:n] = post
        post_comb[n:n + n * n] = comb.reshape(-1)
    u[...] = (pre[:, None] * X).sum(axis=0)
    return u


def hc_weights_rows(mix, scale, base, out, n: int, iters: int = 20, eps: float = 1e-6):
    """out[r] = [pre (n), post (n), comb (n*n)] of each row of mix [rows, (2 + n) * n]."""
    rows = mix.shape[0]
    args = (ptr(mix), ptr(scale), ptr(base), ptr(out), i32(rows), i32(n), i32(iters), f32(eps))
    launch("hyper_connection", "hc_weights_rows", ((rows + 127) // 128,), (128,), args)
    return out


def hc_weights_rows_numpy(mix, scale, base, out, n: int, iters: int = 20, eps: float = 1e-6):
    """NumPy twin of hc_weights_rows."""
    for r in range(mix.shape[0]):
        pre, post, comb = hc_weights_numpy(mix[r], scale, base, n, iters, eps)
        out[r] = np.concatenate([pre, post, comb.reshape(-1)])
    return out


def hc_post(X, y, post_comb, out):
    """out[j] = post[j] * y + sum_i comb[i, j] X[i]; out may be X. X [B, streams, D]: every
    operand [B, ...]."""
    streams, D = X.shape[-2:]
    launch("hyper_connection", "hc_post", ((D + 255) // 256, 1, _batch(X)), (256,),
           (ptr(X), ptr(y), ptr(post_comb), ptr(out), i32(D), i32(streams)))
    return out


def hc_post_numpy(X, y, post_comb, out):
    """NumPy twin of hc_post."""
    if X.ndim == 3:
        for b in range(X.shape[0]):
            hc_post_numpy(X[b], y[b], post_comb[b], out[b])
        return out
    n = X.shape[0]
    comb = np.asarray(post_comb[n:n + n * n]).reshape(n, n)
    out[...] = post_comb[:n, None] * y[None, :] + comb.T @ X
    return out


def hc_post_rows(X, y, post, comb, out):
    """out[r, j] = post[r, j] * y[r] + sum_i comb[r, i, j] X[r, i] for X [rows, n, D]."""
    rows, n, D = X.shape
    launch("hyper_connection", "hc_post_rows", ((D + 255) // 256, rows), (256,),
           (ptr(X), ptr(y), ptr(post), ptr(comb), ptr(out), i32(D), i32(n)))
    return out


def hc_post_rows_numpy(X, y, post, comb, out):
    """NumPy twin of hc_post_rows: hc_post's twin on each token."""
    for r in range(X.shape[0]):
        hc_post_numpy(X[r], y[r], np.concatenate([post[r], comb[r].reshape(-1)]), out[r])
    return out


def hc_pre_norm(mix, scale, base, X, norm_w, h, post_comb, iters: int = 20, eps: float = 1e-6,
                norm_eps: float = 1e-6):
    """h = RMSNorm_w(sum_i pre_i X[i]) in one launch; post_comb as hc_pre (D <= MAX_D).
    X [B, streams, D]: every operand [B, ...] (mix [B, (2 + n) n])."""
    streams, D = X.shape[-2:]
    assert D <= MAX_D
    args = (ptr(mix), ptr(scale), ptr(base), ptr(X), ptr(norm_w), ptr(h), ptr(post_comb), i32(D),
            i32(streams), i32(iters), f32(eps), f32(norm_eps))
    launch("hyper_connection", "hc_pre_norm", (1, 1, _batch(X)), (1024,), args)
    return h


def hc_pre_norm_numpy(mix, scale, base, X, norm_w, h, post_comb, iters: int = 20,
                      eps: float = 1e-6, norm_eps: float = 1e-6):
    """NumPy twin of hc_pre_norm."""
    if X.ndim == 3:
        for b in range(X.shape[0]):
            hc_pre_norm_numpy(mix[b], scale, base, X[b], norm_w, h[b], post_comb[b], iters, eps,
                              norm_eps)
        return h
    u = hc_pre_numpy(mix, scale, base, X, np.empty(X.shape[1], np.float32), post_comb, iters, eps)
    h[...] = u / np.sqrt((u * u).mean() + np.float32(norm_eps)) * norm_w
    return h


MAX_D, SLICE, MAX_MIX, UNIT_STREAMS = 8192, 128, 40, 4  # hyper_connection.cuh, hc_unit.cu
UNIT_THREADS = 256
GRAM = UNIT_STREAMS * (UNIT_STREAMS + 1) // 2  # hc_unit.cu: the streams' products a slice


def unit_fits(n_mix: int, streams: int, D: int) -> bool:
    """True where hc_unit takes a unit: n_mix partial sums a slice beside the streams' products
    and sum(X^2), up to four streams, D in float4 quads and at most MAX_D (how many members a
    launch takes: member_groups)."""
    return (n_mix <= MAX_MIX - 1 - GRAM and streams <= UNIT_STREAMS and D <= MAX_D
            and D % 4 == 0)


def unit_scratch(xp, batch: int, D: int) -> tuple:
    """hc_unit's partial sums [batch, slices, MAX_MIX] and per-member counts [batch, 2] (zero:
    the last block of a launch resets its member's)."""
    slices = -(-D // SLICE)
    return xp.zeros((batch, slices, MAX_MIX), xp.float32), xp.zeros((batch, 2), xp.uint32)


def hc_unit(X, y, prev, fn, scale, base, norm_w, mix, h, scratch, iters: int = 20,
            eps: float = 1e-6, mix_eps: float = 1e-6, norm_eps: float = 1e-6):
    """Decode at an mHC unit boundary, one launch: X = hc_post(X, y) in place when y is given
    (the previous unit's output), with that unit's post and comb computed in the launch from
    prev = (its mix [B, >= (2 + n) n], its scale, its base); then this unit's hc_mix(fn, X, mix,
    mix_eps) and h = RMSNorm_w(sum_i pre_i X[i]) (the output head's unit: fn [n, n D], mix [B,
    n]). X [B, streams, D]: every operand [B, ...]. (A device too small to hold every member's
    blocks at once gets one launch per group of members that fits.)"""
    streams, D = X.shape[-2:]
    n_mix = fn.shape[0]
    assert unit_fits(n_mix, streams, D) and fn.shape[1] == streams * D
    assert (y is None) == (prev is None), "the previous unit's mix comes with its output"
    part, done = scratch
    blocks, batch = part.shape[1], _batch(X)  # the slices
    prev_mix, prev_scale, prev_base = prev if prev is not None else (None, None, None)
    for m0, m1 in member_groups(batch, blocks, unit_capacity()):
        at = (lambda a: a) if X.ndim == 2 else (lambda a, m0=m0, m1=m1: a[m0:m1])
        args = (ptr(at(X)), ptr(None if y is None else at(y)),
                ptr(None if prev_mix is None else at(prev_mix)), ptr(prev_scale),
                ptr(prev_base), i32(0 if prev_mix is None else prev_mix.shape[-1]), ptr(fn),
                ptr(scale), ptr(base), ptr(norm_w), ptr(at(mix)), ptr(at(h)), ptr(at(part)),
                ptr(at(done)), i32(D), i32(streams), i32(n_mix), i32(mix.shape[-1]),
                i32(iters), f32(eps), f32(mix_eps), f32(norm_eps))
        launch("hc_unit", "hc_unit", (blocks, 1, m1 - m0), (UNIT_THREADS,), args)
    return h


def member_groups(batch: int, blocks: int, capacity: int) -> list[tuple[int, int]]:
    """Members [m0, m1) of each hc_unit launch: as many as have all their `blocks` resident
    at once on a device that holds `capacity` of them (a member's blocks spin until all of
    them have met, so a launch whose blocks cannot all be resident could wait forever)."""
    assert blocks <= capacity, "one member's hc_unit blocks must fit on the device at once"
    per = capacity // blocks
    return [(m, min(m + per, batch)) for m in range(0, batch, per)]


@functools.cache
def unit_capacity() -> int:
    """hc_unit blocks the current device holds at once."""
    return resident_blocks(kernel("hc_unit", "hc_unit"), UNIT_THREADS)


def hc_unit_numpy(X, y, prev, fn, scale, base, norm_w, mix, h, scratch, iters: int = 20,
                  eps: float = 1e-6, mix_eps: float = 1e-6, norm_eps: float = 1e-6):
    """NumPy twin of hc_unit: the previous unit's post and comb from its mix (hc_weights'
    twin), hc_post's and hc_mix's twins, then pre and the RMSNorm."""
    n = X.shape[-2]
    if y is not None:
        prev_mix, prev_scale, prev_base = prev
        rows = np.reshape(prev_mix, (-1, prev_mix.shape[-1]))
        post_comb = np.stack([np.concatenate([post, comb.reshape(-1)]) for post, comb in
                              (hc_weights_numpy(m, prev_scale, prev_base, n, iters, eps)[1:]
                               for m in rows)])
        hc_post_numpy(X, y, post_comb.reshape(*np.shape(prev_mix)[:-1], -1), X)
    hc_mix_numpy(fn, X, mix, mix_eps)
    pre = 1.0 / (1.0 + np.exp(-(mix[..., :n] * scale[0] + base[:n]))) + eps
    u = (pre[..., None] * X).sum(axis=-2)
    return rms_norm_numpy(u, norm_w, h, norm_eps)
