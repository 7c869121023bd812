"""Decode attention launchers (ds4/kernels/attention.cu) and their NumPy twins."""

from __future__ import annotations

import numpy as np

from ds4.kernels import NULL, f32, i32, launch, ptr
from ds4.kernels.norm import rms_norm_numpy
from ds4.kernels.rope import rope_angles_numpy, rope_tail_numpy, rotate_numpy


def attention_store_kv(kv_in, w, freqs, pos, raw, rope_dim: int, eps: float = 1e-6):
    """raw[pos % cap] = rope(RMSNorm_w(kv_in)) at pos (raw: the [cap, width] window ring)."""
    cap, width = raw.shape
    block = (width + 31) // 32 * 32
    args = (ptr(kv_in), ptr(w), ptr(freqs), ptr(pos), ptr(raw), i32(width), i32(rope_dim),
            i32(cap), f32(eps))
    launch("attention", "attention_store_kv", (1,), (block,), args, shared=4 * width)
    return raw


def attention_store_kv_numpy(kv_in, w, freqs, pos, raw, rope_dim: int, eps: float = 1e-6):
    """NumPy twin of attention_store_kv."""
    t = int(np.asarray(pos)[0])
    row = rms_norm_numpy(np.asarray(kv_in)[None, :], w, np.empty((1, raw.shape[1]), np.float32),
                         eps)
    cos, sin = rope_angles_numpy([t], freqs)
    raw[t % raw.shape[0]] = rotate_numpy(row, cos, sin, rope_dim)[0]
    return raw


KEYS_PER_BLOCK = 32  # keys one attention_partial block stages (SPLIT_KEYS in common.cuh)
TARGET_BLOCKS = 128  # (head group, split, member) blocks of a launch that keep the SMs busy


