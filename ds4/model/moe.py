"""Mixture of experts (docs/MODEL.md, Mixture of experts): hash or top-k routing, clamped SwiGLU."""

from __future__ import annotations

import numpy as np

from ds4.model.hyper_connection import sigmoid
from ds4.model.linear import grouped_linear, linear, parts
from ds4.model.packed import PackedMatrix

GROUPED_KERNELS = True  # packed experts on CuPy through ds4/kernels/grouped.cu (benchmarks flip it)


def router_scores(xp, cfg, logits):
    """Per-expert scores in fp32 (sqrt(softplus) for V4)."""
    if cfg.scoring_func == "sqrtsoftplus":
        return xp.sqrt(xp.logaddexp(0.0, logits))
    if cfg.scoring_func == "sigmoid":
        return sigmoid(xp, logits)
    shifted = xp.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def route(xp, cfg, lw, x, token_ids, hashed: bool):
    """(expert ids [S, k], weights [S, k]); ties pick the lower expert id."""
    logits = linear(xp, x, lw["mlp.gate.weight"])
    if xp is not np and cfg.scoring_func == "sqrtsoftplus" and _routes_in_one_launch(logits):
        return _route_kernel(xp, cfg, lw, logits, token_ids, hashed)
    scores = router_scores(xp, cfg, logits)
    if hashed:
        ids = lw["mlp.gate.tid2eid"][token_ids]
    else:
        biased = scores + lw["mlp.gate.e_score_correction_bias"]
        ids = xp.argsort(-biased, axis=-1, kind="stable")[:, : cfg.num_experts_per_tok]
    weights = xp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob or cfg.scoring_func != "softmax":
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


def _routes_in_one_launch(logits) -> bool:
    """Whether the decode graph's router kernel takes these rows: one block a token of at most
    1024 experts, tokens on the grid's z axis."""
    return logits.shape[-1] <= 1024 and logits.shape[0] <= 65535


def _route_kernel(cp, cfg, lw, logits, token_ids, hashed: bool):
    """route() on CuPy through the decode graph's moe_route, every token in one launch: the
    stable argsort of [S, experts] and the array passes around it held ~0.27 ms of a 2048-token
    chunk's layer (docs/PERF.md). The same picks and weights up to the softplus' last bit."""
    from ds4.kernels.moe import moe_route

    S, k = logits.shape[0], cfg.num_experts_per_tok
    ids, weights = cp.empty((S, k), cp.int32), cp.empty((S, k), cp.float32)
    table, bias = None, None
    if hashed:  # the chunk's own rows of the hash table; token t reads row t
        table = cp.ascontiguousarray(lw["mlp.gate.tid2eid"][token_ids][:, :k], dtype=cp.int32)
    else:
        bias = cp.ascontiguousarray(lw["mlp.gate.e_score_correction_bias"], dtype=cp.float32)
    moe_route(cp.ascontiguousarray(logits, dtype=cp.float32), bias, table,
              cp.arange(S, dtype=cp.int32), k, cfg.routed_scaling_factor, ids, weights)
    return ids.astype(cp.int64), weights


def swiglu(xp, gate, up, limit: float):
    """silu(min(gate, limit)) * clip(up, -limit, limit); no clamp when limit <= 0."""
    if limit > 0:
        gate = xp.minimum(gate, limit)
        up = xp.clip(up, -limit, limit)
    return gate * sigmoid(xp, gate) * up


def moe(xp, cfg, lw, x, token_ids, hashed: bool, to_host, ahead=None):
    """f = sum_k w_k expert_k(x) + shared(x) for x [S, D]; `ahead`: stage_ahead's copies."""
    ids, weights = route(xp, cfg, lw, x, token_ids, hashed)
    if getattr(lw.experts, "group", None) is not None:  # expert parallel: ds4/model/expert_group
        routed = lw.experts.routed(xp, cfg, x, ids, weights, to_host)
    else:
        routed = _routed(xp, cfg, lw.experts, x, ids, weights, to_host, ahead)
    if "mlp.shared_experts.gate_proj.weight" not in lw:
        return routed
    gate = linear(xp, x, lw["mlp.shared_experts.gate_proj.weight"])
    up = linear(xp, x, lw["mlp.shared_experts.up_proj.weight"])
    shared = swiglu(xp, gate, up, cfg.swiglu_limit)
    return routed + linear(xp, shared, lw["mlp.shared_experts.down_proj.weight"])


