"""One-token decode made only of RawKernels, captured per session as a CUDA graph and replayed.

Every variable of a decode step (position, token, counts of rows) is read by the kernels from
device memory, so a captured graph stays valid as the session grows: before each replay a small
host-to-device copy writes the token and position into the decoder's `pos_token` buffer.
A graph is captured per session because it holds the addresses of that session's state arrays;
the transient buffers below are shared by all sessions, which is safe because replays run one at
a time on one stream and every buffer is written before it is read within a step.
"""

from __future__ import annotations

import weakref

import numpy as np

from ds4.kernels import attention as at
from ds4.kernels import compressor as cm
from ds4.kernels import hyper_connection as hc
from ds4.kernels import indexer as ix
from ds4.kernels import moe, quant, sampling
from ds4.kernels.gemv import gemv, gemv_many, gemv_table
from ds4.kernels.norm import rms_norm
from ds4.kernels.rope import rope_tail
from ds4.model import gpu_weights
from ds4.model.config import CSA, SLIDING
from ds4.model.packed import FP8, PackedMatrix


def matvec(w, x, y, rows_per_group: int | None = None) -> None:
    """y = W x for a bf16 / fp32 matrix or a packed FP8 / FP4 one, read in place."""
    if not isinstance(w, PackedMatrix):
        gemv(w, x, y, rows_per_group=rows_per_group)
        return
    from ds4.kernels import packed

    if w.fmt == FP8:
        packed.gemv_fp8(w.codes, w.scale, w.block[0], x, y, rows_per_group=rows_per_group)
    else:
        packed.gemv_fp4(w.codes, w.scale, x, y, rows_per_group=rows_per_group)


