"""One-token decode for B sessions at once, made only of RawKernels, captured as one CUDA graph
per batch size (1, 2, 4, 8) and replayed.

A graph holds no session's address: every member's position, token and state arrays are read by
the kernels from the size's MemberTable (ds4/model/gpu_batch.py), which one host-to-device copy
fills before each replay, so one graph serves every member set and every step. A single decode
is a batch of one through the same kernels; every kernel computes a member's row the same way
whatever the batch (member = blockIdx.z, the same per-row reduction order), so a batched row is
bitwise the row of that session's single step. A batch of 3 runs the B=4 graph with an idle
member (a decoder-owned empty session that stays at position 0); larger ones split.

The transient buffers [8, ...] are shared by all graphs, which is safe because replays run one
at a time on one stream and every buffer is written before it is read within a step. (The one
fork, the shared expert's branch on a side stream, writes buffers of its own, which only the
MoE's sum reads, after the join.)
"""

from __future__ import annotations

import weakref

import numpy as np

from ds4.kernels import attention as at
from ds4.kernels import compressor as cm
from ds4.kernels import hyper_connection as hc
from ds4.kernels import indexer as ix
from ds4.kernels import moe, quant, sampling
from ds4.kernels.norm import rms_norm, rms_norm_rope
from ds4.kernels.rope import rope_tail
from ds4.model import gpu_weights
from ds4.model.config import CSA, SLIDING
from ds4.model.gpu_batch import (
    COMPRESSOR,
    COMPRESSOR_ROWS,
    INDEXER,
    INDEXER_ROWS,
    RAW,
    MemberTable,
    ProjectionPlan,
    matvec_rows,
)
from ds4.model.gpu_group import DecoderShard
from ds4.model.gpu_moe import moe_rows, row_moe_fits, row_moe_scratch, shared_ahead, shared_of
from ds4.model.state import SessionState

SHARED_AHEAD = True  # the shared expert on a side stream, ahead of the router (docs/PERF.md)

SIZES = (1, 2, 4, 8)  # batch sizes with a graph; a batch runs in the smallest that holds it
MAX_MEMBERS = SIZES[-1]
VERIFY_SIZE = 4  # most tokens of one session one `verify` replay takes


