"""Write the HF-parity fixtures under tests/fixtures/ (docs/MODEL.md, Reference fixtures).

Run with a Python that has torch 2.13 (CPU) and transformers 5.23:

    /work/.refvenv/bin/python tools/make_reference.py [--out tests/fixtures]

For each small random DeepseekV4ForCausalLM config it writes a directory holding
  config.json            HF fields plus the official-style keys (compress_ratios, ...)
  model.safetensors      HF `save_pretrained(save_original_format=False)` names, fp32
  default/               the same weights as transformers' default save_pretrained() writes
                         them (hybrid naming), stored as bf16
  official/              the same weights under the official DeepSeek names,
                         experts one by one, stored as bf16 (weights are bf16-exact, so
                         both layouts hold identical values)
  ref.npz                ids, non-cached logits of every position, logits at the end of
                         each ragged cached prefill chunk, and logits of single-token
                         decode steps after that prefill (all fp32, from HF fp32)
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)

# Each case: config overrides, prefill chunk sizes (ragged), decode steps.
CASES = {
    # Window 32 crossed in prefill; CSA m=4 with top-8 of up to 30 rows; HCA m=16 closes
    # windows during prefill (15..95) and during decode (111).
    "v4_csa_hca": dict(
        config=dict(
            hidden_size=64,
            num_hidden_layers=6,
            layer_types=[SLIDING, SLIDING, CSA, HCA, CSA, HCA],
            mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 3,
            compress_rates={CSA: 4, HCA: 16},
            sliding_window=32,
            index_topk=8,
        ),
        chunks=[37, 1, 31, 3, 20, 8],
        decode_steps=20,
        seed=3,  # seeds chosen so every top-k pick wins by > 3e-4 (see selection_margins)
        hf_dtype="bfloat16",  # the bf16-on-disk case (values are bf16-exact anyway)
    ),
    # HCA m=8 / window 16 (many HCA rows), HCA before CSA, topk 4.
    "v4_hca8": dict(
        config=dict(
            hidden_size=32,
            num_hidden_layers=5,
            layer_types=[SLIDING, SLIDING, HCA, CSA, HCA],
            mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 3,
            compress_rates={CSA: 4, HCA: 8},
            sliding_window=16,
            index_topk=4,
            n_routed_experts=4,
        ),
        chunks=[5, 1, 17, 2, 9, 26],
        decode_steps=16,
        seed=4,
        hf_dtype="float32",
    ),
}

BASE_CONFIG = dict(
    vocab_size=512,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    partial_rotary_factor=8 / 32,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=16,
    index_n_heads=16,
    index_head_dim=16,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    max_position_embeddings=1048576,
    tie_word_embeddings=False,
    num_nextn_predict_layers=0,  # no MTP tensors in these fixtures (HF never builds one)
)

def build_config(overrides: dict) -> DeepseekV4Config:
    """HF config for one case, eager attention and experts (float64-safe, plainest path)."""
    config = DeepseekV4Config(**{**BASE_CONFIG, **overrides})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def official_keys(config: DeepseekV4Config) -> dict:
    """Keys the official checkpoint's config.json uses for the same schedule."""
    rates = {SLIDING: 0, **config.compress_rates}
    n_hash = sum(t == "hash_moe" for t in config.mlp_layer_types)
    return {
        # the official list carries one trailing entry per MTP block
        "compress_ratios": ([rates[t] for t in config.layer_types]
                            + [0] * config.num_nextn_predict_layers),
        "num_hash_layers": n_hash,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    }