class KernelDecoder:
    """Decode step of a model through ds4/kernels, with one CUDA graph per session state."""

    def __init__(self, cfg, top: dict, layers: list[dict], freqs: dict, xp=None,
                 kv_fp8: bool = False, indexer_fp4: bool = False):
        if xp is None:
            import cupy as xp
        self.cp, self.cfg, self.top, self.layers, self.freqs = xp, cfg, top, layers, freqs
        # the official graph's rounding (Engine.open(quantize=...)), as ds4/model/quant.py does it
        self.kv_fp8, self.indexer_fp4 = kv_fp8, indexer_fp4
        self.pos_token = xp.zeros(2, dtype=xp.int32)  # [position, token]
        self.pos, self.token = self.pos_token[:1], self.pos_token[1:]
        self.buf = self._buffers(cfg)
        self.projections = [self._projection_plan(t) for t in layers]
        self.graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._seen: weakref.WeakSet = weakref.WeakSet()  # states that ran one eager step
        self._stream = None
        self.use_graphs = True

    @classmethod
    def from_model(cls, model) -> KernelDecoder:
        """Kernel-form copies of an engine Model's tensors (see gpu_weights.supported)."""
        xp, cfg = model.xp, model.cfg
        layers = [gpu_weights.layer_tensors(xp, cfg, model.weights, i)
                  for i in range(cfg.num_hidden_layers)]
        freqs = {k: gpu_weights.rope_frequencies(xp, r) for k, r in model.ropes.items()}
        return cls(cfg, gpu_weights.model_tensors(xp, model.weights), layers, freqs, xp,
                   kv_fp8=model.kv_fp8 is not None, indexer_fp4=model.indexer_qat is not None)

    def _buffers(self, cfg) -> dict:
        cp, f = self.cp, self.cp.float32
        D, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        n, k, inter = cfg.hc_mult, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        sizes = {"X": (n, D), "mix": (2 * n + n * n,), "post_comb": (n + n * n,), "u": (D,),
                 "h": (D,), "y": (D,), "qlat": (1, cfg.q_lora_rank), "q": (H, d), "kv": (d,),
                 "o": (H, d), "z": (cfg.o_groups * cfg.o_lora_rank,), "ckv": (2 * d,),
                 "cg": (2 * d,), "ickv": (2 * cfg.index_head_dim,),
                 "icg": (2 * cfg.index_head_dim,), "iq": (cfg.index_n_heads, cfg.index_head_dim),
                 "head_w": (cfg.index_n_heads,), "router": (cfg.n_routed_experts,),
                 "wts": (k,), "act": (k + 1, inter),
                 "shared_act": (1, inter * max(cfg.n_shared_experts, 1)),
                 "logits": (cfg.vocab_size,), "scores": (1,), "attn_part": (1,)}
        buf = {name: cp.zeros(shape, dtype=f) for name, shape in sizes.items()}
        buf["idx"] = cp.zeros(k, dtype=cp.int32)
        buf["sel"] = cp.zeros(max(cfg.index_topk, 1), dtype=cp.int32)
        buf["sel_count"] = cp.zeros(1, dtype=cp.int32)
        return buf

    def _projection_plan(self, t: dict) -> list:
        """Groups (kind, weights, outputs, device table or None) of the layer's projections of h
        that the attention side needs: bf16 (or fp32) matrices of one dtype as one gemv_many
        launch, packed FP8 ones of one width and tile as one gemv_many_fp8 launch, any other
        one by one."""
        b, p, ip = self.buf, "self_attn.compressor.", "self_attn.compressor.indexer."
        pairs = [(t["self_attn.q_a_proj.weight"], b["qlat"][0]),
                 (t["self_attn.kv_proj.weight"], b["kv"])]
        for prefix, kv, g in ((p, "ckv", "cg"), (ip, "ickv", "icg")):
            if prefix + "kv_proj.weight" in t:
                cw = t[prefix + "kv_proj.weight"].shape[0]
                pairs += [(t[prefix + "kv_proj.weight"], b[kv][:cw]),
                          (t[prefix + "gate_proj.weight"], b[g][:cw])]
        if ip + "scorer.weights_proj.weight" in t:
            pairs.append((t[ip + "scorer.weights_proj.weight"], b["head_w"]))
        groups: dict = {}
        for w, y in pairs:
            groups.setdefault(_projection_kind(w), []).append((w, y))
        return [self._projection_group(kind, members) for kind, members in groups.items()]

    def _projection_group(self, kind, members: list) -> tuple:
        """(kind, weights, outputs, table) of one launch group (table None: one by one)."""
        weights, outs = [w for w, _ in members], [y for _, y in members]
        if self.cp is np or kind is None or len(members) == 1:
            return None, weights, outs, None
        if kind[0] == FP8:
            from ds4.kernels import packed

            table = packed.gemv_table_fp8(self.cp, [w.codes for w in weights],
                                          [w.scale for w in weights], outs)
            return kind, weights, outs, table
        return kind, weights, outs, gemv_table(self.cp, weights, outs)

    def _project(self, i: int) -> None:
        """The attention side's projections of h (see _projection_plan)."""
        h = self.buf["h"]
        for kind, weights, outs, table in self.projections[i]:
            if table is None:
                for w, y in zip(weights, outs):
                    matvec(w, h, y)
            elif kind[0] == FP8:
                from ds4.kernels import packed

                packed.gemv_many_fp8(table, [w.codes for w in weights], [w.scale for w in weights],
                                     weights[0].block[0], h, outs)
            else:
                gemv_many(table, weights, h, outs)

    def _fit_scores(self, state) -> None:
        """Grow the indexer-score and attention-partial buffers to this session's capacity
        (a regrown buffer moves, so captured graphs are dropped)."""
        cfg = self.cfg
        need = {"scores": max([ls.indexer.rows.shape[0] for ls in state.layers if ls.indexer]
                              + [1]),
                "attn_part": max(at.partial_size(cfg.num_attention_heads, cfg.head_dim,
                                                 self._max_keys(ls)) for ls in state.layers)}
        for name, size in need.items():
            if self.buf[name].shape[0] < size:
                self.buf[name] = self.cp.zeros(size, dtype=self.cp.float32)
                self.graphs.clear()

    def _max_keys(self, ls) -> int:
        """Most keys a query of this layer state can attend: window + compressed rows used."""
        if ls.compressor is None:
            return ls.raw.shape[0]
        rows = ls.compressor.rows.shape[0]
        return ls.raw.shape[0] + (min(rows, self.cfg.index_topk) if ls.indexer else rows)

    def decode(self, state, token: int):
        """Append token at position state.n; return a fresh device array of its logits."""
        cp = self.cp
        self._fit_scores(state)
        self.stream.wait_event(cp.cuda.get_current_stream().record())
        with self.stream:
            self.pos_token.set(np.array([state.n, token], dtype=np.int32), stream=self.stream)
            graph = self.graphs.get(state) if self.use_graphs else None
            if graph is not None:
                graph.launch(self.stream)
            elif self.use_graphs and state in self._seen:
                self.stream.begin_capture()
                self.run(state)
                self.graphs[state] = graph = self.stream.end_capture()
                graph.launch(self.stream)
            else:  # first step of a session: eager, which also compiles and loads every kernel
                self.run(state)
                self._seen.add(state)
            logits = self.buf["logits"].copy()
        cp.cuda.get_current_stream().wait_event(self.stream.record())
        state.n += 1
        return logits

    @property
    def stream(self):
        """The non-blocking stream graphs are captured and replayed on."""
        if self._stream is None:
            self._stream = self.cp.cuda.Stream(non_blocking=True)
        return self._stream

    def run(self, state) -> None:
        """Enqueue one decode step for `state` at the position in self.pos (no host syncs)."""
        self._fit_scores(state)  # a no-op after the eager first step, so never during capture
        hc.embed_streams(self.top["embed"], self.token, self.buf["X"])
        for i, layer_state in enumerate(state.layers):
            self.run_layer(i, layer_state)
        self.run_head()

    def run_layer(self, i: int, layer_state) -> None:
        """Layer i on the residual streams buf["X"]: mHC + attention, then mHC + MoE."""
        t, b = self.layers[i], self.buf
        self._block(t, "attn_hc", "input_layernorm.weight")
        self._attention(i, t, layer_state)
        hc.hc_post(b["X"], b["y"], b["post_comb"], b["X"])
        self._block(t, "ffn_hc", "post_attention_layernorm.weight")
        self._moe(i, t)
        hc.hc_post(b["X"], b["y"], b["post_comb"], b["X"])

    def run_head(self) -> None:
        """buf["logits"] = W_head RMSNorm(HyperHead(X))."""
        cfg, b, top = self.cfg, self.buf, self.top
        hc.hc_mix(top["hc_fn"], b["X"], b["mix"][:cfg.hc_mult], cfg.rms_norm_eps)
        hc.hc_pre(b["mix"], top["hc_scale"], top["hc_base"], b["X"], b["u"], b["post_comb"],
                  cfg.hc_sinkhorn_iters, cfg.hc_eps, head=True)
        rms_norm(b["u"][None], top["norm"], b["h"][None], cfg.rms_norm_eps)
        gemv(top["head"], b["h"], b["logits"])

    def _block(self, t: dict, unit: str, norm: str) -> None:
        """h = RMSNorm_w(sum_i pre_i X_i) of one mHC unit; post/comb kept for hc_post."""
        cfg, b = self.cfg, self.buf
        hc.hc_mix(t[unit + ".fn"], b["X"], b["mix"], cfg.rms_norm_eps)
        hc.hc_pre_norm(b["mix"], t[unit + ".scale"], t[unit + ".base"], b["X"], t[norm], b["h"],
                       b["post_comb"], cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)

    def _attention(self, i: int, t: dict, ls) -> None:
        """y = attention output of layer i for h, updating the layer's state."""
        cfg, b, eps, r = self.cfg, self.buf, self.cfg.rms_norm_eps, self.cfg.qk_rope_head_dim
        H = cfg.num_attention_heads
        freqs = self.freqs["main" if ls.kind == SLIDING else "compress"]
        self._project(i)
        rms_norm(b["qlat"], t["self_attn.q_a_norm.weight"], b["qlat"], eps)
        matvec(t["self_attn.q_b_proj.weight"], b["qlat"][0], b["q"].reshape(-1))
        rms_norm(b["q"], None, b["q"], eps)
        rope_tail(b["q"], self.pos, freqs, r, rows_per_pos=H)
        at.attention_store_kv(b["kv"], t["self_attn.kv_norm.weight"], freqs, self.pos, ls.raw,
                              r, eps)
        if self.kv_fp8:
            quant.kv_fp8_slot(ls.raw, cfg.head_dim - r, self.pos)
        comp, sel, count, ratio = None, None, None, 0
        if ls.compressor is not None:
            self._compress(t, "self_attn.compressor.", ls.compressor, freqs, "ckv", "cg")
            if self.kv_fp8:
                quant.kv_fp8_closed(ls.compressor.rows, cfg.head_dim - r, self.pos,
                                    ls.compressor.ratio)
            comp, ratio = ls.compressor.rows, ls.compressor.ratio
        if ls.kind == CSA:
            self._index(t, ls.indexer, freqs)
            sel, count = b["sel"], b["sel_count"]
        at.attention_decode(b["q"], ls.raw, self.pos, comp, sel, count, ratio,
                            t["self_attn.sinks"], b["o"], self._max_keys(ls), b["attn_part"])
        rope_tail(b["o"], self.pos, freqs, r, rows_per_pos=H, sign=-1.0)
        matvec(t["self_attn.o_a_proj.weight"], b["o"].reshape(-1), b["z"],
               rows_per_group=cfg.o_lora_rank)
        matvec(t["self_attn.o_b_proj.weight"], b["z"], b["y"])

    def _compress(self, t: dict, prefix: str, cs, freqs, kv: str, gate: str) -> None:
        """Feed the projected row (buffers kv, gate) to one compressor; pool its window into
        cs.rows when this token closes it."""
        b, cw = self.buf, cs.pending_kv.shape[1]
        ckv, cg = b[kv][:cw], b[gate][:cw]
        cm.compressor_push(ckv, cg, t[prefix + "position_bias"], self.pos, cs.pending_kv,
                           cs.pending_score)
        overlap = cs.overlap_kv if cs.overlap else None
        overlap_score = cs.overlap_score if cs.overlap else None
        cm.compressor_pool(cs.pending_kv, cs.pending_score, overlap, overlap_score,
                           t[prefix + "kv_norm.weight"], freqs, self.pos, cs.rows,
                           self.cfg.qk_rope_head_dim, self.cfg.rms_norm_eps)

    def _index(self, t: dict, cs, freqs) -> None:
        """Indexer keys for this token, then the top-k entries the query attends (b["sel"]);
        its projections of h are already in ickv/icg/head_w."""
        cfg, b, p = self.cfg, self.buf, "self_attn.compressor.indexer."
        self._compress(t, p, cs, freqs, "ickv", "icg")
        if self.indexer_fp4:
            quant.hadamard_fp4(cs.rows, self.pos, cs.ratio)
        matvec(t[p + "q_b_proj.weight"], b["qlat"][0], b["iq"].reshape(-1))
        rope_tail(b["iq"], self.pos, freqs, cfg.qk_rope_head_dim, rows_per_pos=cfg.index_n_heads)
        if self.indexer_fp4:
            quant.hadamard_fp4(b["iq"], self.pos)
        scores = b["scores"][:cs.rows.shape[0]]
        ix.indexer_scores(b["iq"], b["head_w"], cs.rows, self.pos, cs.ratio, scores)
        sampling.topk_select(scores, cfg.index_topk, b["sel"], b["sel_count"], self.pos, cs.ratio)

    def _moe(self, i: int, t: dict) -> None:
        """y = routed experts + shared expert of h."""
        cfg, b = self.cfg, self.buf
        inter, limit = cfg.moe_intermediate_size, cfg.swiglu_limit
        matvec(t["mlp.gate.weight"], b["h"], b["router"])
        moe.moe_route(b["router"], t.get("mlp.gate.e_score_correction_bias"),
                      t.get("mlp.gate.tid2eid"), self.token, cfg.num_experts_per_tok,
                      cfg.routed_scaling_factor, b["idx"], b["wts"])
        if getattr(t["experts.gate_up"], "placed", False):  # experts in device + host memory
            self._placed_moe(t)
            return
        if isinstance(t["experts.gate_up"], PackedMatrix):
            self._packed_moe(t)
            return
        gu, k = t["experts.gate_up"], cfg.num_experts_per_tok
        shared = [t.get(f"mlp.shared_experts.{n}.weight")
                  for n in ("gate_proj", "up_proj", "down_proj")]
        if shared[0] is not None and (shared[0].dtype != gu.dtype or shared[0].shape[0] != inter):
            shared = [None, None, None]  # the kernels take a shared expert shaped like a routed one
        act = b["act"] if shared[0] is not None else b["act"][:k]
        moe.moe_gate_up(gu[:, :inter], gu[:, inter:], b["idx"], b["wts"], b["h"], act, limit,
                        shared[0], shared[1])
        moe.moe_down(t["experts.down"], b["idx"], act, b["y"], shared_down=shared[2])
        if "mlp.shared_experts.gate_proj.weight" in t and shared[0] is None:
            sact = b["act"][k:]
            moe.moe_gate_up(t["mlp.shared_experts.gate_proj.weight"],
                            t["mlp.shared_experts.up_proj.weight"], None, None, b["h"], sact, limit)
            moe.moe_down(t["mlp.shared_experts.down_proj.weight"], None, sact, b["y"],
                         accumulate=True)


    def _packed_moe(self, t: dict) -> None:
        """The MoE of a packed layer: the picked experts' FP4 (or FP8) codes and the shared
        expert read in place by ds4/kernels/packed.cu (after the router, in _moe)."""
        from ds4.kernels import packed

        cfg, b = self.cfg, self.buf
        inter, limit, k = cfg.moe_intermediate_size, cfg.swiglu_limit, cfg.num_experts_per_tok
        gu, down = t["experts.gate_up"], t["experts.down"]
        halves = [(gu.codes[:, :inter], gu.scale[:, :_scale_rows(gu, inter)]),
                  (gu.codes[:, inter:], gu.scale[:, _scale_rows(gu, inter):])]
        act = b["act"][:k]
        if gu.fmt == FP8:
            packed.moe_gate_up_fp8(*halves[0], *halves[1], gu.block[0], b["idx"], b["wts"],
                                   b["h"], act, limit)
            packed.moe_down_fp8(down.codes, down.scale, down.block[0], b["idx"], act, b["y"])
        else:
            packed.moe_gate_up_fp4(*halves[0], *halves[1], b["idx"], b["wts"], b["h"], act, limit)
            packed.moe_down_fp4(down.codes, down.scale, b["idx"], act, b["y"])
        if "mlp.shared_experts.gate_proj.weight" in t:
            self._shared_expert(t)

    def _placed_moe(self, t: dict) -> None:
        """The MoE of a layer whose experts are split over device and mapped host memory
        (ds4/model/placement.py): the same row math through per-expert address tables, and
        the picks counted for re-placement."""
        from ds4.kernels import placed

        cfg, b, k = self.cfg, self.buf, self.cfg.num_experts_per_tok
        placed.moe_placed(t["experts.gate_up"], t["experts.down"], cfg.moe_intermediate_size,
                          b["idx"], b["wts"], b["h"], b["act"][:k], b["y"], cfg.swiglu_limit,
                          t["experts.counts"])
        if "mlp.shared_experts.gate_proj.weight" in t:
            self._shared_expert(t)

    def _shared_expert(self, t: dict) -> None:
        """y += the shared expert of h (packed FP8, or bf16 words through ds4/kernels/moe)."""
        from ds4.kernels import packed

        cfg, b = self.cfg, self.buf
        gate, up, down = (t[f"mlp.shared_experts.{n}.weight"] for n in SHARED)
        sact = b["shared_act"]
        if not isinstance(gate, PackedMatrix):
            moe.moe_gate_up(gate, up, None, None, b["h"], sact, cfg.swiglu_limit)
            moe.moe_down(down, None, sact, b["y"], accumulate=True)
        elif gate.fmt == FP8:
            packed.moe_gate_up_fp8(gate.codes, gate.scale, up.codes, up.scale, gate.block[0],
                                   None, None, b["h"], sact, cfg.swiglu_limit)
            packed.moe_down_fp8(down.codes, down.scale, down.block[0], None, sact, b["y"],
                                accumulate=True)
        else:
            packed.moe_gate_up_fp4(gate.codes, gate.scale, up.codes, up.scale, None, None,
                                   b["h"], sact, cfg.swiglu_limit)
            packed.moe_down_fp4(down.codes, down.scale, None, sact, b["y"], accumulate=True)


