"""The MTP block's own launchers (ds4/kernels/mtp.cu) and their NumPy twins: the window
attention and the draft's pick.

`table` is the draft graph's window table (ds4/model/gpu_mtp.py WindowTable): `pos` (int32
[1]), `held` (int32 [cap], the position each ring slot holds, -1 empty), `raw_word` (device
address of the word holding the ring's address), `raw` (the ring array itself, which the twins
read) and `cap`.
"""

from __future__ import annotations

import numpy as np

from ds4.kernels import NULL, f32, i32, launch, ptr
from ds4.kernels.attention import KEYS_PER_BLOCK, staged_shared
from ds4.kernels.rope import rope_tail_numpy


def splits(cap: int) -> int:
    """Key blocks of a window of cap slots plus the new row."""
    return -(-(cap + 1) // KEYS_PER_BLOCK)


def partial_size(heads: int, width: int, cap: int) -> int:
    """Floats of the partials buffer window_attention needs."""
    return heads * splits(cap) * (width + 2)


def window_attention(q, kv, table, sinks, out, part, freqs=None, rope_dim: int = 0):
    """out[h] = softmax-with-sink attention of q[h] (q [heads, width]) over the ring slots whose
    held position is visible at pos (pos - cap < held <= pos) and the new row kv [1, width];
    freqs given: out then turned back by RoPE at pos (width a multiple of 32)."""
    heads, width = q.shape
    n = splits(table.cap)
    assert width <= 1024 and width % 4 == 0 and part.size >= partial_size(heads, width, table.cap)
    assert freqs is None or (width % 32 == 0 and rope_dim % 2 == 0)
    hpb = next(g for g in (8, 4, 2, 1) if heads % g == 0)
    shared = staged_shared(width, hpb)
    args = (ptr(q), table.raw_word, ptr(table.held), ptr(kv), ptr(table.pos), i32(table.cap),
            ptr(part), i32(width), f32(width ** -0.5), i32(hpb))
    launch("mtp", "mtp_window_partial", (heads // hpb, n), (256,), args, shared=shared)
    launch("attention", "attention_combine", (heads,), (256,),
           (ptr(part), ptr(sinks), ptr(out), i32(width), i32(n), i32(0), ptr(table.pos),
            NULL if freqs is None else ptr(freqs), i32(rope_dim)), shared=8 * n)
    return out


def window_attention_numpy(q, kv, table, sinks, out, part=None, freqs=None, rope_dim: int = 0):
    """NumPy twin of window_attention."""
    t, cap = int(np.asarray(table.pos)[0]), table.cap
    held = np.asarray(table.held)
    visible = (held >= 0) & (held <= t) & (held > t - cap)
    keys = np.concatenate([np.asarray(table.raw)[visible], np.asarray(kv)[:1]], axis=0)
    logits = (q @ keys.T) * np.float32(q.shape[1] ** -0.5)
    m = np.maximum(logits.max(axis=1), sinks)
    e = np.exp(logits - m[:, None])
    out[...] = (e @ keys) / (e.sum(axis=1) + np.exp(sinks - m))[:, None]
    if freqs is not None:
        rope_tail_numpy(out, table.pos, freqs, rope_dim, rows_per_pos=q.shape[0], sign=-1.0)
    return out


def window_store(kv, table):
    """ring[pos % cap] = kv[0] (after the attention read the ring)."""
    width = kv.shape[-1]
    launch("mtp", "mtp_window_store", ((width + 255) // 256,), (256,),
           (ptr(kv), table.raw_word, ptr(table.pos), i32(table.cap), i32(width)))
    return kv


def window_store_numpy(kv, table):
    """NumPy twin of window_store."""
    table.raw[int(np.asarray(table.pos)[0]) % table.cap] = np.asarray(kv).reshape(-1)
    return kv


def top_gap(x, out):
    """out (int32 [3]) = [argmax of x (lowest index on ties), then as float32 bits its value and
    the largest value at any other index]."""
    launch("mtp", "mtp_top_gap", (1,), (1024,), (ptr(x), i32(x.shape[0]), ptr(out)))
    return out


def top_gap_numpy(x, out):
    """NumPy twin of top_gap."""
    x = np.asarray(x, np.float32)
    top = int(np.argmax(x))
    out[0] = top
    rest = np.where(np.arange(x.shape[0]) == top, -np.inf, x).max()
    out[1:3] = np.array([x[top], rest], np.float32).view(np.int32)
    return out


def read_top_gap(words) -> tuple[int, float]:
    """(argmax, top value minus the runner-up's) from top_gap's host words."""
    words = np.asarray(words, np.int32)
    best, second = words[1:3].view(np.float32)
    return int(words[0]), float(best) - float(second)