def heads_per_block(heads: int, splits: int, batch: int = 1) -> int:
    """Query heads sharing one staged key tile: the most (<= 8) that still give TARGET_BLOCKS
    blocks over the batch's members (fewer heads a block: the scores' channels split over its
    idle warps). A member's sums do not depend on it: each score adds the same 8 channel parts
    in order (common.cuh's staged_partial), each output channel its keys in order, whatever
    the heads a block; so a batch of 8 stages each key tile once for 8 heads, not for 2."""
    fits = [g for g in (8, 4, 2, 1) if heads % g == 0]
    return next((g for g in fits if heads // g * splits * batch >= TARGET_BLOCKS), fits[-1])


def staged_shared(width: int, hpb: int) -> int:
    """Dynamic shared memory (bytes) of a block that stages KEYS_PER_BLOCK keys for hpb query
    heads (attention_partial, mtp_window_partial): the keys in rows of common.cuh's
    key_stride(width) = width + 4 floats, the queries, the weights and the key rows' 8-byte
    addresses (common.cuh's stage_key_rows reads them)."""
    return 4 * (KEYS_PER_BLOCK * (width + 4) + hpb * width + hpb * KEYS_PER_BLOCK) \
        + 8 * KEYS_PER_BLOCK


def partial_size(heads: int, width: int, max_keys: int) -> int:
    """Floats of the partials buffer attention_decode needs for up to max_keys keys."""
    return heads * -(-max_keys // KEYS_PER_BLOCK) * (width + 2)


def attention_decode(q, raw, pos, comp, sel, sel_count, ratio: int, sinks, out, max_keys: int,
                     part):
    """out[h] = softmax-with-sink attention of q[h] over the raw ring and compressed rows.
    part: a float32 scratch of at least partial_size(heads, width, max_keys) values."""
    heads, width = q.shape
    cap = raw.shape[0]
    splits = -(-max_keys // KEYS_PER_BLOCK)
    assert width <= 1024 and part.size >= partial_size(heads, width, max_keys)
    hpb = heads_per_block(heads, splits)
    args = (ptr(q), ptr(raw), ptr(pos), i32(cap), ptr(comp), ptr(sel), ptr(sel_count),
            i32(ratio), ptr(part), i32(width), f32(width ** -0.5), i32(max_keys), i32(hpb))
    shared = staged_shared(width, hpb)
    launch("attention", "attention_partial", (heads // hpb, splits), (256,), args, shared=shared)
    launch("attention", "attention_combine", (heads,), (256,),
           (ptr(part), ptr(sinks), ptr(out), i32(width), i32(splits), i32(0), NULL, NULL, i32(0)),
           shared=8 * splits)
    return out


def attention_store_kv_m(kv_in, w, freqs, table, layer: int, slot: int, cap: int,
                         rope_dim: int, eps: float = 1e-6):
    """attention_store_kv for each member b of a batch graph: kv_in [B, width], member b's
    ring (cap rows) and position from the member table (`table`, layer, slot)."""
    batch, width = kv_in.shape
    block = (width + 31) // 32 * 32
    args = (ptr(kv_in), ptr(w), ptr(freqs), ptr(table.pos), table.group(layer, slot), i32(width),
            i32(rope_dim), i32(cap), f32(eps))
    launch("attention", "attention_store_kv_m", (1, 1, batch), (block,), args, shared=4 * width)
    return kv_in


def attention_store_kv_m_numpy(kv_in, w, freqs, table, layer: int, slot: int, cap: int,
                               rope_dim: int, eps: float = 1e-6):
    """NumPy twin of attention_store_kv_m."""
    for b, raw in enumerate(table.arrays(layer, slot)):
        attention_store_kv_numpy(kv_in[b], w, freqs, table.pos[b:b + 1], raw, rope_dim, eps)
    return kv_in


def attention_decode_m(q, table, layer: int, raw_slot: int, comp_slot, cap: int, sel, sel_count,
                       ratio: int, sinks, out, max_keys: int, part, freqs=None,
                       rope_dim: int = 0):
    """attention_decode for each member b of a batch graph: q, out [B, heads, width], sel
    [B, k] and sel_count [B] (or None), part [B, >= partial_size]; member b's raw ring and
    compressed rows (comp_slot None: none) from the member table. freqs given: out then turned
    back by RoPE at each member's position (rope_tail, sign -1) in the same launch."""
    batch, heads, width = q.shape
    assert freqs is None or (width % 32 == 0 and rope_dim % 2 == 0)
    splits = -(-max_keys // KEYS_PER_BLOCK)
    assert width <= 1024 and part.shape[1] >= partial_size(heads, width, max_keys)
    hpb = heads_per_block(heads, splits, batch)
    comp = NULL if comp_slot is None else table.group(layer, comp_slot)
    args = (ptr(q), table.group(layer, raw_slot), ptr(table.pos), i32(cap), comp, ptr(sel),
            ptr(sel_count), i32(0 if sel is None else sel.shape[1]), i32(ratio), ptr(part),
            i32(part.shape[1]), i32(width), f32(width ** -0.5), i32(max_keys), i32(hpb))
    shared = staged_shared(width, hpb)
    launch("attention", "attention_partial_m", (heads // hpb, splits, batch), (256,), args,
           shared=shared)
    launch("attention", "attention_combine", (heads, 1, batch), (256,),
           (ptr(part), ptr(sinks), ptr(out), i32(width), i32(splits), i32(part.shape[1]),
            ptr(table.pos), ptr(freqs), i32(rope_dim)), shared=8 * splits)
    return out


def attention_decode_m_numpy(q, table, layer: int, raw_slot: int, comp_slot, cap: int, sel,
                             sel_count, ratio: int, sinks, out, max_keys: int, part, freqs=None,
                             rope_dim: int = 0):
    """NumPy twin of attention_decode_m."""
    raws = table.arrays(layer, raw_slot)
    comps = table.arrays(layer, comp_slot) if comp_slot is not None else [None] * len(raws)
    for b, (raw, comp) in enumerate(zip(raws, comps)):
        attention_decode_numpy(q[b], raw, table.pos[b:b + 1], comp,
                               None if sel is None else sel[b],
                               None if sel is None else sel_count[b:b + 1], ratio, sinks, out[b],
                               max_keys)
        if freqs is not None:
            rope_tail_numpy(out[b], table.pos[b:b + 1], freqs, rope_dim, rows_per_pos=q.shape[1],
                            sign=-1.0)
    return out


def decode_keys_numpy(raw, pos, comp, sel, sel_count, ratio: int):
    """The key rows attention_decode reads, in its order: raw ring rows, then compressed."""
    t = int(np.asarray(pos)[0])
    keys = [raw[:min(t + 1, raw.shape[0])]]
    if ratio:
        if sel is not None:
            keys.append(comp[np.asarray(sel)[:int(np.asarray(sel_count)[0])]])
        else:
            keys.append(comp[:(t + 1) // ratio])
    return np.concatenate(keys, axis=0)


def attention_decode_numpy(q, raw, pos, comp, sel, sel_count, ratio: int, sinks, out,
                           max_keys: int, part=None):
    """NumPy twin of attention_decode."""
    keys = decode_keys_numpy(raw, pos, comp, sel, sel_count, ratio)[:max_keys]
    logits = (q @ keys.T) * np.float32(q.shape[1] ** -0.5)
    m = np.maximum(logits.max(axis=1), sinks)
    e = np.exp(logits - m[:, None])
    denom = e.sum(axis=1) + np.exp(sinks - m)
    out[...] = (e @ keys) / denom[:, None]
    return out