def rerandomise(model: DeepseekV4ForCausalLM, seed: int) -> None:
    """Replace HF's flat init (zero sinks/biases, all-zero tid2eid) with varied values.

    Every float tensor is finally rounded to bf16-representable values, so a bf16 copy on
    disk holds exactly the weights the fp32 reference ran with.
    """
    gen = torch.Generator().manual_seed(seed)
    config = model.config
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if "inv_freq" in name:
            continue
        if name.endswith("tid2eid"):
            picks = [torch.randperm(config.n_routed_experts,
                                    generator=gen)[: config.num_experts_per_tok]
                     for _ in range(p.shape[0])]
            p.copy_(torch.stack(picks))
            continue
        p.copy_(_random_like(name, p, gen))
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.is_floating_point() and "inv_freq" not in name:
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def _random_like(name: str, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random tensor for one parameter, scaled so softmaxes and routing are not flat."""
    normal = torch.randn(p.shape, generator=gen)
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return 1.0 + 0.2 * normal
    if name.endswith("scale"):  # mHC scales: near 1, some spread
        return 0.6 + 0.8 * torch.rand(p.shape, generator=gen)
    if name.endswith(("base", "hc_base")):
        return 0.5 * normal
    if name.endswith(("fn", "hc_fn")):
        return 0.1 * normal
    if name.endswith("sinks"):
        return normal
    if name.endswith("position_bias"):
        return 0.5 * normal
    if name.endswith("e_score_correction_bias"):
        return 0.1 * normal
    if name.endswith("embed_tokens.weight"):
        return normal
    if p.dim() >= 2:
        return normal / p.shape[-1] ** 0.5  # fan-in scaling: unit-ish activations
    raise ValueError(f"no random rule for {name} {tuple(p.shape)}")


HF_TO_OFFICIAL = [
    # (HF regex, official replacement), applied in order to names without "model."
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
]


def official_state(hf_state: dict[str, torch.Tensor], inter: int) -> dict[str, torch.Tensor]:
    """Rename an HF state dict to the official layout; split stacked experts one by one."""
    out = {}
    for name, t in hf_state.items():
        name = re.sub(r"^model\.", "", name)
        if name.endswith("experts.gate_up_proj"):
            stem = name[: -len("gate_up_proj")].replace(".mlp.", ".ffn.")
            for e in range(t.shape[0]):
                out[f"{stem}{e}.w1.weight"] = t[e, :inter].clone()
                out[f"{stem}{e}.w3.weight"] = t[e, inter:].clone()
            continue
        if name.endswith("experts.down_proj"):
            stem = name[: -len("down_proj")].replace(".mlp.", ".ffn.")
            for e in range(t.shape[0]):
                out[f"{stem}{e}.w2.weight"] = t[e].clone()
            continue
        for pattern, repl in HF_TO_OFFICIAL:
            name = re.sub(pattern, repl, name)
        out[name] = t.clone()
    return out


@torch.inference_mode()
def reference_logits(model, ids: torch.Tensor, chunks: list[int]) -> dict[str, np.ndarray]:
    """Non-cached logits, ragged cached prefill chunk-end logits, then decode-step logits."""
    full = model(input_ids=ids[None], use_cache=False).logits[0].float()
    cache = DynamicCache(config=model.config)
    ends, chunk_logits, pos = [], [], 0
    for size in chunks:
        out = model(input_ids=ids[None, pos : pos + size], past_key_values=cache, use_cache=True)
        pos += size
        ends.append(pos)
        chunk_logits.append(out.logits[0, -1].float())
    decode_logits = []
    for t in range(pos, ids.shape[0]):
        out = model(input_ids=ids[None, t : t + 1], past_key_values=cache, use_cache=True)
        decode_logits.append(out.logits[0, -1].float())
    return {
        "ids": ids.numpy().astype(np.int64),
        "full_logits": full.numpy(),
        "chunk_sizes": np.array(chunks, dtype=np.int64),
        "chunk_ends": np.array(ends, dtype=np.int64),
        "chunk_logits": torch.stack(chunk_logits).numpy(),
        "prefill_len": np.array(pos, dtype=np.int64),
        "decode_logits": torch.stack(decode_logits).numpy(),
    }


def as_bf16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float tensors cast to bf16 (lossless here), integer tables kept."""
    return {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
            for k, v in state.items()}


def save_bf16(path: Path) -> None:
    """Rewrite a saved safetensors file with its float tensors in bf16."""
    save_file(as_bf16(load_file(path)), path, metadata={"format": "pt"})


def write_config(model, directory: Path) -> None:
    """config.json as HF saves it, plus the official-style schedule keys."""
    path = directory / "config.json"
    data = json.loads(path.read_text()) if path.exists() else model.config.to_dict()
    data.update(official_keys(model.config))
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def make_case(name: str, case: dict, out: Path) -> dict:
    """Build, save and run one case; returns a summary of its self-checks."""
    torch.manual_seed(case["seed"])
    config = build_config(case["config"])
    model = DeepseekV4ForCausalLM(config).float().eval()
    with torch.no_grad():
        rerandomise(model, case["seed"])
    directory = out / name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    model.save_pretrained(directory, save_original_format=False)
    write_config(model, directory)
    if case["hf_dtype"] == "bfloat16":
        save_bf16(directory / "model.safetensors")
    official_dir = directory / "official"
    official_dir.mkdir()
    state = official_state(model.state_dict(), config.moe_intermediate_size)
    save_file(as_bf16(state), official_dir / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(directory / "config.json", official_dir / "config.json")
    # transformers' default save_pretrained() layout (both namings mixed, docs/MODEL.md, Weights),
    # which is what users get unless they ask for save_original_format=False.
    default_dir = directory / "default"
    model.save_pretrained(default_dir)
    save_bf16(default_dir / "model.safetensors")
    shutil.copy(directory / "config.json", default_dir / "config.json")
    for extra in default_dir.glob("generation_config.json"):
        extra.unlink()
    for extra in directory.glob("generation_config.json"):
        extra.unlink()

    gen = torch.Generator().manual_seed(100 + case["seed"])
    n = sum(case["chunks"]) + case["decode_steps"]
    ids = torch.randint(0, config.vocab_size, (n,), generator=gen)
    ids[0] = 0  # BOS, like every real prompt
    ref = reference_logits(model, ids, case["chunks"])
    np.savez_compressed(directory / "ref.npz", **ref)
    return self_check(name, model, directory, ref, case)


@torch.inference_mode()
def self_check(name: str, model, directory: Path, ref: dict, case: dict) -> dict:
    """Cached vs non-cached agreement, reload of both layouts, and that selection matters."""
    full = ref["full_logits"]
    chunk_diff = np.abs(ref["chunk_logits"] - full[ref["chunk_ends"] - 1]).max()
    p = int(ref["prefill_len"])
    decode_diff = np.abs(ref["decode_logits"] - full[p:]).max()
    ids = torch.from_numpy(ref["ids"])[None]
    reload_diff = {}
    for sub in ("", "official"):
        loaded = DeepseekV4ForCausalLM.from_pretrained(directory / sub, dtype=torch.float32)
        loaded.config._attn_implementation = "eager"
        loaded.config._experts_implementation = "eager"
        got = loaded(input_ids=ids, use_cache=False).logits[0].numpy()
        reload_diff[sub or "hf"] = float(np.abs(got - full).max())
    wide = build_config({**case["config"], "index_topk": 10_000})
    wide_model = DeepseekV4ForCausalLM(wide).float().eval()
    wide_model.load_state_dict(model.state_dict())
    wide_diff = np.abs(wide_model(input_ids=ids, use_cache=False).logits[0].numpy() - full).max()
    margins = selection_margins(model, ids)
    summary = {
        "case": name,
        "selection_margins": margins,
        "max|logit|": float(np.abs(full).max()),
        "chunked_vs_full": float(chunk_diff),
        "decode_vs_full": float(decode_diff),
        "reload": reload_diff,
        "no_indexer_selection_vs_full": float(wide_diff),
        "distinct_argmax": int(len(set(full.argmax(-1).tolist()))),
    }
    assert chunk_diff < 1e-4 and decode_diff < 1e-4, summary
    assert max(reload_diff.values()) == 0.0, summary
    assert wide_diff > 1e-2, f"indexer top-k does not matter in {name}: {summary}"
    assert min(margins.values()) > 1e-4, f"a near-tie in a selection of {name}: {summary}"
    return summary


@torch.inference_mode()
def selection_margins(model, ids: torch.Tensor) -> dict[str, float]:
    """Smallest gap between the last picked and the first dropped score, for MoE routing and
    the indexer: a gap far above fp32 noise means no engine can legitimately pick differently."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    config, found = model.config, {"moe": [], "indexer": []}

    def router_hook(module, args, _output):
        scores = module.score_fn(torch.nn.functional.linear(
            args[0].reshape(-1, module.hidden_dim), module.weight))
        ranked = (scores + module.e_score_correction_bias).sort(dim=-1, descending=True).values
        found["moe"].append((ranked[:, module.top_k - 1] - ranked[:, module.top_k]).min().item())

    def scorer_hook(_module, _args, scores):
        rate = config.compress_rates[CSA]
        for t in range(scores.shape[1]):
            usable = scores[0, t, : (t + 1) // rate]
            if usable.numel() > config.index_topk:
                ranked = usable.sort(descending=True).values
                found["indexer"].append(
                    (ranked[config.index_topk - 1] - ranked[config.index_topk]).item())

    hooks = [m.register_forward_hook(router_hook) for m in model.modules()
             if isinstance(m, hf.DeepseekV4TopKRouter)]
    hooks += [m.register_forward_hook(scorer_hook) for m in model.modules()
              if isinstance(m, hf.DeepseekV4IndexerScorer)]
    model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    return {k: min(v) for k, v in found.items()}


def main() -> None:
    """Write every case's fixture directory and print its self-check summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[1] / "tests/fixtures")
    args = parser.parse_args()
    torch.set_num_threads(2)
    for name, case in CASES.items():
        print(json.dumps(make_case(name, case, args.out)))


if __name__ == "__main__":
    main()
