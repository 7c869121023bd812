"""The multi-token-prediction (MTP) block and its per-session state (docs/MODEL.md, MTP block).

The block drafts the token after next: with the main model's final streams H at position p-1
(what predicted the token at p) and the token t at p it computes

    X = e_proj(RMSNorm_enorm(embed[t])) (on every stream) + h_proj(RMSNorm_hnorm(H))
    X = one sliding, non-hash decoder layer over X, with its own raw K=V window
    logits = lm_head(RMSNorm_norm(HyperHead_mtp(X)))        (embedding and head are shared)

and its argmax is the draft for position p+1. Further drafts chain: X becomes the next H and
the draft the next token, one position on (the DeepSeek-V3 pairing of hidden state i with
token i+1).

The block's window lives in the session (`MtpState`): a ring of raw rows plus the position
each slot holds, so the window may start empty (after a prefill, which never runs the block)
and rows of rejected drafts can be taken back exactly.
"""

from __future__ import annotations

import math
import os

import numpy as np

from ds4.kernels import widen
from ds4.model import gpu_mtp
from ds4.model.attention import attention
from ds4.model.checkpoint_names import mtp_shapes
from ds4.model.config import SLIDING, ModelConfig
from ds4.model.hyper_connection import hc_collapse, hc_expand, hc_weights, hyper_head, rms_norm
from ds4.model.linear import linear
from ds4.model.moe import moe
from ds4.model.packed import PackedMatrix

PREFIX = "mtp.0."


def extra_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The block's own tensors besides its layer (official names after `mtp.0.`)."""
    D, hc = cfg.hidden_size, cfg.hc_mult
    return {"e_proj.weight": (D, D), "h_proj.weight": (D, D), "enorm.weight": (D,),
            "hnorm.weight": (D,), "norm.weight": (D,), "hc_head_fn": (hc, hc * D),
            "hc_head_base": (hc,), "hc_head_scale": (1,)}


class MtpWeights:
    """The block's tensors: `w["self_attn.kv_proj.weight"]` (HF names inside a layer, as
    `LayerWeights`), `w["e_proj.weight"]` and the other extras, and its expert bank."""

    def __init__(self, tensors: dict, experts):
        self.tensors = tensors
        self.experts = experts

    def __getitem__(self, name: str):
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    @property
    def nbytes(self) -> int:
        """Bytes of the block's device tensors and experts."""
        return sum(int(t.nbytes) for t in self.tensors.values()) + int(self.experts.nbytes)

    def bind(self, scratch) -> None:
        """Packed tensors widen into the engine's scratch, as the main model's do."""
        for t in self.tensors.values():
            if isinstance(t, PackedMatrix):
                t.scratch = scratch
        self.experts.bind(scratch)


def load_mtp(stored: dict, cfg: ModelConfig, xp, packed: bool,
             block: tuple[int, int]) -> MtpWeights:
    """The block from a checkpoint's mapped `mtp.0.*` tensors (bf16 or FP8 / FP4 packed)."""
    from ds4.model.checkpoint_names import official_named
    from ds4.model.weights import WeightsError, device_tensors, official_bank

    if not any(name.startswith(PREFIX) for name in stored):
        raise WeightsError("the checkpoint has no MTP block (no mtp.0.* tensors): --mtp needs "
                           "one")
    layer = cfg.num_hidden_layers  # the block's tensors under a layer index of their own
    as_layer = {f"layers.{layer}.{k[len(PREFIX):]}": t for k, t in stored.items()
                if k.startswith(PREFIX)}
    prefix = f"model.layers.{layer}."
    named = {k[len(prefix):]: t for k, t in official_named(as_layer).items()}
    named.update({k: stored[PREFIX + k] for k in extra_shapes(cfg) if PREFIX + k in stored})
    wanted = {**mtp_shapes(cfg), **extra_shapes(cfg)}
    for name, shape in wanted.items():
        if name not in named:
            raise WeightsError(f"checkpoint lacks MTP tensor {PREFIX}... (HF {name}), "
                               f"expected shape {list(shape)}")
        if tuple(named[name].shape) != tuple(shape):
            raise WeightsError(f"MTP tensor {named[name].name} has shape "
                               f"{list(named[name].shape)}, expected {list(shape)}")
    tensors = device_tensors(xp, {k: named[k] for k in wanted}, packed, block)
    return MtpWeights(tensors, official_bank(xp, as_layer, cfg, layer, block))