def _routed(xp, cfg, bank, x, ids, weights, to_host, ahead=None):
    """sum_k weights[:, k] * expert_{ids[:, k]}(x) for x [S, D] over one bank."""
    if x.shape[0] == 1:
        return _routed_one(xp, cfg, bank, x[0], ids[0], weights[0])[None, :]
    if xp is not np and bank.resident:
        return _routed_grouped(xp, cfg, bank, x, ids, weights, to_host, ahead)
    return _routed_many(xp, cfg, bank, x, ids, weights, to_host(ids))


def routed_local(xp, cfg, bank, x, ids, weights, to_host):
    """One rank's part of the routed sum (expert parallel): ids index its own bank, and a
    negative id is a pick another rank holds, which adds nothing here (the grouped kernels
    skip it; the other paths give it expert 0 with weight 0)."""
    here = ids >= 0
    if xp is not np and bank.resident and _grouped_kernels_fit(bank, x.shape[1]):
        from ds4.kernels import grouped

        gate_up, down = bank.stacked
        ids = xp.where(here, ids, bank.count).astype(xp.int32)
        return grouped.routed(xp, gate_up, down, x, ids, weights, cfg.swiglu_limit, parts(),
                              skips=True)
    ids, weights = xp.where(here, ids, 0), xp.where(here, weights, 0)
    return _routed(xp, cfg, bank, x, ids, weights, to_host)


def _routed_one(xp, cfg, bank, x, ids, weights):
    """Decode: the k picked experts as one batched product (duplicate picks simply add)."""
    gate_up, down = bank.gather(ids)  # [k, 2I, D], [k, D, I]
    inter = cfg.moe_intermediate_size
    y = xp.matmul(gate_up, x)  # [k, 2I]
    act = swiglu(xp, y[:, :inter], y[:, inter:], cfg.swiglu_limit) * weights[:, None]
    return xp.matmul(down, act[:, :, None])[:, :, 0].sum(axis=0)


def _routed_many(xp, cfg, bank, x, ids, weights, host_ids: np.ndarray):
    """Prefill: one product per expert that any token of the chunk picked."""
    out = xp.zeros_like(x)
    inter = cfg.moe_intermediate_size
    for e in np.unique(host_ids).tolist():
        rows = xp.asarray(np.nonzero((host_ids == e).any(axis=1))[0])
        w = (weights * (ids == e)).sum(axis=1)[rows]
        gate_up, down = bank.expert(e)
        y = x[rows] @ gate_up.T
        act = swiglu(xp, y[:, :inter], y[:, inter:], cfg.swiglu_limit) * w[:, None]
        out[rows] += act @ down.T
    return out


