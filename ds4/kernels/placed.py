"""Expert kernels for routed experts split over device and mapped host memory (placed.cu).

A PlacedStack (ds4.model.placement) keeps per expert the device address of its codes and of
its scales, wherever they live; these launchers read the picked experts through those tables
with packed.cu's row math, host experts' work first (host_first_order: their PCIe reads start
before the resident work that hides them). Like every decode launcher they allocate nothing,
so they can be captured in a CUDA graph. `moe_placed_numpy` is the twin with the same signature.
"""

from __future__ import annotations

import functools

import numpy as np

from ds4.kernels import f32, i32, kernel, ptr, resident_blocks
from ds4.kernels.packed import (
    CHUNK_CODES,
    WARPS_PER_BLOCK,
    _shift,
    x_bytes,
)


@functools.cache
def _kernel(name: str):
    return kernel("placed", name)


@functools.cache
def _resident_blocks(name: str, shared: int) -> int:
    """Blocks of kernel `name` that fit on the GPU at once: the persistent grid's size."""
    return resident_blocks(_kernel(name), 32 * WARPS_PER_BLOCK, shared)


def _launch(name: str, grid: int, args: tuple, shared: int) -> None:
    k = _kernel(name)
    if shared > 48 * 1024 and k.max_dynamic_shared_size_bytes < shared:
        k.max_dynamic_shared_size_bytes = shared
    k((grid,), (32 * WARPS_PER_BLOCK,), args, shared_mem=shared)


def _layout(stack) -> tuple[int, int, int]:
    """(shift, per-expert scale row length, code bytes per row) of a PlacedStack."""
    shift = _shift(stack.block[0]) if stack.fmt == "fp8" else 0
    codes, scale = stack.memory_of(0)
    return shift, scale.shape[-1], codes.shape[-1]


def moe_placed(gate_up, down, inter: int, idx, wts, x, act, y, limit: float, counts=None,
               live=None, member: int = 0):
    """y = sum_k down_e(silu(min(gate_e x, limit)) * clamp(up_e x) * wts[k]), e = idx[k], over
    the experts of PlacedStacks gate_up [E, 2I, D] and down [E, D, I] (each in device or
    mapped host memory); act [k, I] is the activation buffer; counts[e] += 1 per pick, unless
    this token is member `member` of a batch whose live count (device int32 [1]) `live` is not
    above it (an idle row)."""
    fmt, k = gate_up.fmt, act.shape[0]
    if counts is not None:
        _kernel("count_picks")((1,), (32,), (ptr(idx), i32(k), ptr(counts), ptr(live),
                                             i32(member)))
    shift, sc_ld, row_bytes = _layout(gate_up)
    cols = x.shape[-1]
    up_rows = inter // gate_up.block[0] if fmt == "fp8" else inter
    name = f"placed_gate_up_{fmt}_r1"
    shared = x_bytes(fmt, cols // CHUNK_CODES[fmt])
    tiles = -(-inter // WARPS_PER_BLOCK)
    args = (ptr(gate_up.code_ptrs), ptr(gate_up.scale_ptrs), ptr(gate_up.on_host),
            np.int64(inter * row_bytes), np.int64(up_rows * sc_ld), ptr(idx), ptr(wts), ptr(x),
            ptr(act), i32(inter), i32(cols), i32(sc_ld), i32(shift), f32(limit), i32(k))
    _launch(name, min(k * tiles, _resident_blocks(name, shared)), args, shared)
    shift, sc_ld, _ = _layout(down)
    rows, name = y.shape[0], f"placed_down_{fmt}_r1"
    shared = x_bytes(fmt, k * inter // CHUNK_CODES[fmt])
    args = (ptr(down.code_ptrs), ptr(down.scale_ptrs), ptr(down.on_host), ptr(idx), ptr(act),
            ptr(y), i32(rows), i32(inter), i32(sc_ld), i32(shift), i32(k), i32(0))
    _launch(name, min(-(-rows // WARPS_PER_BLOCK), _resident_blocks(name, shared)), args, shared)
    return y


def host_first_order(idx, resident) -> list[int]:
    """Pick positions k, those whose expert idx[k] lives in host memory first (each group in k
    order): the order the kernels walk the picks in."""
    ids = np.asarray(idx).reshape(-1).tolist()
    resident = np.asarray(resident)
    return ([k for k, e in enumerate(ids) if not resident[e]]
            + [k for k, e in enumerate(ids) if resident[e]])


def moe_placed_numpy(gate_up, down, inter: int, idx, wts, x, act, y, limit: float,
                     counts=None, live=None, member: int = 0):
    """NumPy twin of moe_placed (experts widened from wherever they live, summed host experts
    first as the kernels do)."""
    if live is not None and member >= int(np.asarray(live).reshape(-1)[0]):
        counts = None  # an idle row: its picks do not count
    y[...] = 0
    ids = np.asarray(idx).reshape(-1).tolist()
    resident = getattr(gate_up, "resident", np.ones(max(ids) + 1, dtype=bool))
    for j in host_first_order(ids, resident):
        e = ids[j]
        gu = gate_up[e].dense(np)
        g, u = gu[:inter] @ x, gu[inter:] @ x
        if limit > 0:
            g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
        act[j] = g / (1 + np.exp(-g)) * u * wts[j]
        y += down[e].dense(np) @ act[j]
        if counts is not None:
            counts[e] += 1
    return y
