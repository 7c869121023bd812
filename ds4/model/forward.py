"""A chunk of tokens through all layers (docs/MODEL.md, The forward pass)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

from ds4.backend import Array
from ds4.kernels import widen
from ds4.model import quant
from ds4.model.attention import attention, attention_rows, window_bias
from ds4.model.config import ModelConfig
from ds4.model.graph_decode import kernel_decoder_for
from ds4.model.hyper_connection import hc_collapse, hc_expand, hc_weights, hyper_head, rms_norm
from ds4.model.linear import linear
from ds4.model.moe import moe, stage_ahead
from ds4.model.rope import Rope
from ds4.model.scratch import Scratch
from ds4.model.state import SessionState
from ds4.model.weights import Weights


@dataclass
class Step:
    """What every layer needs to know about the chunk being run."""

    start: int
    positions: Array  # xp int64 [S]
    token_ids: Array  # xp int64 [S]
    cos_sin: dict[str, tuple[Array, Array]]  # rope kind -> (cos, sin) at the chunk's positions
    window_bias: Array  # xp f32 [S, window + S]: raw-row mask, the same for every layer
    # every ring row of the window's positions is held (the fused chunk-attention kernel masks
    # by position alone); False where window_bias hides rows too (the MTP block's sparse window)
    dense_window: bool = True


class Model:
    """The model math bound to one config, its weights, a backend and the engine's scratch."""

    def __init__(self, cfg: ModelConfig, weights: Weights, backend, quantize: bool):
        xp = backend.xp
        self.xp, self.backend, self.cfg, self.weights = xp, backend, cfg, weights
        self.scratch = Scratch(xp)
        weights.bind(self.scratch)  # packed weights widen into it per use
        self.ropes = {"main": Rope(xp, cfg.rope_main, cfg.qk_rope_head_dim),
                      "compress": Rope(xp, cfg.rope_compress, cfg.qk_rope_head_dim)}
        self.quantize = quantize
        self.kv_fp8 = partial(quant.kv_fp8_simulation, xp,
                              rope_dim=cfg.qk_rope_head_dim) if quantize else None
        self.indexer_qat = None
        if quantize and cfg.index_head_dim & (cfg.index_head_dim - 1) == 0:
            matrix = xp.asarray(quant.hadamard(cfg.index_head_dim))
            self.indexer_qat = partial(quant.indexer_fp4_simulation, xp, hadamard_matrix=matrix)
        self.kernel_decoder = kernel_decoder_for(self)  # GPU: one-token steps as CUDA graphs
        self.batch_rows = batch_rows_default(self.kernel_decoder is not None)

    def forward(self, state: SessionState, token_ids: list[int]):
        """Run tokens at positions state.n.. through every layer; logits [V] of the last one."""
        if self.kernel_decoder is not None and len(token_ids) == 1:
            return self.kernel_decoder.decode(state, token_ids[0])
        return self._head(self._streams(state, token_ids)[-1:])[0]

    def forward_rows(self, state: SessionState, token_ids: list[int], every_row: bool = True):
        """`forward` through the model code (no CUDA graph), keeping what drafting needs:
        (logits [S, V], final streams [S, hc, D]) of every token, or of the last one only."""
        X = self._streams(state, token_ids)
        X = X if every_row else X[-1:]
        return self._head(X), X

    def _streams(self, state: SessionState, token_ids: list[int]):
        """The final streams [S, hc, D] of tokens at positions state.n.. (state advanced)."""
        xp, cfg = self.xp, self.cfg
        step = self._step(state.n, token_ids)
        x = widen(self.weights["model.embed_tokens.weight"][step.token_ids], xp)
        X = xp.ascontiguousarray(xp.broadcast_to(x[:, None, :],
                                                 (x.shape[0], cfg.hc_mult, x.shape[1])))
        for i, layer_state in enumerate(state.layers):
            X = self._layer(i, layer_state, X, step)
        state.n += len(token_ids)
        return X

    def decode_many(self, states: list[SessionState], token_ids: list[int]) -> list:
        """Logits [V] per session of one token each: one batched pass when `batch_rows`, else
        each session's own step (GPU: its CUDA graph replay) one after another."""
        if self.batch_rows:
            logits = self.decode_rows(states, token_ids)
            return [logits[b] for b in range(len(states))]
        return [self.forward(s, [t]) for s, t in zip(states, token_ids)]

    def decode_rows(self, states: list[SessionState], token_ids: list[int]):
        """One token for each of B sessions in one pass: logits [B, V].

        Shared matrices multiply the [B, D] block, each routed expert runs once on the rows
        that picked it, and attention, compressors and indexer run on each session's state.
        """
        xp, cfg = self.xp, self.cfg
        steps = [self._step(s.n, [t]) for s, t in zip(states, token_ids)]
        positions = xp.asarray([s.n for s in states], dtype=xp.int64)
        cos_sin = {kind: rope.cos_sin(positions) for kind, rope in self.ropes.items()}
        ids = xp.asarray(token_ids, dtype=xp.int64)
        x = widen(self.weights["model.embed_tokens.weight"][ids], xp)
        streams = (x.shape[0], cfg.hc_mult, x.shape[1])
        X = xp.ascontiguousarray(xp.broadcast_to(x[:, None, :], streams))
        for i in range(len(states[0].layers)):
            X = self._layer_rows(i, [s.layers[i] for s in states], X, ids, steps, cos_sin)
        for s in states:
            s.n += 1
        return self._head(X)

    def _layer_rows(self, i: int, layer_states: list, X, ids, steps: list, cos_sin: dict):
        """`_layer` for B sessions' single tokens: X [B, hc, D]."""
        xp, cfg = self.xp, self.cfg
        lw = self.weights.layer(i)
        eps = cfg.rms_norm_eps
        pre, post, comb = self._hc(lw, "attn_hc", X)
        h = rms_norm(xp, hc_collapse(xp, pre, X), lw["input_layernorm.weight"], eps)
        a = attention_rows(xp, self, lw, layer_states, h, steps, cos_sin)
        X = hc_expand(xp, X, a, post, comb)
        pre, post, comb = self._hc(lw, "ffn_hc", X)
        h = rms_norm(xp, hc_collapse(xp, pre, X), lw["post_attention_layernorm.weight"], eps)
        hashed = cfg.mlp_layer_types[i] == "hash_moe"
        f = moe(xp, cfg, lw, h, ids, hashed, self.backend.to_numpy)
        return hc_expand(xp, X, f, post, comb)

    def _step(self, start: int, token_ids: list[int]) -> Step:
        xp = self.xp
        positions = xp.arange(start, start + len(token_ids), dtype=xp.int64)
        cos_sin = {kind: rope.cos_sin(positions) for kind, rope in self.ropes.items()}
        bias = window_bias(xp, start, positions, self.cfg.sliding_window)
        return Step(start, positions, xp.asarray(token_ids, dtype=xp.int64), cos_sin, bias)

    def _layer(self, i: int, layer_state, X, step: Step):
        xp, cfg = self.xp, self.cfg
        lw = self.weights.layer(i)
        eps = cfg.rms_norm_eps
        ahead = stage_ahead(xp, cfg, lw, len(step.token_ids))  # host experts' copy, if staged
        pre, post, comb = self._hc(lw, "attn_hc", X)
        u = hc_collapse(xp, pre, X)
        h = rms_norm(xp, u, lw["input_layernorm.weight"], eps)
        X = hc_expand(xp, X, attention(xp, self, lw, layer_state, h, step), post, comb)
        pre, post, comb = self._hc(lw, "ffn_hc", X)
        u = hc_collapse(xp, pre, X)
        h = rms_norm(xp, u, lw["post_attention_layernorm.weight"], eps)
        hashed = cfg.mlp_layer_types[i] == "hash_moe"
        f = moe(xp, cfg, lw, h, step.token_ids, hashed, self.backend.to_numpy, ahead)
        return hc_expand(xp, X, f, post, comb)

    def _hc(self, lw, name: str, X):
        cfg = self.cfg
        return hc_weights(self.xp, lw[name + ".fn"], lw[name + ".base"], lw[name + ".scale"], X,
                          cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)

    def _head(self, X):
        """logits [S, V] = W_head @ RMSNorm(HyperHead(X))."""
        xp, cfg, w = self.xp, self.cfg, self.weights
        y = hyper_head(xp, w["model.hc_head.hc_fn"], w["model.hc_head.hc_base"],
                       w["model.hc_head.hc_scale"],
                       X, cfg.hc_eps, cfg.rms_norm_eps)
        y = rms_norm(xp, y, w["model.norm.weight"], cfg.rms_norm_eps)
        return linear(xp, y, w["lm_head.weight"])


def batch_rows_default(graph_steps: bool) -> bool:
    """Whether several sessions' tokens run as one batched pass: DS4_DECODE_BATCH=rows or
    =replay decides; by default yes, except where single steps replay CUDA graphs (the batched
    pass is the eager model code there, which the launches bound; see docs/PERF.md)."""
    choice = os.environ.get("DS4_DECODE_BATCH", "")
    if choice in ("rows", "replay"):
        return choice == "rows"
    return not graph_steps
