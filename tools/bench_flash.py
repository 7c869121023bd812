"""A few decoder layers at real V4-Flash dimensions with random weights, for tools/bench_engine.py.

Weights come from transformers' DeepseekV4ForCausalLM (built in bf16 on the GPU) when it can be
built, and the engine's kernels read the very same bytes through DLPack views; otherwise they are
drawn with CuPy. Also: the bytes a decode token must read and the FLOPs a prefill chunk must do.
"""

from __future__ import annotations

import copy

import numpy as np

from ds4.kernels import widen
from ds4.model.checkpoint_names import expected_shapes
from ds4.model.config import CSA, HCA, ModelConfig

RATIOS = {"sliding_attention": 0, "compressed_sparse_attention": 4,
          "heavily_compressed_attention": 128}
FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 129280, "hidden_size": 4096, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "partial_rotary_factor": 0.125, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1,
    "moe_intermediate_size": 2048, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "sliding_window": 128,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
}
SMALL = {"vocab_size": 1024, "hidden_size": 256, "num_attention_heads": 8, "head_dim": 128,
         "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128, "n_routed_experts": 16,
         "moe_intermediate_size": 128, "index_n_heads": 8, "index_topk": 32}
BF16_SUFFIXES = ("_proj.weight", "embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")


def flash_config(kinds: list[str], small: bool = False) -> dict:
    """A config.json dict at Flash dims (or tiny ones) for these layer types, no hash layers."""
    cfg = dict(FLASH, **(SMALL if small else {}))
    cfg.update(num_hidden_layers=len(kinds), layer_types=list(kinds),
               mlp_layer_types=["moe"] * len(kinds), num_hash_layers=0,
               compress_ratios=[RATIOS[k] for k in kinds])
    return cfg


class DeviceBank:
    """A layer's routed experts as stacked device arrays (duck-types the engine's ExpertBank)."""

    resident = True

    def __init__(self, gate_up, down):
        import cupy

        self.xp = cupy.get_array_module(gate_up)
        self.stacked = (gate_up, down)
        self.count = gate_up.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return int(self.stacked[0].nbytes + self.stacked[1].nbytes)

    def expert(self, e: int) -> tuple:
        """(gate_up [2I, D], down [D, I]) of expert e in fp32."""
        return widen(self.stacked[0][e], self.xp), widen(self.stacked[1][e], self.xp)

    def gather(self, ids) -> tuple:
        """fp32 stacks of the experts ids."""
        return widen(self.stacked[0][ids], self.xp), widen(self.stacked[1][ids], self.xp)


class DeviceWeights:
    """Named device tensors + banks (duck-types the engine's Weights for gpu_weights)."""

    def __init__(self, named: dict, banks: list):
        self.named, self.experts = named, banks

    def __getitem__(self, name: str):
        return self.named[name]

    def layer(self, i: int):
        """Layer i's tensors by their names inside the layer."""
        from ds4.model.weights import LayerWeights

        return LayerWeights(self, i)

    @property
    def tensors(self) -> dict:
        """All named tensors (what LayerWeights reads)."""
        return self.named


