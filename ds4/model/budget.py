"""How many bytes of device memory the weights may take: what is free less the sessions and the
prefill scratch the engine will need (or the --gpu-memory-gib flag). ds4.model.placement then
puts the experts that do not fit in mapped host memory."""

from __future__ import annotations

GIB = 1 << 30


def weight_budget(backend, cfg, gpu_memory_gib: float | None, parallel: int, ctx: int,
                  prefill_chunk: int) -> int | None:
    """Device bytes the weights may take: --gpu-memory-gib, else (GPU) the free memory less
    `parallel` sessions of `ctx` tokens and the scratch; None (no limit) on NumPy."""
    if gpu_memory_gib is not None:
        if gpu_memory_gib <= 0:
            raise ValueError(f"gpu_memory_gib must be > 0, got {gpu_memory_gib}")
        return device_budget(0, 0, gpu_memory_gib)
    if not backend.is_gpu:
        return None
    from ds4.model.state import state_bytes

    per_token, fixed = state_bytes(cfg)
    sessions = parallel * (fixed + per_token * ctx)
    # blocks CuPy's pool holds but no array uses are free for the weights too
    free = backend.xp.cuda.runtime.memGetInfo()[0] + \
        backend.xp.get_default_memory_pool().free_bytes()
    return device_budget(free, int(sessions) + scratch_estimate(cfg, prefill_chunk), None)


def scratch_estimate(cfg, prefill_chunk: int) -> int:
    """Bytes the engine's scratch may grow to for prefill chunks of this size: residual
    streams, queries, attention scores, expert activations, logits, plus 1 GiB of slack
    (CUDA graphs, cuBLAS workspaces, widened expert slabs, and the layer's host experts that
    prefill stages on the device: ~0.3 GB for V4-Flash on one H200; without room for them
    prefill reads the host experts in place)."""
    C, D, H, d = prefill_chunk, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    k, inter = cfg.num_experts_per_tok, cfg.moe_intermediate_size
    per_token = (6 * cfg.hc_mult * D + 4 * H * d + 2 * H * (cfg.sliding_window + C)
                 + 2 * k * (2 * inter + D)) * 4
    return C * per_token + 2 * cfg.vocab_size * 4 + GIB


def device_budget(free_bytes: int, reserve_bytes: int, limit_gib: float | None) -> int:
    """Bytes the weights may take on the device: --gpu-memory-gib when given, else the free
    memory less what the sessions and the scratch will need."""
    if limit_gib is not None:
        return int(limit_gib * GIB)
    return max(0, int(free_bytes) - int(reserve_bytes))
