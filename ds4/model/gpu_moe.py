"""Grouped routed experts for prefill on the GPU: two batched products over all experts.

A chunk's (token, pick) slots are sorted by expert and laid out as [experts, C, D] (C = the
largest count, zero rows pad the rest), so the whole routed MoE is one strided-batched GEMM
for gate/up and one for down instead of a Python loop with a host sync per hit expert.
"""

from __future__ import annotations

MAX_PADDING = 3.0  # fall back to the per-expert loop when padding would triple the rows


def stacked_experts(bank):
    """(gate_up [E, 2I, D], down [E, D, I]) device stacks of a resident bank, else None."""
    stacked = getattr(bank, "stacked", None)
    if stacked is not None:
        return stacked
    if getattr(bank, "resident", False) and hasattr(bank, "_gate_up"):
        return bank._gate_up, bank._down  # a resident ExpertBank holds exactly these stacks
    return None


def routed_grouped(xp, cfg, bank, x, ids, weights):
    """sum_k weights[s, k] * expert_{ids[s, k]}(x[s]) for x [S, D], or None when the bank is not
    resident or routing is so skewed that padding would waste more than MAX_PADDING."""
    from ds4.model.moe import swiglu

    stacks = stacked_experts(bank)
    if stacks is None:
        return None
    gate_up, down = stacks
    S, k = ids.shape
    E, inter = gate_up.shape[0], cfg.moe_intermediate_size
    flat = ids.reshape(-1).astype(xp.int64)
    order = xp.argsort(flat)
    counts = xp.bincount(flat, minlength=E)
    C = int(counts.max())  # the one host sync
    if E * C > MAX_PADDING * S * k:
        return None
    expert = flat[order]
    slot = xp.arange(S * k) - (xp.cumsum(counts) - counts)[expert]
    xs = xp.zeros((E, C, x.shape[1]), dtype=x.dtype)
    xs[expert, slot] = x[order // k]
    ws = xp.zeros((E, 1, C), dtype=x.dtype)
    ws[expert, 0, slot] = weights.reshape(-1)[order]
    # Weights stay the untransposed A operand: transposing a stack could copy gigabytes.
    y = xp.matmul(gate_up, xs.transpose(0, 2, 1))  # [E, 2I, C]
    act = swiglu(xp, y[:, :inter], y[:, inter:], cfg.swiglu_limit) * ws
    z = xp.matmul(down, act)  # [E, D, C]
    res = xp.empty((S * k, x.shape[1]), dtype=x.dtype)
    res[order] = z[expert, :, slot]
    return res.reshape(S, k, -1).sum(axis=1)