def _routed_grouped(xp, cfg, bank, x, ids, weights, to_host, ahead=None):
    """Prefill: (token, pick) rows sorted by expert, one gate/up and one down GEMM
    per expert hit."""
    if _grouped_kernels_fit(bank, x.shape[1]):
        from ds4.kernels import grouped

        gate_up, down = bank.stacked
        return grouped.routed(xp, gate_up, down, x, ids, weights, cfg.swiglu_limit, parts())
    if _placed_kernels_fit(bank, x.shape[1]):
        return _routed_placed(xp, cfg, bank, x, ids, weights, ahead=ahead)
    S, k = ids.shape
    inter = cfg.moe_intermediate_size
    flat = ids.reshape(-1)
    order = xp.argsort(flat)  # (token, pick) rows grouped by expert
    counts = to_host(xp.bincount(flat, minlength=bank.count)).tolist()
    groups, end = [], 0
    for e, n in enumerate(counts):
        if n:
            groups.append((e, end, end + n))
            end += n
    gate_up, down = bank.stacked
    y = grouped_linear(xp, x[order // k], gate_up, groups)  # [S*k, 2I]
    act = _scaled_swiglu(xp, y, inter, weights.reshape(-1)[order], cfg.swiglu_limit)
    out = xp.empty((S * k, x.shape[1]), xp.float32)
    out[order] = grouped_linear(xp, act, down, groups)
    return out.reshape(S, k, -1).sum(axis=1)


def _grouped_kernels_fit(bank, hidden: int) -> bool:
    """True when packed experts go through the grouped kernels, which read their codes in place
    (no widened slab per expert, no host round trip for the counts)."""
    if not (GROUPED_KERNELS and getattr(bank, "packed", False)):
        return False
    from ds4.kernels.grouped import fits

    gate_up, down = bank.stacked
    return (isinstance(gate_up, PackedMatrix) and isinstance(down, PackedMatrix)
            and fits(gate_up, hidden) and fits(down, gate_up.shape[-2] // 2))


def _placed_kernels_fit(bank, hidden: int) -> bool:
    """True when a bank split over device and mapped host memory (ds4/model/placement.py) can
    run its two halves through the grouped kernels."""
    stacks = getattr(bank, "placed_stacks", ())  # banks of other kinds (tests' stubs) have none
    if not (GROUPED_KERNELS and stacks):
        return False
    from ds4.kernels.grouped import fits

    gate_up, down = stacks
    same = (np.array_equal(gate_up.resident, down.resident)
            and np.array_equal(gate_up.slot, down.slot))
    return same and all(fits(m, cols) for memory in ("device", "host")
                        for m, cols in _halves(gate_up, down, memory, hidden))


def _halves(gate_up, down, memory: str, hidden: int) -> list:
    """[(gate_up, cols), (down, cols)] PackedMatrix stacks over one memory of placed stacks,
    made once per stack (re-placement swaps bytes inside the same arrays, so they stay valid;
    the grouped kernels' scale check is then cached on them)."""
    out = []
    for stack, cols in ((gate_up, hidden), (down, gate_up.shape[-2] // 2)):
        views = stack.__dict__.setdefault("grouped_views", {})
        if memory not in views:
            codes, scale = getattr(stack, memory)
            views[memory] = PackedMatrix(stack.fmt, codes, scale, stack.shape[-1], stack.block)
        out.append((views[memory], cols))
    return out


def _routed_placed(xp, cfg, bank, x, ids, weights, stage: bool | None = None, ahead=None):
    """Prefill of a placed bank: the picks of resident experts through the grouped kernels
    over the device stacks, then those of host experts; a pick of the other memory gets the
    id one past its stack (skipped). A chunk with many picks first copies the host experts
    to the device on a copy stream while the resident picks run (`stage_host`, or `ahead`:
    stage_ahead's result, begun before the layer's attention); a short one, or one without
    room for the copy, reads them in place over PCIe. `stage` overrides that choice (tests:
    NumPy stages by a plain copy)."""
    from ds4.kernels import grouped

    gate_up, down = bank.placed_stacks
    resident, slot = gate_up.resident, gate_up.slot
    if stage is None:  # NumPy has one memory already; a few picks read a few experts
        stage = _stages(xp, resident, ids.size)
    staged = ahead
    if staged is None and stage and not resident.all():
        staged = stage_host(xp, gate_up, down)
    out = None
    for memory, here in (("device", resident), ("host", ~resident)):
        if not here.any():
            continue
        (gu, _), (dn, _) = _halves(gate_up, down, memory, x.shape[1])
        if memory == "host" and staged is not None:
            (gu, dn), copied = staged
            if copied is not None:
                xp.cuda.get_current_stream().wait_event(copied)
        remap = xp.asarray(np.where(here, slot, int(here.sum())).astype(np.int32))
        part = grouped.routed(xp, gu, dn, x, remap[ids], weights, cfg.swiglu_limit, parts(),
                              skips=True)
        out = part if out is None else out + part
    return out


STAGE_HOST = True  # prefill copies a layer's host experts to the device first (tests flip it)
# Picks per expert from which a chunk stages them: with 4 picks an expert, uniform routing
# misses a given expert with probability (1 - 1/E)^(4E) < 2%, so the copy brings little that
# is not read; below it (decode rows, MTP's few-token verify, short turns) the kernels read
# the experts they need in place instead of copying all of them (~296 MB a layer at full size)
STAGE_PICKS = 4
_COPY_STREAMS: dict = {}  # device id -> the stream staging copies run on


def _stages(xp, resident, picks: int) -> bool:
    """Whether a chunk of `picks` (token, expert) picks copies the host experts first."""
    return STAGE_HOST and xp is not np and picks >= STAGE_PICKS * resident.size


def stage_ahead(xp, cfg, lw, tokens: int):
    """The layer's host experts' staged copies (stage_host), begun now, before the layer's
    attention, when its MoE will stage them: the copy (~5 ms a layer at full size) then runs
    beside the attention as well as the resident experts, whose ~4 ms it outlasted when it
    began at the MoE (docs/PERF.md). None: no staging here, or no room for it yet (the MoE
    tries again once the attention's scratch is freed)."""
    bank, hidden = lw.experts, cfg.hidden_size
    if (xp is np or tokens < 2 or getattr(bank, "group", None) is not None
            or not getattr(bank, "resident", False) or _grouped_kernels_fit(bank, hidden)
            or not _placed_kernels_fit(bank, hidden)):
        return None  # the paths of _routed that do not reach _routed_placed
    gate_up, down = bank.placed_stacks
    resident = gate_up.resident
    if resident.all() or not _stages(xp, resident, tokens * cfg.num_experts_per_tok):
        return None
    return stage_host(xp, gate_up, down)


def stage_host(xp, gate_up, down):
    """((gate_up, down) as PackedMatrix copies of the stacks' host experts in device memory,
    the event their copies end at), or None when the device has no room for them.

    A prefill chunk of 2048 tokens picks nearly every expert, so a layer's host experts are
    read whole anyway: one DMA copy (~55 GB/s, off the SMs) beside the resident experts'
    GEMMs, then GEMMs at HBM speed, instead of kernels that read mapped memory at ~51 GB/s
    while the GPU waits (the whole V4-Flash on one H200: prefill 1587 -> 2405 tok/s; see
    docs/PERF.md). The copies wait for the main stream's work so far:
    a re-placement's writes to the stacks, and the previous layer's reads of memory this
    stream's pool hands out again. On NumPy: plain copies and no event."""
    if xp is np:
        return _packed_like((gate_up, down), [[a.copy() for a in stack.host]
                                              for stack in (gate_up, down)]), None
    main, device = xp.cuda.get_current_stream(), xp.cuda.Device().id
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = xp.cuda.Stream(non_blocking=True)
    stream = _COPY_STREAMS[device]
    stream.wait_event(main.record())
    try:
        with stream:
            copies = [[_device_copy(xp, a, stream) for a in stack.host]
                      for stack in (gate_up, down)]
    except xp.cuda.memory.OutOfMemoryError:
        return None
    return _packed_like((gate_up, down), copies), stream.record()


def _packed_like(stacks, copies) -> tuple:
    """PackedMatrix stacks over copied (codes, scale) of placed stacks' host experts."""
    return tuple(PackedMatrix(stack.fmt, codes, scale, stack.shape[-1], stack.block)
                 for stack, (codes, scale) in zip(stacks, copies))


def _device_copy(xp, host, stream):
    """A device array with host's bytes, copied by DMA on `stream` (CuPy's async memcpy)."""
    out = xp.empty(host.shape, host.dtype)
    out.data.copy_from_device_async(host.data, host.nbytes, stream)
    return out


def _scaled_swiglu(xp, y, inter: int, scale, limit: float):
    """swiglu of a GEMM's [rows, 2I] output (gate | up), times a weight per row."""
    if xp is np:
        return swiglu(xp, y[:, :inter], y[:, inter:], limit) * scale[:, None]
    from ds4.kernels.moe import swiglu_rows

    return swiglu_rows(xp.ascontiguousarray(y), xp.ascontiguousarray(scale, dtype=xp.float32),
                       xp.empty((y.shape[0], inter), xp.float32), limit)
