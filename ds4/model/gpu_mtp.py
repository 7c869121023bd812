"""The MTP block's draft step made only of RawKernels (ds4/kernels), captured on the GPU as one
CUDA graph (batch 1) and replayed for every draft token; with NumPy arrays the same launchers'
twins run it eagerly (tests).

The step is the block's math (ds4/model/mtp.py) through the kernels the main decode uses
(ds4/model/gpu_decode.py): e = RMSNorm(embed[token]), X = e_proj(e) + h_proj(RMSNorm(H)) on
every stream, one sliding layer (mHC, attention, mHC, MoE), the hyper head, the final norm,
the main model's head and the draft's pick of its logits (argmax and margin). Its window is
sparse (only drafted positions wrote rows; rejected drafts' rows were put back), so the
attention masks ring slots by the positions they hold (ds4/kernels/mtp.cu) instead of assuming
a dense ring.

The graph holds no session's address: the token, the position, the session's ring address and
the position each ring slot holds are in a `WindowTable` that one host-to-device copy fills
before each replay, and the session's input streams are copied into the step's own buffer. The
ring is written in place (the session's `MtpState.raw`); its held positions stay on the host
(`MtpState.positions`, what keep / undo / export read), so nothing on the device needs syncing.
"""

from __future__ import annotations

import numpy as np

from ds4.kernels import attention as at
from ds4.kernels import hyper_connection as hc
from ds4.kernels import moe as route
from ds4.kernels import mtp as mt
from ds4.kernels import norm, quant, rope
from ds4.model import gpu_weights
from ds4.model.gpu_batch import ProjectionPlan, matvec_rows
from ds4.model.gpu_moe import moe_rows, row_moe_fits, row_moe_scratch
from ds4.model.gpu_weights import LAYER_MATRICES, SHARED_EXPERT, kernel_weight
from ds4.model.packed import FP4, PackedMatrix

SMALL = ("attn_hc.fn", "attn_hc.base", "attn_hc.scale", "ffn_hc.fn", "ffn_hc.base",
         "ffn_hc.scale", "input_layernorm.weight", "post_attention_layernorm.weight",
         "self_attn.q_a_norm.weight", "self_attn.kv_norm.weight", "self_attn.sinks",
         "mlp.gate.e_score_correction_bias", "enorm.weight", "hnorm.weight", "norm.weight",
         "hc_head_fn", "hc_head_base", "hc_head_scale")


def block_tensors(xp, weights) -> dict:
    """The block's tensors in kernel form by their names in MtpWeights (plus stacked experts)."""
    t = {name: kernel_weight(xp, weights[name])
         for name in LAYER_MATRICES + ("e_proj.weight", "h_proj.weight")}
    t.update({name: xp.ascontiguousarray(weights[name], dtype=xp.float32) for name in SMALL})
    for name in SHARED_EXPERT:
        key = f"mlp.shared_experts.{name}.weight"
        if key in weights:
            t[key] = kernel_weight(xp, weights[key])
    t["experts.gate_up"], t["experts.down"] = (kernel_weight(xp, w)
                                               for w in weights.experts.stacked)
    return t


def supported(model, weights) -> str | None:
    """Why the draft step cannot run through the kernels (None when it can)."""
    if model.kernel_decoder is None:
        return "the main model's decode does not run through the kernels"
    bank = weights.experts
    if not bank.resident or getattr(bank, "placed_stacks", ()):
        return "the block's experts are not resident device stacks"
    packed = [t for t in weights.tensors.values() if isinstance(t, PackedMatrix)]
    if bank.packed:
        gate_up, down = bank.stacked
        if gate_up.fmt != FP4 and gate_up.shape[1] // 2 % gate_up.block[0]:
            return "FP8 experts whose gate / up halves split a scale tile"
        packed += [gate_up, down]
    if any(not m.kernel_ready for m in packed):
        return "a packed matrix the kernels cannot read (scale tile or width)"
    return None