SHARED = ("gate_proj", "up_proj", "down_proj")


def _projection_kind(w):
    """What may share one launch with w: (FP8, width, tile) for kernel-ready FP8 matrices, the
    dtype for plain ones, None (alone) for anything else."""
    if not isinstance(w, PackedMatrix):
        return ("plain", str(w.dtype))
    if w.fmt == FP8 and w.kernel_ready:
        return (FP8, w.shape[-1], w.block)
    return None


def _scale_rows(m: PackedMatrix, rows: int) -> int:
    """Scale rows covering the first `rows` rows of m (FP8: whole tiles, FP4: one per row)."""
    return rows // m.block[0] if m.fmt == FP8 else rows


class GraphDecode:
    """The engine's hook for one-token steps: builds the KernelDecoder on first use."""

    def __init__(self, model):
        self.model = model
        self.decoder: KernelDecoder | None = None

    def decode(self, state, token: int):
        """Logits (device array) of token appended at state.n, through a replayed CUDA graph."""
        if self.decoder is None:
            self.decoder = KernelDecoder.from_model(self.model)
        return self.decoder.decode(state, int(token))


def kernel_decoder_for(model) -> GraphDecode | None:
    """A GraphDecode for a model on the GPU whose features the kernels cover, else None."""
    if not model.backend.is_gpu or gpu_weights.supported(model) is not None:
        return None
    return GraphDecode(model)