def dummy_mtp(cfg: ModelConfig, xp, seed: int) -> MtpWeights:
    """Random block weights in the formats `--load-format dummy` draws the main model in."""
    from ds4.model import dummy

    layer, fp8 = cfg.num_hidden_layers, cfg.quantization_config is not None
    tensors = {name: dummy.dense_tensor(xp, cfg, f"model.layers.{layer}.{name}", shape, seed, fp8)
               for name, shape in mtp_shapes(cfg).items()}
    for name, shape in extra_shapes(cfg).items():
        key = f"mtp.{name}"
        if name in ("e_proj.weight", "h_proj.weight"):  # FP8 in the release, as wq_a is
            rnd = dummy.Random(xp, seed, key)
            tensors[name] = (dummy.fp8_matrix(rnd, shape, dummy.weight_block(cfg)) if fp8
                             else dummy.bf16_words(rnd, shape, 1 / math.sqrt(shape[1])))
        else:
            tensors[name] = dummy.dense_tensor(xp, cfg, key, shape, seed, False)
    fmt = dummy.expert_format(cfg)
    if fmt is None:
        bank = dummy._word_bank(xp, cfg, layer, seed)
    else:
        from ds4.model.expert_bank import ExpertBank

        bank = ExpertBank.from_stacks(xp, *(dummy._whole_stack(xp, cfg, fmt, layer, kind, seed)
                                            for kind in ("gate_up", "down")))
    return MtpWeights(tensors, bank)


def mtp_bytes(cfg: ModelConfig) -> int:
    """Device bytes the block takes (what --mtp adds to the weights), estimated from shapes."""
    from ds4.model.dummy import expert_bytes

    dense = sum(4 * int(np.prod(s)) for s in {**mtp_shapes(cfg), **extra_shapes(cfg)}.values())
    return dense + cfg.n_routed_experts * expert_bytes(cfg)


class MtpState:
    """One session's MTP window: raw rows by slot (position p in slot p % window), the
    position each slot holds (-1: none), and the main model's last streams (the next draft's
    input H) with the token count they belong to."""

    kind = SLIDING  # what attention() reads of a layer's state
    compressor = None
    indexer = None

    def __init__(self, xp, cfg: ModelConfig):
        self.xp = xp
        self.raw = xp.zeros((cfg.sliding_window, cfg.head_dim), dtype=xp.float32)
        self.positions = np.full(cfg.sliding_window, -1, dtype=np.int64)
        self.hidden = None  # xp [hc, D]: the main model's final streams of the last token
        self.hidden_at = -1  # how many tokens the session held when `hidden` was taken

    def forget_from(self, n: int) -> None:
        """Drop every row of positions >= n (the session no longer holds those tokens)."""
        self.positions[self.positions >= n] = -1
        if self.hidden_at != n:
            self.hidden, self.hidden_at = None, -1

    def reset(self) -> None:
        """Empty window, no streams."""
        self.forget_from(0)

    def keep(self, positions: list[int]) -> tuple:
        """What writing rows at `positions` overwrites, for `undo` (rows, slot positions)."""
        slots = [p % self.raw.shape[0] for p in positions]
        return slots, self.raw[slots].copy(), self.positions[slots].copy()

    def undo(self, kept: tuple, first: int) -> None:
        """Put back the slots of rows written at positions >= first (rejected drafts)."""
        slots, rows, held = kept
        for j, slot in enumerate(slots):
            if self.positions[slot] >= first:
                self.raw[slot] = rows[j]
                self.positions[slot] = held[j]

    def export(self, to_host) -> dict[str, np.ndarray]:
        """Host arrays of the window and the last streams (snapshots)."""
        out = {"mtp/raw": to_host(self.raw), "mtp/positions": self.positions.copy(),
               "mtp/hidden_at": np.array([self.hidden_at], np.int64)}
        if self.hidden is not None:
            out["mtp/hidden"] = to_host(self.hidden)
        return out

    def load(self, arrays: dict) -> None:
        """Inverse of export; a snapshot without MTP arrays leaves the window empty."""
        if "mtp/raw" not in arrays:
            self.reset()
            return
        self.raw[...] = self.xp.asarray(arrays["mtp/raw"])
        self.positions[...] = arrays["mtp/positions"]
        self.hidden_at = int(arrays["mtp/hidden_at"][0])
        hidden = arrays.get("mtp/hidden")
        self.hidden = None if hidden is None else self.xp.asarray(hidden)