class FlashStack:
    """The bench's layers: weights (shared with the HF model when there is one) and states."""

    def __init__(self, cp, config: dict, kinds: list[str], use_hf: bool = True):
        self.cp, self.config, self.kinds = cp, config, kinds
        self.cfg = ModelConfig.from_dict(config)
        self.hf, self.hf_reason = None, "disabled (--no-hf)"
        if use_hf:
            try:
                self.hf = build_hf(config)
            except Exception as exc:  # noqa: BLE001 - no torch, no transformers with DeepSeek-V4, no memory
                self.hf_reason = f"{type(exc).__name__}: {exc}"
        self.weights = from_hf(cp, self.cfg, self.hf) if self.hf is not None else \
            random_weights(cp, self.cfg)

    def decoder(self):
        """A KernelDecoder over these weights."""
        from ds4.model import gpu_weights
        from ds4.model.gpu_decode import KernelDecoder
        from ds4.model.rope import Rope

        cp, cfg = self.cp, self.cfg
        layers = [gpu_weights.layer_tensors(cp, cfg, self.weights,
                                            i) for i in range(len(self.kinds))]
        ropes = {"main": Rope(cp, cfg.rope_main, cfg.qk_rope_head_dim),
                 "compress": Rope(cp, cfg.rope_compress, cfg.qk_rope_head_dim)}
        freqs = {k: gpu_weights.rope_frequencies(cp, r) for k, r in ropes.items()}
        return KernelDecoder(cfg, gpu_weights.model_tensors(cp, self.weights), layers, freqs, cp)

    def empty_state(self, cfg, ctx: int):
        """A fresh session state."""
        from ds4.model.state import SessionState

        return SessionState(self.cp, cfg, ctx)

    def filled_state(self, ctx: int):
        """A state at position ctx - 2 with random rows everywhere (no window closes there)."""
        cp, state = self.cp, self.empty_state(self.cfg, ctx)
        state.n = ctx - 2
        for ls in state.layers:
            ls.raw[...] = cp.random.standard_normal(ls.raw.shape, dtype=cp.float32)
            for comp in ls.compressors().values():
                for arr in (comp.rows, comp.pending_kv, comp.pending_score, comp.overlap_kv,
                            comp.overlap_score):
                    arr[...] = cp.random.standard_normal(arr.shape, dtype=cp.float32)
        return state

    def engine_model(self, i: int):
        """The engine's Model on CuPy holding only layer i, on these very arrays: bf16 words for
        the matrices and expert stacks, fp32 for the rest (the engine's own GPU format)."""
        from ds4.backend import get_backend
        from ds4.model.forward import Model
        from ds4.model.weights import Weights

        kind = self.kinds[i]
        config = flash_config([kind], small=self.cfg.hidden_size != FLASH["hidden_size"])
        cfg = ModelConfig.from_dict(config)
        src = f"model.layers.{i}."
        tensors = {name: self.weights[name.replace("model.layers.0.",
                                                   src)] for name in expected_shapes(cfg)}
        bank = DeviceBank(*self.weights.experts[i].stacked)
        return Model(cfg, Weights(tensors, [bank], {}, False), get_backend("cupy"), quantize=False)


def _is_bf16(name: str, shape) -> bool:
    return len(shape) == 2 and name.endswith(BF16_SUFFIXES)


def random_weights(cp, cfg) -> DeviceWeights:
    """Random device weights: bf16 words for the matrices, fp32 for the rest."""
    rng = cp.random.default_rng(0)

    def words(shape):
        """Random bf16 words of N(0, 0.02)."""
        w = (rng.standard_normal(shape, dtype=cp.float32) * 0.02).view(cp.uint32)
        return (w >> 16).astype(cp.uint16)

    named = {}
    for name, shape in expected_shapes(cfg).items():
        if _is_bf16(name, shape):
            named[name] = words(shape)
        elif name.endswith("tid2eid"):
            named[name] = rng.integers(0, cfg.n_routed_experts, shape, dtype=cp.int64)
        else:
            named[name] = rng.standard_normal(shape, dtype=cp.float32) * 0.1
    banks = []
    E, inter, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for _ in range(cfg.num_hidden_layers):
        gate_up, down = cp.empty((E, 2 * inter, D), cp.uint16), cp.empty((E, D, inter), cp.uint16)
        for e in range(E):
            gate_up[e], down[e] = words((2 * inter, D)), words((D, inter))
        banks.append(DeviceBank(gate_up, down))
    return DeviceWeights(named, banks)