class KernelDecoder:
    """Decode steps of a model through ds4/kernels, one CUDA graph per batch size."""

    def __init__(self, cfg, top: dict, layers: list[dict], freqs: dict, xp=None,
                 kv_fp8: bool = False, indexer_fp4: bool = False, group=None):
        if xp is None:
            import cupy as xp
        self.cp, self.cfg, self.top, self.layers, self.freqs = xp, cfg, top, layers, freqs
        # the official graph's rounding (Engine.open(quantize=...)), as ds4/model/quant.py does it
        self.kv_fp8, self.indexer_fp4 = kv_fp8, indexer_fp4
        self.buf = self._buffers(cfg)
        self.moe_scratch = row_moe_scratch(xp, cfg, layers, MAX_MEMBERS)
        self.row_moe = [self.moe_scratch is not None
                        and row_moe_fits(t, MAX_MEMBERS, cfg.num_experts_per_tok) for t in layers]
        self.group, self.shard = group, self._shard(group)  # expert parallel (gpu_group.py)
        self.rows = self._row_views()
        self.tables = {B: MemberTable(xp, cfg.num_hidden_layers, B) for B in SIZES}
        self.serial = [MemberTable(xp, cfg.num_hidden_layers, 1) for _ in range(VERIFY_SIZE)]
        self.projections = [self._projection_plan(t) for t in layers]
        self.keys = [0] * cfg.num_hidden_layers  # most keys a query attends, per layer (grids)
        self.index_rows = 1  # most compressed rows an indexer scores (grid, scores buffer)
        self.graphs: dict = {}  # batch size (a verify's: ("verify", size)) -> captured graph
        self._warm: set = set()  # graph keys that ran one eager step (kernels compiled)
        self._idle: SessionState | None = None
        self._capacities: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._fitted: weakref.WeakSet = weakref.WeakSet()  # states the bounds already hold
        self._stream = self._side = None
        self.use_graphs = True

    @classmethod
    def from_model(cls, model) -> KernelDecoder:
        """Kernel-form copies of an engine Model's tensors (see gpu_weights.supported)."""
        xp, cfg = model.xp, model.cfg
        layers = [gpu_weights.layer_tensors(xp, cfg, model.weights, i)
                  for i in range(cfg.num_hidden_layers)]
        freqs = {k: gpu_weights.rope_frequencies(xp, r) for k, r in model.ropes.items()}
        return cls(cfg, gpu_weights.model_tensors(xp, model.weights), layers, freqs, xp,
                   kv_fp8=model.kv_fp8 is not None, indexer_fp4=model.indexer_qat is not None,
                   group=getattr(model.weights.experts[0], "group", None))

    def _shard(self, group) -> DecoderShard | None:
        """Rank 0's DecoderShard of an expert-parallel group (None without one)."""
        return None if group is None else DecoderShard.for_rank0(self, group, MAX_MEMBERS)

    def _buffers(self, cfg) -> dict:
        cp, f = self.cp, self.cp.float32
        D, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        n, k, inter = cfg.hc_mult, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        sizes = {"X": (n, D), "mix": (2 * n + n * n,), "head_mix": (n,),
                 "h": (D,), "y": (D,), "qlat": (cfg.q_lora_rank,), "q": (H, d),
                 "kv": (d,), "o": (H, d), "z": (cfg.o_groups * cfg.o_lora_rank,),
                 "ckv": (2 * d,), "cg": (2 * d,), "ickv": (2 * cfg.index_head_dim,),
                 "icg": (2 * cfg.index_head_dim,), "iq": (cfg.index_n_heads, cfg.index_head_dim),
                 "head_w": (cfg.index_n_heads,), "router": (cfg.n_routed_experts,),
                 "wts": (k,), "act": (k + 1, inter),
                 "shared_act": (1, inter * max(cfg.n_shared_experts, 1)),
                 "logits": (cfg.vocab_size,), "scores": (1,), "attn_part": (1,)}
        buf = {name: cp.zeros((MAX_MEMBERS, *shape), dtype=f) for name, shape in sizes.items()}
        buf["idx"] = cp.zeros((MAX_MEMBERS, k), dtype=cp.int32)
        buf["sel"] = cp.zeros((MAX_MEMBERS, max(cfg.index_topk, 1)), dtype=cp.int32)
        buf["sel_count"] = cp.zeros(MAX_MEMBERS, dtype=cp.int32)
        buf["unit_part"], buf["unit_done"] = hc.unit_scratch(cp, MAX_MEMBERS, D)
        return buf

    def _row_views(self) -> list[dict]:
        """Per member, every buffer's row as the single-token kernels take it."""
        return [{name: (a[b:b + 1] if a.ndim == 1 else a[b]) for name, a in self.buf.items()}
                for b in range(MAX_MEMBERS)]

    def _projection_plan(self, t: dict) -> ProjectionPlan:
        """The layer's projections of h that the attention side needs (see ProjectionPlan)."""
        b, p, ip = self.buf, "self_attn.compressor.", "self_attn.compressor.indexer."
        pairs = [(t["self_attn.q_a_proj.weight"], b["qlat"]),
                 (t["self_attn.kv_proj.weight"], b["kv"])]
        for prefix, kv, g in ((p, "ckv", "cg"), (ip, "ickv", "icg")):
            if prefix + "kv_proj.weight" in t:
                cw = t[prefix + "kv_proj.weight"].shape[0]
                pairs += [(t[prefix + "kv_proj.weight"], b[kv][:, :cw]),
                          (t[prefix + "gate_proj.weight"], b[g][:, :cw])]
        if ip + "scorer.weights_proj.weight" in t:
            pairs.append((t[ip + "scorer.weights_proj.weight"], b["head_w"]))
        return ProjectionPlan(self.cp, pairs, MAX_MEMBERS)

    # ---- steps

    def decode(self, state, token: int):
        """Append token at position state.n; return a fresh device array of its logits."""
        return self.decode_batch([state], [token])[0]

    def decode_batch(self, states: list, tokens: list[int]) -> list:
        """One token appended to each session (distinct states); fresh logits [V] per session,
        each bitwise the logits of that session's own step."""
        out: list = []
        for s in range(0, len(states), MAX_MEMBERS):
            out += self._step(list(states[s:s + MAX_MEMBERS]),
                              [int(t) for t in tokens[s:s + MAX_MEMBERS]])
        return out

    def verify(self, state, tokens: list[int]):
        """Tokens (at most VERIFY_SIZE) appended to one session at positions state.n.. in one
        replay, as consecutive steps: every matrix is read once for all of them while the
        kernels that read and write the session's state run member after member, each seeing
        what the ones before it wrote. Fresh logits [T, V]; row j is bitwise what decoding
        tokens[:j + 1] one step at a time gives (the rows are computed the same way)."""
        T = len(tokens)
        assert 1 <= T <= VERIFY_SIZE
        logits = self._logits([state] * T, tokens, [state.n + j for j in range(T)])
        state.n += T
        return logits

    def _step(self, states: list, tokens: list[int]) -> list:
        logits = self._logits(states, tokens)
        for s in states:
            s.n += 1
        return [logits[b] for b in range(len(states))]

    def _logits(self, states: list, tokens: list[int], positions: list[int] | None = None):
        """A fresh copy of one step's logits [len(states), V] (positions given: a serial
        `verify` step); states are not advanced."""
        if self.cp is not np:
            return self._replay(states, tokens, positions)
        # the NumPy twins (tests): eager, no stream
        B = self.prepare(states, tokens, positions=positions)
        self._tell(("verify", B) if positions is not None else B, B, "eager")
        self.run(B, serial=positions is not None)
        return self.buf["logits"][:len(states)].copy()

    def prepare(self, states: list, tokens: list[int], stream=None,
                positions: list[int] | None = None) -> int:
        """Fill the member table of the smallest graph size that holds these (at most 8)
        sessions, idle members padding it; returns that size, what `run` then takes. With
        positions (a verify: one session at consecutive positions), member j's table of one
        too (what the state kernels of a serial `run` read)."""
        B = next(size for size in SIZES if size >= len(states))
        idle = B - len(states)
        members = list(states) + [self.idle_state()] * idle  # idle rows compute, are dropped
        tokens = list(tokens) + [0] * idle
        self._fit(members)
        at = None if positions is None else list(positions) + [0] * idle
        self.tables[B].fill(members, tokens, stream=stream, live=len(states), positions=at)
        for j in range(B if positions is not None else 0):
            self.serial[j].fill(members[j:j + 1], tokens[j:j + 1], stream=stream,
                                positions=at[j:j + 1])
        return B

    def _replay(self, states: list, tokens: list[int], positions: list[int] | None = None):
        cp, stream, serial = self.cp, self.stream, positions is not None
        stream.wait_event(cp.cuda.get_current_stream().record())
        with stream:
            B = self.prepare(states, tokens, stream=stream, positions=positions)
            key = ("verify", B) if serial else B
            graph = self.graphs.get(key) if self.use_graphs else None
            capture = graph is None and self.use_graphs and key in self._warm
            self._tell(key, B, "replay" if graph is not None else
                       "capture" if capture else "eager")
            if capture:
                stream.begin_capture()
                self.run(B, serial)
                self.graphs[key] = graph = stream.end_capture()
            if graph is not None:
                graph.launch(stream)
            else:  # a size's first step: eager, which also compiles and loads every kernel
                self.run(B, serial)
                self._warm.add(key)
            logits = self.buf["logits"][:len(states)].copy()
        cp.cuda.get_current_stream().wait_event(stream.record())
        return logits

    def _tell(self, key, B: int, mode: str) -> None:
        """Expert parallel: the workers run their side of this step (gpu_group.py)."""
        if self.group is not None:
            self.group.tell("step", key, B, mode)

    def idle_state(self) -> SessionState:
        """The empty session idle members run (it never advances: every step is at position 0,
        rewriting the same rows)."""
        if self._idle is None:
            ratios = [self.cfg.compress_ratio(i) for i, kind in enumerate(self.cfg.layer_types)
                      if kind != SLIDING]
            self._idle = SessionState(self.cp, self.cfg, max(ratios + [1]))
        return self._idle

    def _fit(self, members: list) -> None:
        """Grow the grids' key and row bounds and the buffers they size to these members'
        capacities; graphs captured for smaller bounds are dropped (re-captured next step).
        Bounds only grow: a kernel's surplus blocks add nothing to a member's row, and a
        state's capacities never change, so a state fitted once needs no check (the check
        took ~0.2 ms of host time a step, while the device waits)."""
        if all(s in self._fitted for s in members):
            return
        keys, rows = zip(*(self._capacity(s) for s in members))
        keys, rows = np.maximum(np.max(keys, axis=0), self.keys), max(max(rows), self.index_rows)
        grew = bool((keys > self.keys).any()) or rows > self.index_rows
        self.keys, self.index_rows = keys.tolist(), rows
        cfg = self.cfg
        part = max(at.partial_size(cfg.num_attention_heads, cfg.head_dim, k) for k in self.keys)
        for name, size in (("scores", self.index_rows), ("attn_part", part)):
            if self.buf[name].shape[1] < size:
                self.buf[name] = self.cp.zeros((MAX_MEMBERS, size), dtype=self.cp.float32)
                self.rows = self._row_views()
                grew = True
        if grew:
            self.graphs.clear()
        self._fitted.update(members)

    def _capacity(self, state) -> tuple:
        """(most keys per layer, most indexer rows) of a session (fixed at its creation)."""
        got = self._capacities.get(state)
        if got is None:
            rows = [ls.indexer.rows.shape[0] for ls in state.layers if ls.indexer]
            got = np.array([self._max_keys(ls) for ls in state.layers]), max(rows + [1])
            self._capacities[state] = got
        return got

    def _max_keys(self, ls) -> int:
        """Most keys a query of this layer state can attend: window + compressed rows used."""
        if ls.compressor is None:
            return ls.raw.shape[0]
        rows = ls.compressor.rows.shape[0]
        return ls.raw.shape[0] + (min(rows, self.cfg.index_topk) if ls.indexer else rows)

    @property
    def stream(self):
        """The non-blocking stream graphs are captured and replayed on."""
        if self._stream is None:
            self._stream = self.cp.cuda.Stream(non_blocking=True)
        return self._stream

    @property
    def side_stream(self):
        """The second stream of a step: the shared expert's branch, forked from `stream` and
        joined back within the same layer (a graph captures both)."""
        if self._side is None:
            self._side = self.cp.cuda.Stream(non_blocking=True)
        return self._side

    def run(self, B: int, serial: bool = False) -> None:
        """Enqueue one decode step for the B members of tables[B] (no host syncs); serial:
        the state kernels run member after member through `serial` (see `verify`)."""
        hc.embed_streams(self.top["embed"], self.tables[B].tokens, self.buf["X"][:B])
        if self.shard is not None:  # the idle members' bound travels with the wire
            self.shard.views["live"][...] = self.tables[B].live
        for i in range(self.cfg.num_hidden_layers):
            self.run_layer(i, B, serial)
        self.run_head(B)

    def run_layer(self, i: int, B: int, serial: bool = False) -> None:
        """Layer i on the residual streams X[:B]: mHC + attention, then mHC + MoE. The MoE's
        hc_post runs at the start of the next unit (the next layer's or the head's)."""
        t = self.layers[i]
        self._block(t, "attn_hc", "input_layernorm.weight", B,
                    self._prev(self.layers[i - 1], "ffn_hc", B) if i > 0 else None)
        self._attention(i, t, B, serial)
        self._block(t, "ffn_hc", "post_attention_layernorm.weight", B,
                    self._prev(t, "attn_hc", B))
        self._moe(i, t, B)

    def run_head(self, B: int) -> None:
        """The last layer's hc_post, then logits[:B] = W_head RMSNorm(HyperHead(X[:B]))."""
        cfg, b, top = self.cfg, self.buf, self.top
        hc.hc_unit(b["X"][:B], b["y"][:B], self._prev(self.layers[-1], "ffn_hc", B),
                   top["hc_fn"], top["hc_scale"], top["hc_base"], top["norm"], b["head_mix"][:B],
                   b["h"][:B], (b["unit_part"], b["unit_done"]), cfg.hc_sinkhorn_iters,
                   cfg.hc_eps, cfg.rms_norm_eps, cfg.rms_norm_eps)
        matvec_rows(top["head"], b["h"], b["logits"], B)

    def _block(self, t: dict, unit: str, norm: str, B: int, prev) -> None:
        """prev (the previous unit's mix, scale and base; None for the first unit): X =
        hc_post(X, y) of that unit; then this unit's mix and h = RMSNorm_w(sum_i pre_i X_i); one
        hc_unit launch."""
        cfg, b = self.cfg, self.buf
        hc.hc_unit(b["X"][:B], b["y"][:B] if prev is not None else None, prev, t[unit + ".fn"],
                   t[unit + ".scale"], t[unit + ".base"], t[norm], b["mix"][:B], b["h"][:B],
                   (b["unit_part"], b["unit_done"]), cfg.hc_sinkhorn_iters, cfg.hc_eps,
                   cfg.rms_norm_eps, cfg.rms_norm_eps)

    def _prev(self, t: dict, unit: str, B: int) -> tuple:
        """What the next hc_unit computes that unit's post and comb from: its mix (the buffer
        each non-head unit writes) and its weights."""
        return self.buf["mix"][:B], t[unit + ".scale"], t[unit + ".base"]

    def _attention(self, i: int, t: dict, B: int, serial: bool = False) -> None:
        """y = attention output of layer i for h, updating each member's layer state (serial:
        the state kernels run member after member, see `verify`)."""
        cfg, b, eps, r = self.cfg, self.buf, self.cfg.rms_norm_eps, self.cfg.qk_rope_head_dim
        H, d = cfg.num_attention_heads, cfg.head_dim
        tab, freqs = self.tables[B], self.freqs["main" if cfg.layer_types[i] == SLIDING
                                                else "compress"]
        self.projections[i].run(b["h"], B)
        qlat, q = b["qlat"][:B], b["q"][:B].reshape(-1, d)
        rms_norm(qlat, t["self_attn.q_a_norm.weight"], qlat, eps)
        matvec_rows(t["self_attn.q_b_proj.weight"], b["qlat"], b["q"].reshape(MAX_MEMBERS, -1), B)
        rms_norm_rope(q, None, eps, tab.pos, freqs, r, rows_per_pos=H)
        if cfg.layer_types[i] == CSA:
            self._index_queries(t, tab, freqs, B)
        fused = d % 32 == 0  # the combine kernel turns the output back (whole warps of pairs)
        lanes = ([(self.serial[j], slice(j, j + 1)) for j in range(B)] if serial
                 else [(tab, slice(0, B))])
        for lane, rows in lanes:
            self._attend(i, t, lane, rows, freqs, fused)
        if not fused:
            rope_tail(b["o"][:B].reshape(-1, d), tab.pos, freqs, r, rows_per_pos=H, sign=-1.0)
        matvec_rows(t["self_attn.o_a_proj.weight"], b["o"].reshape(MAX_MEMBERS, -1), b["z"], B,
                    rows_per_group=cfg.o_lora_rank)
        matvec_rows(t["self_attn.o_b_proj.weight"], b["z"], b["y"], B)

    def _attend(self, i: int, t: dict, tab, rows: slice, freqs, fused: bool) -> None:
        """The kernels of layer i that read and write state, for the members of `tab` (the
        buffers' rows `rows`): store the raw KV row, feed the compressors, select, attend."""
        cfg, b, r = self.cfg, self.buf, self.cfg.qk_rope_head_dim
        d, window, kind = cfg.head_dim, cfg.sliding_window, cfg.layer_types[i]
        at.attention_store_kv_m(b["kv"][rows], t["self_attn.kv_norm.weight"], freqs, tab, i,
                                RAW, window, r, cfg.rms_norm_eps)
        if self.kv_fp8:
            quant.kv_fp8_slot_m(tab, i, RAW, d, d - r, window)
        comp, sel, count, ratio = None, None, None, 0
        if kind != SLIDING:
            ratio = cfg.compress_ratio(i)
            self._compress(t, "self_attn.compressor.", tab, i, COMPRESSOR, d, freqs, "ckv", "cg",
                           rows)
            comp = COMPRESSOR_ROWS
            if self.kv_fp8:
                quant.kv_fp8_closed_m(tab, i, comp, d, d - r, ratio)
        if kind == CSA:
            self._index(t, tab, i, freqs, rows)
            sel, count = b["sel"][rows], b["sel_count"][rows]
        at.attention_decode_m(b["q"][rows], tab, i, RAW, comp, window, sel, count, ratio,
                              t["self_attn.sinks"], b["o"][rows], self.keys[i],
                              b["attn_part"][rows], freqs if fused else None, r)

    def _compress(self, t: dict, prefix: str, tab, i: int, slot: int, hd: int, freqs, kv: str,
                  gate: str, rows: slice) -> None:
        """Feed each member's projected row (buffers kv, gate) to its compressor; pool its
        window into the compressed rows when this token closes it."""
        m, cw = self.cfg.compress_ratio(i), t[prefix + "kv_proj.weight"].shape[0]
        cm.compressor_step_m(self.buf[kv][rows], self.buf[gate][rows],
                             t[prefix + "position_bias"], tab, i, slot,
                             t[prefix + "kv_norm.weight"], freqs, m, cw, hd,
                             self.cfg.qk_rope_head_dim, self.cfg.rms_norm_eps)

    def _index_queries(self, t: dict, tab, freqs, B: int) -> None:
        """The indexer's queries of every member (iq), from qlat: what reads no state."""
        cfg, b, p = self.cfg, self.buf, "self_attn.compressor.indexer."
        ihd = cfg.index_head_dim
        matvec_rows(t[p + "q_b_proj.weight"], b["qlat"], b["iq"].reshape(MAX_MEMBERS, -1), B)
        iq = b["iq"][:B].reshape(-1, ihd)
        rope_tail(iq, tab.pos, freqs, cfg.qk_rope_head_dim, rows_per_pos=cfg.index_n_heads)
        if self.indexer_fp4:
            quant.hadamard_fp4(iq, tab.pos)

    def _index(self, t: dict, tab, i: int, freqs, rows: slice) -> None:
        """Indexer keys for this token, then the top-k entries each query attends (sel); its
        projections of h are already in ickv/icg/head_w, its queries in iq."""
        cfg, b, p = self.cfg, self.buf, "self_attn.compressor.indexer."
        ihd, ratio, slot = cfg.index_head_dim, cfg.compress_ratio(i), INDEXER_ROWS
        self._compress(t, p, tab, i, INDEXER, ihd, freqs, "ickv", "icg", rows)
        if self.indexer_fp4:
            quant.hadamard_fp4_m(tab, i, slot, ihd, ratio)
        scores = b["scores"][rows]
        ix.indexer_scores_m(b["iq"][rows], b["head_w"][rows], tab, i, slot, self.index_rows,
                            ratio, scores)
        sampling.topk_select(scores, cfg.index_topk, b["sel"][rows], b["sel_count"][rows],
                             tab.pos, ratio)

    def _moe(self, i: int, t: dict, B: int) -> None:
        """y = routed experts + shared expert of h, per member. The shared expert goes first,
        on the side stream (gpu_moe.shared_ahead), so its weights stream while the router and
        the route, which it does not need, run."""
        cfg, b, tokens = self.cfg, self.buf, self.tables[B].tokens
        scratch = self.moe_scratch if self.row_moe[i] else None
        done = None
        if self.cp is not np and self.shard is None and SHARED_AHEAD:
            done = shared_ahead(cfg, t, b, B, scratch, self.side_stream)
        matvec_rows(t["mlp.gate.weight"], b["h"], b["router"], B)
        moe.moe_route(b["router"][:B], t.get("mlp.gate.e_score_correction_bias"),
                      t.get("mlp.gate.tid2eid"), tokens[:B], cfg.num_experts_per_tok,
                      cfg.routed_scaling_factor, b["idx"][:B], b["wts"][:B])
        if self.shard is not None:
            self.shard.layer(i, B, shared=shared_of(t))
            return
        moe_rows(cfg, t, b, self.rows, B, scratch, self.tables[B].live,
                 done)  # idle members read no routed expert or count