class MtpBlock:
    """The block's math bound to a model (its config, ropes, scratch, shared embedding and
    head) and the block's weights. On the GPU a draft step is one replayed CUDA graph
    (ds4/model/gpu_mtp.py) where the kernels cover the model; elsewhere, or with
    DS4_MTP_EAGER=1, it is the eager model code below."""

    def __init__(self, model, weights: MtpWeights):
        self.model, self.w = model, weights
        weights.bind(model.scratch)
        self.eager = (os.environ.get("DS4_MTP_EAGER", "") not in ("", "0")
                      or gpu_mtp.supported(model, weights) is not None)
        self._kernels = None  # the MtpDecoder, built on the first kernel step

    @property
    def kernels(self):
        """The block's kernel draft step (ds4/model/gpu_mtp.py), built on first use."""
        if self._kernels is None:
            self._kernels = gpu_mtp.MtpDecoder.from_block(self)
        return self._kernels

    def new_state(self) -> MtpState:
        """An empty window for one session."""
        return MtpState(self.model.xp, self.model.cfg)

    def step(self, state: MtpState, hidden, token: int, position: int):
        """One token at `position` through the block: (logits [V], output streams [hc, D]).

        The row it writes into the window is noted in `state.positions`.
        """
        if self.eager:
            logits, X = self._eager_step(state, hidden, token, position)
        else:
            logits, X = self.kernels.step(state, hidden, token, position)
        state.positions[position % state.raw.shape[0]] = position
        return logits, X

    def pick(self, logits) -> tuple[int, float] | None:
        """(argmax, top-1 minus runner-up) of the logits the last kernel step returned, as its
        graph computed them; None for the eager step's (the caller reduces those itself)."""
        return None if self._kernels is None else self._kernels.pick(logits)

    def _eager_step(self, state: MtpState, hidden, token: int, position: int):
        m, xp, cfg, w = self.model, self.model.xp, self.model.cfg, self.w
        eps = cfg.rms_norm_eps
        ids = xp.asarray([int(token)], dtype=xp.int64)
        e = rms_norm(xp, widen(m.weights["model.embed_tokens.weight"][ids], xp),
                     w["enorm.weight"], eps)
        h = rms_norm(xp, hidden, w["hnorm.weight"], eps)
        X = (linear(xp, e, w["e_proj.weight"])[:, None, :]
             + linear(xp, h, w["h_proj.weight"])[None, :, :])
        X = self._layer(state, xp.ascontiguousarray(X, dtype=xp.float32), ids, position)
        return self._head(X)[0], X[0]

    def _layer(self, state: MtpState, X, ids, position: int):
        m, xp, cfg, w = self.model, self.model.xp, self.model.cfg, self.w
        eps = cfg.rms_norm_eps
        step = self._step(state, ids, position)
        pre, post, comb = self._hc("attn_hc", X)
        u = rms_norm(xp, hc_collapse(xp, pre, X), w["input_layernorm.weight"], eps)
        X = hc_expand(xp, X, attention(xp, m, w, state, u, step), post, comb)
        pre, post, comb = self._hc("ffn_hc", X)
        u = rms_norm(xp, hc_collapse(xp, pre, X), w["post_attention_layernorm.weight"], eps)
        f = moe(xp, cfg, w, u, ids, False, m.backend.to_numpy)
        return hc_expand(xp, X, f, post, comb)

    def _step(self, state: MtpState, ids, position: int):
        """The main model's Step for one token, masked to the rows the window really holds."""
        from ds4.model.forward import Step

        xp, W = self.model.xp, state.raw.shape[0]
        positions = xp.asarray([position], dtype=xp.int64)
        cos_sin = {kind: rope.cos_sin(positions) for kind, rope in self.model.ropes.items()}
        held = np.append(state.positions, position)
        visible = (held >= 0) & (held <= position) & (held > position - W)
        bias = xp.asarray(np.where(visible, 0.0, -np.inf).astype(np.float32)[None, :])
        return Step(position, positions, ids, cos_sin, bias, dense_window=False)

    def _hc(self, name: str, X):
        cfg = self.model.cfg
        return hc_weights(self.model.xp, self.w[name + ".fn"], self.w[name + ".base"],
                          self.w[name + ".scale"], X, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                          cfg.rms_norm_eps)

    def _head(self, X):
        xp, cfg, w = self.model.xp, self.model.cfg, self.w
        y = hyper_head(xp, w["hc_head_fn"], w["hc_head_base"], w["hc_head_scale"], X,
                       cfg.hc_eps, cfg.rms_norm_eps)
        y = rms_norm(xp, y, w["norm.weight"], cfg.rms_norm_eps)
        return linear(xp, y, self.model.weights["lm_head.weight"])