def build_hf(config: dict):
    """transformers' DeepseekV4ForCausalLM in bf16 on the GPU, eager attention and experts."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hf_cfg = DeepseekV4Config(**copy.deepcopy(config))
    hf_cfg._attn_implementation = "eager"
    hf_cfg._experts_implementation = "eager"
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = DeepseekV4ForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():  # default init leaves sinks/biases zero; spread them like real ones
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias", "e_score_correction_bias", ".base")):
                p.normal_(0.0, 0.5)
    return model


def from_hf(cp, cfg, model) -> DeviceWeights:
    """Kernel-side views of the HF model's tensors: bf16 words shared by DLPack, rest as fp32."""
    import torch

    state = model.state_dict()
    named = {}
    for name, shape in expected_shapes(cfg).items():
        t = state[name]
        if _is_bf16(name, shape) and t.dtype == torch.bfloat16:
            named[name] = cp.from_dlpack(t.detach().contiguous().view(torch.int16)).view(cp.uint16)
        elif name.endswith("tid2eid"):
            named[name] = cp.from_dlpack(t.contiguous())
        else:
            named[name] = cp.from_dlpack(t.detach().float().contiguous())
    banks = []
    for i in range(cfg.num_hidden_layers):
        stem = f"model.layers.{i}.mlp.experts."
        gate_up, down = (cp.from_dlpack(state[stem + n].detach().view(torch.int16)).view(cp.uint16)
                         for n in ("gate_up_proj", "down_proj"))
        banks.append(DeviceBank(gate_up, down))
    return DeviceWeights(named, banks)


def bytes_read_per_token(cfg, t: dict, ls, n: int) -> int:
    """Fewest bytes one decode token at position n reads in a layer: weights used + state read."""
    k = cfg.num_experts_per_tok
    total = 0
    for name, w in t.items():
        if name.startswith("experts."):
            continue
        total += w.nbytes // w.shape[0] if name.endswith(("position_bias", "tid2eid")) else w.nbytes
    total += k * (t["experts.gate_up"][0].nbytes + t["experts.down"][0].nbytes)
    total += ls.raw.nbytes
    if ls.kind == HCA:
        total += (n + 1) // ls.compressor.ratio * ls.compressor.rows.shape[1] * 4
    elif ls.kind == CSA:
        usable = (n + 1) // 4
        total += min(usable, cfg.index_topk) * ls.compressor.rows.shape[1] * 4
        total += usable * ls.indexer.rows.shape[1] * 4
    return int(total)


def layer_params(cfg, kind: str) -> int:
    """Weight parameters one token multiplies in a layer of this kind (6 routed + shared)."""
    D, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    q, o, inter = cfg.q_lora_rank, cfg.o_groups * cfg.o_lora_rank, cfg.moe_intermediate_size
    p = D * q + q * H * d + D * d + o * (H * d // cfg.o_groups) + D * o
    p += cfg.n_routed_experts * D + (cfg.num_experts_per_tok + cfg.n_shared_experts) * 3 * inter * D
    p += 2 * (2 + cfg.hc_mult) * cfg.hc_mult * cfg.hc_mult * D
    if kind == CSA:
        p += 2 * 2 * d * D + 2 * 2 * cfg.index_head_dim * D
        p += q * cfg.index_n_heads * cfg.index_head_dim + cfg.index_n_heads * D
    elif kind == HCA:
        p += 2 * d * D
    return p


def matrix_flops(cfg, kind: str, chunk: int) -> float:
    """FLOPs of a prefill chunk from position 0: weight products plus attention and indexer."""
    t = np.arange(chunk) + 1
    keys = np.minimum(t, cfg.sliding_window).astype(np.float64)
    if kind == CSA:
        keys += np.minimum(t // 4, cfg.index_topk)
        index = 2.0 * cfg.index_n_heads * cfg.index_head_dim * (t // 4).sum()
    else:
        keys += t // 128 if kind == HCA else 0
        index = 0.0
    attn = 4.0 * cfg.num_attention_heads * cfg.head_dim * keys.sum()
    return 2.0 * chunk * layer_params(cfg, kind) + attn + index


def prefill_floor(cfg, kind: str, chunk: int, ceilings: dict) -> float:
    """Seconds: the larger of the chunk's FLOPs at the GEMM rate and the weight bytes it must
    read (experts hit by chunk * top-k uniform picks) at the copy rate."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    hit = E * (1.0 - (1.0 - k / E) ** chunk)
    expert_bytes = 2 * 3 * cfg.moe_intermediate_size * cfg.hidden_size
    dense = 2 * (layer_params(cfg, kind) - k * expert_bytes // 2)
    read_s = (dense + hit * expert_bytes) / ceilings["copy_bytes_per_s"]
    return max(matrix_flops(cfg, kind, chunk) / ceilings["gemm_flop_per_s"], read_s)
