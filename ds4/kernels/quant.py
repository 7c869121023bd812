"""FP8 / FP4 rounding of the official graph inside the decode step (ds4/kernels/quant.cu), with
NumPy twins. Every launcher reads the token position from device memory and allocates nothing,
so it can sit in a captured CUDA graph."""

from __future__ import annotations

import numpy as np

from ds4.kernels import f32, i32, launch, ptr


def _threads(n: int) -> int:
    assert n <= 1024, "one thread per channel: at most 1024 channels"
    return (n + 31) // 32 * 32


def kv_block(nope: int) -> int:
    """Channels per FP8 scale of a KV row's non-rope part: 64, or all of them when 64 does not
    divide them."""
    return 64 if nope % 64 == 0 else nope


def kv_fp8_slot(rows, nope: int, pos):
    """FP8 round trip of channels [0, nope) of the raw ring row of token pos (rows[pos % cap])."""
    cap, width = rows.shape
    launch("quant", "kv_fp8_slot", (1,), (_threads(nope),),
           (ptr(rows), i32(width), i32(nope), i32(kv_block(nope)), ptr(pos), i32(cap)),
           shared=4 * nope)
    return rows


def kv_fp8_rows(rows, nope: int):
    """FP8 round trip of channels [0, nope) of every row of rows [n, width] (in place)."""
    n, width = rows.shape
    if n == 0:  # an empty grid is a launch error
        return rows
    launch("quant", "kv_fp8_rows", (n,), (_threads(nope),),
           (ptr(rows), i32(width), i32(nope), i32(kv_block(nope))), shared=4 * nope)
    return rows


def kv_fp8_closed(rows, nope: int, pos, ratio: int):
    """FP8 round trip of the compressed row token pos closes (rows[(pos + 1) // ratio - 1] when
    (pos + 1) % ratio == 0, else nothing)."""
    width = rows.shape[1]
    launch("quant", "kv_fp8_closed", (1,), (_threads(nope),),
           (ptr(rows), i32(width), i32(nope), i32(kv_block(nope)), ptr(pos), i32(ratio)),
           shared=4 * nope)
    return rows


def _fp4_block(width: int) -> int:
    return 32 if width % 32 == 0 else width


def hadamard_fp4(rows, pos, ratio: int = 0):
    """Hadamard rotation then FP4 round trip (32-blocks) of every row (ratio 0), or only of the
    compressed row token pos closes (ratio > 0)."""
    n, width = rows.shape
    assert width & (width - 1) == 0, "the Hadamard order is a power of two"
    norm = np.float32(1 / np.sqrt(width))
    launch("quant", "hadamard_fp4", (1 if ratio else n,), (_threads(width),),
           (ptr(rows), i32(width), i32(_fp4_block(width)), f32(norm), ptr(pos), i32(ratio)),
           shared=4 * width)
    return rows


def kv_fp8_slot_m(table, layer: int, slot: int, width: int, nope: int, cap: int):
    """kv_fp8_slot of each member of a batch graph (its ring from the member table)."""
    launch("quant", "kv_fp8_slot_m", (1, 1, table.batch), (_threads(nope),),
           (table.group(layer, slot), i32(width), i32(nope), i32(kv_block(nope)), ptr(table.pos),
            i32(cap)), shared=4 * nope)


def kv_fp8_closed_m(table, layer: int, slot: int, width: int, nope: int, ratio: int):
    """kv_fp8_closed of each member of a batch graph (its rows from the member table)."""
    launch("quant", "kv_fp8_closed_m", (1, 1, table.batch), (_threads(nope),),
           (table.group(layer, slot), i32(width), i32(nope), i32(kv_block(nope)), ptr(table.pos),
            i32(ratio)), shared=4 * nope)


def hadamard_fp4_m(table, layer: int, slot: int, width: int, ratio: int):
    """hadamard_fp4 of the row each member of a batch graph closes (ratio > 0)."""
    assert ratio > 0 and width & (width - 1) == 0
    norm = np.float32(1 / np.sqrt(width))
    launch("quant", "hadamard_fp4_m", (1, 1, table.batch), (_threads(width),),
           (table.group(layer, slot), i32(width), i32(_fp4_block(width)), f32(norm),
            ptr(table.pos), i32(ratio)), shared=4 * width)


# ---- NumPy twins

def _round_small(x, mant_bits: int, min_exp: int, max_value: float):
    mag = np.minimum(np.abs(x), np.float32(max_value))
    _, e = np.frexp(mag)
    step = np.ldexp(np.ones_like(mag), np.maximum(e - 1, min_exp) - mant_bits)
    return np.copysign(np.minimum(np.rint(mag / step) * step, np.float32(max_value)), x)


def _round_blocks(row, n: int, block: int, mant_bits: int, min_exp: int, max_value: float,
                  floor: float) -> None:
    blocks = row[:n].reshape(-1, block)
    amax = np.maximum(np.abs(blocks).max(axis=1, keepdims=True), np.float32(floor))
    scale = np.exp2(np.ceil(np.log2(amax / np.float32(max_value)))).astype(np.float32)
    row[:n] = (_round_small(blocks / scale, mant_bits, min_exp, max_value) * scale).reshape(-1)


def _closed(pos, ratio: int) -> int:
    t = int(np.asarray(pos)[0]) + 1
    return -1 if t % ratio else t // ratio - 1


def kv_fp8_slot_numpy(rows, nope: int, pos):
    """NumPy twin of kv_fp8_slot."""
    _round_blocks(rows[int(np.asarray(pos)[0]) % rows.shape[0]], nope, kv_block(nope), 3, -6,
                  448.0, 1e-4)
    return rows


def kv_fp8_rows_numpy(rows, nope: int):
    """NumPy twin of kv_fp8_rows."""
    for row in rows:
        _round_blocks(row, nope, kv_block(nope), 3, -6, 448.0, 1e-4)
    return rows


def kv_fp8_closed_numpy(rows, nope: int, pos, ratio: int):
    """NumPy twin of kv_fp8_closed."""
    row = _closed(pos, ratio)
    if row >= 0:
        _round_blocks(rows[row], nope, kv_block(nope), 3, -6, 448.0, 1e-4)
    return rows


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def hadamard_fp4_numpy(rows, pos, ratio: int = 0):
    """NumPy twin of hadamard_fp4."""
    width = rows.shape[1]
    picked = range(rows.shape[0]) if not ratio else [r for r in [_closed(pos, ratio)] if r >= 0]
    h = _sylvester(width)
    for r in picked:
        rows[r] = rows[r] @ h
        _round_blocks(rows[r], width, _fp4_block(width), 1, 0, 6.0, 1e-30)
    return rows


def kv_fp8_slot_m_numpy(table, layer: int, slot: int, width: int, nope: int, cap: int):
    """NumPy twin of kv_fp8_slot_m."""
    for b, rows in enumerate(table.arrays(layer, slot)):
        kv_fp8_slot_numpy(rows, nope, table.pos[b:b + 1])


def kv_fp8_closed_m_numpy(table, layer: int, slot: int, width: int, nope: int, ratio: int):
    """NumPy twin of kv_fp8_closed_m."""
    for b, rows in enumerate(table.arrays(layer, slot)):
        kv_fp8_closed_numpy(rows, nope, table.pos[b:b + 1], ratio)


def hadamard_fp4_m_numpy(table, layer: int, slot: int, width: int, ratio: int):
    """NumPy twin of hadamard_fp4_m."""
    for b, rows in enumerate(table.arrays(layer, slot)):
        hadamard_fp4_numpy(rows, table.pos[b:b + 1], ratio)
