"""Prefill attention of a chunk on tensor cores (ds4/kernels/chunk_attention.cu), and its twin.

Query i of a chunk (position start + i) attends with its head's sink over its raw window
(`keys` = the W ring rows, then the chunk's S rows) and its compressed rows (`rows`: the first
(t + 1) // ratio of them, or the indexer's `picks` [S, k] of them, -1 = nothing there).
"""

from __future__ import annotations

import functools

import numpy as np

from ds4.kernels import f32, i32, launch, ptr, shared_limits
from ds4.kernels.split import split_bf16

WIDTHS = (64, 128, 256, 512)  # head dims the kernel is built for
LO_TAILS = {128: 64, 256: 64, 512: 64}  # head dim -> the only lo-word tail built below it
HEADS_PER_BLOCK = 32  # heads of one block (HEADS in the .cu)
TILE = 32  # keys staged at a time (TILE in the .cu)
THREADS = 256


def kernel_fits(width: int, parts: int = 2) -> bool:
    """Whether the kernel is built for this head dim and its block's shared memory fits this
    GPU (others take the model code's path: 216 KB at head dim 512 is past an A100's 163)."""
    return width in WIDTHS and shared_bytes(width, parts) <= shared_limits()[0]


def words_size(keys, rows, parts: int = 2) -> int:
    """uint16 words the launcher's `words` scratch needs: hi (+ lo) of every key and row."""
    return parts * (keys.size + (0 if rows is None else rows.size))


def shared_bytes(width: int, parts: int) -> int:
    """Dynamic shared memory of one block (sizeof(Smem<D, P>) in the .cu): two stages of a
    tile's words, the next query's rows, the four partial score quarters, p words, and m, l,
    alpha per head."""
    keys = 2 * parts * TILE * (width + 8) * 2
    query = HEADS_PER_BLOCK * (width + 8) * 4
    partial = 4 * HEADS_PER_BLOCK * (TILE + 1) * 4
    p = parts * HEADS_PER_BLOCK * (TILE + 8) * 2
    return keys + query + partial + p + 3 * HEADS_PER_BLOCK * 4


def chunk_attention(q, keys, rows, picks, ratio: int, start: int, sinks, out, words,
                    parts: int = 2, exact: int = 0):
    """out [S, H, d] (fp32, still roped) of q [S, H, d] against the window and compressed rows.

    keys [W + S, d]; rows [count, d] or None; picks [S, k] (int) or None = every usable row;
    words: a uint16 scratch of words_size(keys, rows, parts) values (the keys' and rows' hi
    (+ lo) words); parts 2: hi + lo products (fp32-class), 1: one bf16 rounding (DS4_GEMM=bf16).
    exact: leading dims of every key and row that bf16 holds exactly (FP8-rounded KV: the dims
    before RoPE's), whose lo words are zero; where a kernel is built for that split it stages
    and multiplies only the other dims' lo words (the same sums: those products are zeros).
    """
    import cupy

    S, H, d = q.shape
    raw = _split(keys, words[: parts * keys.size], parts)
    comp = None if rows is None else _split(rows, words[parts * keys.size:
                                                        words_size(keys, rows, parts)], parts)
    count = 0 if rows is None else rows.shape[0]
    sel = None if picks is None else cupy.ascontiguousarray(picks, dtype=cupy.int32)
    width = 0 if sel is None else sel.shape[1]
    args = (ptr(cupy.ascontiguousarray(q, dtype=cupy.float32)), ptr(raw), ptr(comp), ptr(sel),
            i32(width), i32(count), i32(ratio if count else 0), i32(start),
            i32(keys.shape[0] - S), i32(S), ptr(cupy.ascontiguousarray(sinks, dtype=cupy.float32)),
            ptr(out), i32(H), f32(d ** -0.5))
    head_blocks = -(-H // HEADS_PER_BLOCK)
    grid = (min(S, max(1, _multiprocessors() // head_blocks)), head_blocks)  # one block an SM
    launch("chunk_attention", kernel_name(d, parts, exact), grid, (THREADS,), args,
           shared=shared_bytes(d, parts))
    return out


def kernel_name(width: int, parts: int, exact: int) -> str:
    """The build for this head dim and word count, with lo words only past `exact` dims where
    one is built for that tail (else every dim's)."""
    name = f"chunk_attention_d{width}_x{parts}"
    tail = width - exact
    return f"{name}_r{tail}" if parts == 2 and LO_TAILS.get(width) == tail else name


@functools.cache
def _multiprocessors() -> int:
    """SMs of the current device: the kernel runs one block of its query stream on each."""
    import cupy

    return int(cupy.cuda.Device().attributes["MultiProcessorCount"])


def _split(x, words, parts: int):
    """x [n, d] fp32 as [parts, n, d] bf16 words (hi block, then lo block) in `words`."""
    n, d = x.shape
    return split_bf16(x.reshape(1, n, d), words.reshape(1, parts * n, d))


def _window_rows(keys, W: int, start: int, i: int):
    """Ring slots holding positions in (t - W, t], then the chunk's rows up to i."""
    t = start + i
    slots = np.arange(W)
    ring_pos = start - 1 - (start - 1 - slots) % W
    ring = keys[:W][(ring_pos >= 0) & (ring_pos > t - W)]
    return np.concatenate([ring, keys[W + max(0, i - W + 1): W + i + 1]])


def _compressed_rows(rows, picks, ratio: int, start: int, i: int):
    """Query i's compressed rows: its picks (skipping -1), else the first (t + 1) // ratio."""
    if picks is not None:
        ids = np.asarray(picks[i])
        return rows[ids[ids >= 0]]
    return rows[: min(rows.shape[0], (start + i + 1) // ratio)]


def chunk_attention_numpy(q, keys, rows, picks, ratio: int, start: int, sinks, out, words=None,
                          parts: int = 2):
    """NumPy twin of chunk_attention (fp32, one query at a time)."""
    S, H, d = q.shape
    W = keys.shape[0] - S
    for i in range(S):
        rows_i = _compressed_rows(rows, picks, ratio, start, i) if rows is not None else None
        seen = _window_rows(keys, W, start, i)
        if rows_i is not None:
            seen = np.concatenate([seen, rows_i])
        out[i] = _sink_softmax(q[i], seen, sinks, np.float32(d ** -0.5))
    return out


def _sink_softmax(q, seen, sinks, scale):
    """o_h = sum_j p_j k_j, p = exp(l) / (exp(s_h) + sum exp(l)), l = q_h . k_j * scale."""
    logits = (q @ seen.T) * scale
    top = np.maximum(logits.max(axis=1), sinks)
    e = np.exp(logits - top[:, None])
    return (e @ seen) / (e.sum(axis=1) + np.exp(sinks - top))[:, None]
