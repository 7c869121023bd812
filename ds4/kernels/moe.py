"""Mixture-of-experts launchers (ds4/kernels/moe.cu) and their NumPy twins."""

from __future__ import annotations

import numpy as np

from ds4.kernels import f32, i32, launch, ptr, widen
from ds4.kernels.gemv import weight_kind

WARPS_PER_BLOCK = 8
ROUTE_SLOTS = (8, 32)  # moe.cu: experts a lane of moe_route_<slots> holds


def moe_route(logits, bias, tid2eid, token, top_k: int, route_scale: float, idx, wts):
    """idx/wts of the top_k experts by sqrt(softplus(logits)) (+ bias), or tid2eid[token]; for
    a batch, logits [B, E], token [B], idx/wts [B, >= top_k]: each member's own, one launch."""
    n, batch = logits.shape[-1], 1 if logits.ndim == 1 else logits.shape[0]
    assert n <= 32 * ROUTE_SLOTS[-1] and top_k <= 32, "moe_route: at most 1024 experts, top 32"
    slots = next(s for s in ROUTE_SLOTS if n <= 32 * s)
    args = (ptr(logits), ptr(bias), ptr(tid2eid), ptr(token), i32(n), i32(top_k),
            f32(route_scale), ptr(idx), ptr(wts), i32(_row_ld(logits)), i32(_row_ld(idx)))
    assert _row_ld(idx) == _row_ld(wts)
    launch("moe", f"moe_route_{slots}", (1, 1, batch), (32,), args)
    return idx


def _row_ld(a) -> int:
    """Elements from one member's row to the next (0 for a single row)."""
    return a.strides[0] // a.itemsize if a.ndim == 2 else 0


def moe_route_numpy(logits, bias, tid2eid, token, top_k: int, route_scale: float, idx, wts):
    """NumPy twin of moe_route."""
    if np.ndim(logits) == 2:
        for b in range(logits.shape[0]):
            moe_route_numpy(logits[b], bias, tid2eid, token[b:b + 1], top_k, route_scale,
                            idx[b], wts[b])
        return idx
    logits = np.asarray(logits, np.float32)
    score = np.sqrt(np.where(logits > 20, logits, np.log1p(np.exp(np.minimum(logits, 20)))))
    if tid2eid is not None:
        picked = np.asarray(tid2eid)[int(np.asarray(token)[0])][:top_k]
    else:
        choice = score + (0 if bias is None else bias)
        picked = np.lexsort((np.arange(len(choice)), -choice.astype(np.float64)))[:top_k]
    idx[:top_k] = picked
    wts[:top_k] = score[picked] / (score[picked].sum() + 1e-20) * np.float32(route_scale)
    return idx


def _expert_stride(w) -> int:
    return w.strides[0] // w.itemsize if w.ndim == 3 else 0


def moe_gate_up(gate, up, idx, wts, x, act, limit: float, shared_gate=None, shared_up=None):
    """act[k] = silu(min(gate_e x, limit)) * clamp(up_e x, +-limit) * wts[k], e = idx[k].
    gate/up: bf16 words or fp32 [experts, inter, cols] (views of one stacked tensor are fine) or
    [inter, cols] with idx None. With shared_gate/shared_up [inter, cols], act's last row is
    that shared expert (weight 1), computed in the same launch. limit <= 0: no clamps."""
    n_rows, inter = act.shape
    cols = gate.shape[-1]
    grid = ((inter + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK, n_rows)
    args = (ptr(gate), ptr(up), np.int64(_expert_stride(gate)), ptr(idx), ptr(wts), ptr(x),
            ptr(act), i32(inter), i32(cols), f32(limit), ptr(shared_gate), ptr(shared_up))
    launch("moe", "moe_gate_up_" + weight_kind(gate), grid, (32 * WARPS_PER_BLOCK,), args)
    return act


def _expert(w, idx, k):
    return w if idx is None else w[int(np.asarray(idx)[k])]


def _swiglu(g, u, limit: float):
    if limit > 0:
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    return g / (1.0 + np.exp(-g)) * u


def moe_gate_up_numpy(gate, up, idx, wts, x, act, limit: float, shared_gate=None,
                      shared_up=None):
    """NumPy twin of moe_gate_up."""
    routed = act.shape[0] - (shared_gate is not None)
    for k in range(routed):
        g, u = widen(_expert(gate, idx, k)) @ x, widen(_expert(up, idx, k)) @ x
        act[k] = _swiglu(g, u, limit) * (1.0 if wts is None else wts[k])
    if shared_gate is not None:
        act[routed] = _swiglu(widen(shared_gate) @ x, widen(shared_up) @ x, limit)
    return act


def moe_down(down, idx, act, out, accumulate: bool = False, shared_down=None):
    """out (+)= sum_k down_e act[k], e = idx[k]; down: bf16 words or fp32 [experts, rows, inter].
    With shared_down [rows, inter], act's last row goes through it."""
    n_rows, inter = act.shape
    rows = out.shape[0]
    grid = ((rows + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK,)
    n_sel = n_rows - (shared_down is not None)
    args = (ptr(down), np.int64(_expert_stride(down)), ptr(idx), ptr(act), ptr(out), i32(rows),
            i32(inter), i32(n_sel), i32(int(accumulate)), ptr(shared_down))
    launch("moe", "moe_down_" + weight_kind(down), grid, (32 * WARPS_PER_BLOCK,), args)
    return out


def moe_down_numpy(down, idx, act, out, accumulate: bool = False, shared_down=None):
    """NumPy twin of moe_down."""
    n_sel = act.shape[0] - (shared_down is not None)
    total = sum(widen(_expert(down, idx, k)) @ act[k] for k in range(n_sel))
    if shared_down is not None:
        total = total + widen(shared_down) @ act[n_sel]
    out[...] = (out if accumulate else 0) + total
    return out


def swiglu_rows(y, scale, act, limit: float):
    """act [rows, I] = swiglu(y[:, :I], y[:, I:]) * scale[:, None] for y [rows, 2I];
    scale None = 1."""
    rows, inter = act.shape
    n = rows * inter
    launch("moe", "swiglu_rows", ((n + 255) // 256,), (256,),
           (ptr(y), ptr(scale), ptr(act), i32(rows), i32(inter), f32(limit)))
    return act


def swiglu_rows_numpy(y, scale, act, limit: float):
    """NumPy twin of swiglu_rows."""
    inter = act.shape[1]
    act[...] = _swiglu(y[:, :inter], y[:, inter:],
                       limit) * (1.0 if scale is None else scale[:, None])
    return act


def moe_localize(expert_map, idx, out):
    """out = expert_map[idx]: a rank's own expert id per pick of idx (int32, any shape,
    contiguous), -1 where another rank holds the expert."""
    n = idx.size
    launch("moe", "moe_localize", (max(1, -(-n // 256)),), (256,),
           (ptr(expert_map), ptr(idx), i32(n), ptr(out)))
    return out


def moe_localize_numpy(expert_map, idx, out):
    """NumPy twin of moe_localize."""
    out[...] = np.asarray(expert_map)[np.asarray(idx)]
    return out