class WindowTable:
    """What one draft replay reads of its session: [position, token] int32, the address of
    the session's ring, then the position each ring slot holds (int32 [cap], -1: empty)."""

    def __init__(self, xp, cap: int):
        self.xp, self.cap = xp, cap
        self.host = np.zeros(2 + (cap + 1) // 2, dtype=np.int64)
        self.device = xp.zeros(self.host.size, dtype=xp.int64)
        ints = self.device.view(xp.int32)
        self.pos, self.token, self.held = ints[0:1], ints[1:2], ints[4:4 + cap]
        self.raw = None  # the ring of the last fill (what the NumPy twins read)

    @property
    def raw_word(self) -> np.uint64:
        """Device address of the word holding the ring's address (0 for NumPy arrays)."""
        return np.uint64(0) if self.xp is np else np.uint64(self.device.data.ptr + 8)

    def fill(self, state, token: int, position: int, stream=None) -> None:
        """One session's step: its window, the token and its position; one copy to the device."""
        ints = self.host.view(np.int32)
        ints[0], ints[1] = position, token
        ints[4:4 + self.cap] = state.positions
        self.raw = state.raw
        if self.xp is np:
            self.device[...] = self.host
            return
        self.host[1] = int(state.raw.data.ptr)
        self.device.set(self.host, stream=stream)


class MtpDecoder:
    """The block's draft step through ds4/kernels, one CUDA graph on CuPy."""

    def __init__(self, cfg, top: dict, t: dict, freqs, xp, kv_fp8: bool = False):
        self.cp, self.cfg, self.top, self.t, self.freqs = xp, cfg, top, t, freqs
        self.kv_fp8 = kv_fp8
        self.table = WindowTable(xp, cfg.sliding_window)
        self.buf = self._buffers()
        self.rows = [{name: (a[0:1] if a.ndim == 1 else a[0]) for name, a in self.buf.items()}]
        self.projection = ProjectionPlan(xp, [(t["self_attn.q_a_proj.weight"], self.buf["qlat"]),
                                              (t["self_attn.kv_proj.weight"], self.buf["kv"])], 1)
        fits = row_moe_fits(t, 1, cfg.num_experts_per_tok)
        self.moe_scratch = row_moe_scratch(xp, cfg, [t], 1) if fits else None
        self.graph = None
        self._last = None  # the logits the last step returned (what `pick` reads the pick of)
        self._warm = False  # one eager step ran (kernels compiled and loaded)
        self._stream = None
        self.use_graph = True

    @classmethod
    def from_block(cls, block) -> MtpDecoder:
        """Kernel-form tensors of an MtpBlock's weights and its model's embedding and head."""
        m = block.model
        xp = m.xp
        main = getattr(m.kernel_decoder, "decoder", None)  # its embedding and head, if built
        top = main.top if main is not None else gpu_weights.model_tensors(xp, m.weights)
        return cls(m.cfg, top, block_tensors(xp, block.w),
                   gpu_weights.rope_frequencies(xp, m.ropes["main"]), xp,
                   kv_fp8=m.kv_fp8 is not None)

    def _buffers(self) -> dict:
        cfg, cp, f = self.cfg, self.cp, self.cp.float32
        D, H, d, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
        k, inter = cfg.num_experts_per_tok, cfg.moe_intermediate_size
        sizes = {"hidden": (n, D), "hn": (n, D), "hp": (n, D), "e": (1, D), "en": (1, D),
                 "ep": (D,), "X": (n, D), "mix": (2 * n + n * n,), "head_mix": (n,),
                 "post_comb": (n + n * n,), "u": (D,), "h": (D,), "y": (D,),
                 "qlat": (cfg.q_lora_rank,), "q": (H, d), "kv": (d,), "kvrow": (1, d),
                 "o": (H, d), "z": (cfg.o_groups * cfg.o_lora_rank,),
                 "router": (cfg.n_routed_experts,), "wts": (k,), "act": (k + 1, inter),
                 "shared_act": (1, inter * max(cfg.n_shared_experts, 1)),
                 "logits": (cfg.vocab_size,),
                 "attn_part": (mt.partial_size(H, d, cfg.sliding_window),)}
        buf = {name: cp.zeros((1, *shape), dtype=f) for name, shape in sizes.items()}
        buf["idx"] = cp.zeros((1, k), dtype=cp.int32)
        buf["pick"] = cp.zeros((1, 3), dtype=cp.int32)  # the draft's pick (mt.top_gap)
        # post 1, comb the identity: hc_post then adds e_proj(e) to every stream exactly
        buf["add_rows"] = cp.asarray(np.concatenate([np.ones(n), np.eye(n).reshape(-1)])
                                     .astype(np.float32)[None, :])
        return buf

    # ---- steps

    def step(self, state, hidden, token: int, position: int):
        """One token at `position` through the block: fresh (logits [V], streams [hc, D]); the
        row it writes lands in state.raw (the caller notes it in state.positions)."""
        if self.cp is np:  # the NumPy twins (tests): eager, no stream
            self.table.fill(state, int(token), int(position))
            self.buf["hidden"][0][...] = hidden
            self.run()
            out = self.buf["logits"][0].copy(), self.buf["X"][0].copy()
        else:
            out = self._replay(state, hidden, int(token), int(position))
        self._last = out[0]
        return out

    def pick(self, logits) -> tuple[int, float] | None:
        """(argmax, top logit minus the runner-up's) of the last step's logits, as the graph
        computed them (one 12-byte copy); None for any other logits."""
        if logits is not self._last:
            return None
        words = self.buf["pick"][0]
        return mt.read_top_gap(words if self.cp is np else words.get())

    def _replay(self, state, hidden, token: int, position: int):
        cp, stream = self.cp, self.stream
        stream.wait_event(cp.cuda.get_current_stream().record())
        with stream:
            self.table.fill(state, token, position, stream=stream)
            self.buf["hidden"][0][...] = hidden
            if self.graph is None and self.use_graph and self._warm:
                stream.begin_capture()
                self.run()
                self.graph = stream.end_capture()
            if self.graph is not None and self.use_graph:
                self.graph.launch(stream)
            else:  # the first step: eager, which also compiles and loads every kernel
                self.run()
                self._warm = True
            out = self.buf["logits"][0].copy(), self.buf["X"][0].copy()
        cp.cuda.get_current_stream().wait_event(stream.record())
        return out

    @property
    def stream(self):
        """The non-blocking stream the graph is captured and replayed on."""
        if self._stream is None:
            self._stream = self.cp.cuda.Stream(non_blocking=True)
        return self._stream

    def run(self) -> None:
        """Enqueue one draft step for the session of the table (no host syncs)."""
        self.run_input()
        self.run_layer()
        self.run_head()

    def run_input(self) -> None:
        """X[i] = e_proj(RMSNorm_enorm(embed[token])) + h_proj(RMSNorm_hnorm(H[i]))."""
        cfg, b, t, eps = self.cfg, self.buf, self.t, self.cfg.rms_norm_eps
        hc.embed_streams(self.top["embed"], self.table.token, b["e"])
        norm.rms_norm(b["e"][0], t["enorm.weight"], b["en"][0], eps)
        matvec_rows(t["e_proj.weight"], b["en"][0], b["ep"], 1)
        norm.rms_norm(b["hidden"][0], t["hnorm.weight"], b["hn"][0], eps)
        matvec_rows(t["h_proj.weight"], b["hn"][0], b["hp"][0], cfg.hc_mult)
        hc.hc_post(b["hp"], b["ep"], b["add_rows"], b["X"])

    def run_layer(self) -> None:
        """The block's sliding layer on X: mHC + window attention, then mHC + MoE."""
        b = self.buf
        self._unit("attn_hc", "input_layernorm.weight")
        self._attention()
        hc.hc_post(b["X"], b["y"], b["post_comb"], b["X"])
        self._unit("ffn_hc", "post_attention_layernorm.weight")
        self._moe()
        hc.hc_post(b["X"], b["y"], b["post_comb"], b["X"])

    def run_head(self) -> None:
        """logits = W_head RMSNorm_norm(HyperHead_mtp(X)) (the main model's head), and the
        draft's pick of them."""
        cfg, b, t = self.cfg, self.buf, self.t
        hc.hc_mix(t["hc_head_fn"], b["X"], b["head_mix"], cfg.rms_norm_eps)
        hc.hc_pre(b["head_mix"], t["hc_head_scale"], t["hc_head_base"], b["X"], b["u"],
                  b["post_comb"], cfg.hc_sinkhorn_iters, cfg.hc_eps, head=True)
        norm.rms_norm(b["u"], t["norm.weight"], b["h"], cfg.rms_norm_eps)
        matvec_rows(self.top["head"], b["h"], b["logits"], 1)
        mt.top_gap(b["logits"][0], b["pick"][0])

    def _unit(self, unit: str, norm_name: str) -> None:
        """h = RMSNorm_w(sum_i pre_i X_i) of one mHC unit; post/comb kept for hc_post."""
        cfg, b, t = self.cfg, self.buf, self.t
        hc.hc_mix(t[unit + ".fn"], b["X"], b["mix"], cfg.rms_norm_eps)
        hc.hc_pre_norm(b["mix"], t[unit + ".scale"], t[unit + ".base"], b["X"], t[norm_name],
                       b["h"], b["post_comb"], cfg.hc_sinkhorn_iters, cfg.hc_eps,
                       cfg.rms_norm_eps)

    def _attention(self) -> None:
        """y = the attention output of h over the session's window and the token's own row;
        the row then goes into the window."""
        cfg, b, t, tab = self.cfg, self.buf, self.t, self.table
        eps, r, H, d = cfg.rms_norm_eps, cfg.qk_rope_head_dim, cfg.num_attention_heads, cfg.head_dim
        self.projection.run(b["h"], 1)
        norm.rms_norm(b["qlat"], t["self_attn.q_a_norm.weight"], b["qlat"], eps)
        matvec_rows(t["self_attn.q_b_proj.weight"], b["qlat"], b["q"].reshape(1, -1), 1)
        q = b["q"][0]
        norm.rms_norm_rope(q, None, eps, tab.pos, self.freqs, r, rows_per_pos=H)
        at.attention_store_kv(b["kv"][0], t["self_attn.kv_norm.weight"], self.freqs, tab.pos,
                              b["kvrow"][0], r, eps)
        if self.kv_fp8:
            quant.kv_fp8_slot(b["kvrow"][0], d - r, tab.pos)
        fused = d % 32 == 0  # the combine kernel turns the output back (whole warps of pairs)
        mt.window_attention(q, b["kvrow"][0], tab, t["self_attn.sinks"], b["o"][0],
                            b["attn_part"][0], self.freqs if fused else None, r)
        if not fused:
            rope.rope_tail(b["o"][0], tab.pos, self.freqs, r, rows_per_pos=H, sign=-1.0)
        mt.window_store(b["kvrow"][0], tab)
        matvec_rows(t["self_attn.o_a_proj.weight"], b["o"].reshape(1, -1), b["z"], 1,
                    rows_per_group=cfg.o_lora_rank)
        matvec_rows(t["self_attn.o_b_proj.weight"], b["z"], b["y"], 1)

    def _moe(self) -> None:
        """y = routed experts (routed by this token's h) + shared expert of h."""
        cfg, b, t, r = self.cfg, self.buf, self.t, self.rows[0]
        matvec_rows(t["mlp.gate.weight"], b["h"], b["router"], 1)
        route.moe_route(r["router"], t["mlp.gate.e_score_correction_bias"], None,
                        self.table.token, cfg.num_experts_per_tok, cfg.routed_scaling_factor,
                        r["idx"], r["wts"])
        moe_rows(cfg, t, b, self.rows, 1, self.moe_scratch)
