"""NumPy twins of ds4/kernels/rows_moe.py's MoE launches: the grouping of a batch's picks by
expert (host experts first, idle rows left out), each pick's product and the slot-order sums,
as the device computes them; and the readers of the device's grouping table."""

from __future__ import annotations

import numpy as np

from ds4.kernels.moe import _swiglu
from ds4.kernels.rows import _host, _kernel_fmt, dense, rows_numpy
from ds4.kernels.rows_moe import UNIT, stack_of


def moe_numpy(gate_up, down, idx, wts, x, act, y, batch: int, inter: int, limit: float,
              shared=None, counts=None, live=None, shared_done=None) -> None:
    """NumPy twin of moe (act unused; device inputs are copied to the host; counts, when
    given, a host array): the pairs grouped as rows_moe_group does, each pick's product, then
    the slot-order sums of moe_sum (idle rows: the shared expert alone). shared_done is
    ignored: the twin always computes the shared expert itself."""
    fmt, dfmt = _stack_fmt(gate_up), _stack_fmt(down)
    idx, wts, x = _host(idx), _host(wts), np.asarray(_host(x), np.float32)
    k = idx.shape[1]
    units = moe_group_numpy(idx[:batch], batch * k, k, gate_up.shape[0], host_flags(gate_up),
                            live, counts)
    part = {}
    for e, pairs in units:
        both = dense(gate_up[e])  # gate rows, then up rows
        gate, up, dn = both[:inter], both[inter:2 * inter], dense(down[e])
        for p in pairs:
            xb = x[p // k:p // k + 1]
            a = _swiglu32(rows_numpy(gate, fmt, xb)[0], rows_numpy(up, fmt, xb)[0], limit,
                          wts[p // k, p % k])
            part[p] = rows_numpy(dn, dfmt, a[None])[0]
    for b in range(batch):
        total = np.zeros(down.shape[1], np.float32)  # an idle row: no routed part
        if b < live_count(live, batch):
            for j in range(k):
                if idx[b, j] >= 0:  # (negative: an expert another rank holds)
                    total = total + part[b * k + j]
        if shared is not None:
            total = total + _shared_numpy(shared, x[b:b + 1], limit)
        y[b] = total


def moe_group_numpy(idx, pairs: int, k: int, n_experts: int, on_host=None, live=None,
                    counts=None) -> list[tuple[int, list[int]]]:
    """NumPy twin of rows_moe_group: (expert, its pairs in increasing order) per expert hit by
    the first `pairs` (token, slot) pairs of live tokens, host experts first (on_host: a
    mask), each group in expert order; counts[e] += the live picks of e."""
    pairs = min(pairs, live_count(live, pairs) * k)
    ids = _host(idx).reshape(-1)[:pairs].tolist()
    host = np.zeros(n_experts, bool) if on_host is None else _host(on_host).astype(bool)
    order = [e for e in range(n_experts) if host[e]] + [e for e in range(n_experts) if not host[e]]
    units = [(e, [p for p, i in enumerate(ids) if i == e]) for e in order]
    units = [(e, ps) for e, ps in units if ps]
    if counts is not None:
        for e, ps in units:
            counts[e] += len(ps)
    return units


def live_count(live, batch: int) -> int:
    """Tokens that are live members: *live (clipped to 0..batch), or all `batch` without one."""
    return batch if live is None else min(batch, max(int(_host(live).reshape(-1)[0]), 0))


def units_of(table) -> list[tuple[int, list[int]]]:
    """rows_moe_group's table (act.units, device or host) as moe_group_numpy's list."""
    t = _host(table)
    rows = [t[1 + UNIT * u:1 + UNIT * (u + 1)] for u in range(int(t[0]))]
    return [(int(r[0]), r[2:2 + int(r[1])].tolist()) for r in rows]


def host_flags(w):
    """Which experts of a stack live in mapped host memory (a PlacedStack's mask), or None."""
    return ~np.asarray(w.resident) if getattr(w, "placed", False) else None


def _stack_fmt(w) -> str | None:
    st = stack_of(w) if getattr(w, "placed", False) else None
    return st.fmt if st is not None else _kernel_fmt(w)


def _shared_numpy(shared, x, limit: float) -> np.ndarray:
    fmts = [_kernel_fmt(m) for m in shared]
    g = rows_numpy(dense(shared[0]), fmts[0], x)[0]
    u = rows_numpy(dense(shared[1]), fmts[1], x)[0]
    return rows_numpy(dense(shared[2]), fmts[2], _swiglu32(g, u, limit, 1.0)[None])[0]


def _swiglu32(g, u, limit: float, weight) -> np.ndarray:
    return (_swiglu(g, u, limit) * np.float32(weight)).astype(np.float32)
