"""Official-format (FP8 + FP4) layers at V4-Flash dimensions for tools/bench_engine.py.

Random packed weights in the official storage (FP8 E4M3 codes + one E8M0 scale per 128 x 128
tile for wq_a, wq_b, wkv, wo_a, wo_b, the indexer's wq_b and the shared expert; routed experts
FP4 E2M1 pairs + one scale per 32 columns; bf16 router, compressors and indexer weights_proj),
held on the device as the engine holds an official checkpoint, then timed through the engine's
own model code: one decode token per layer against the bytes it must read, and prefill chunks
against their FLOP / byte floor.
"""

from __future__ import annotations

import numpy as np
from bench_flash import bytes_read_per_token, flash_config, matrix_flops

from ds4.model.checkpoint_names import expected_shapes, official_of
from ds4.model.config import ModelConfig
from ds4.model.expert_bank import ExpertBank
from ds4.model.official_format import FP8_RE
from ds4.model.packed import FP4, FP4_GROUP, FP8, PackedMatrix
from ds4.model.weights import Weights

BLOCK = (128, 128)
BF16_SUFFIXES = ("_proj.weight", "embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")


def random_fp8(cp, rng, shape: tuple[int, int]) -> PackedMatrix:
    """Random finite E4M3 codes (magnitudes 2^-9 .. 448, log-uniform) with scales 2^-16."""
    codes = rng.integers(0, 0x7F, shape, dtype=cp.int32).astype(cp.uint8)
    codes |= (rng.integers(0, 2, shape, dtype=cp.int32) << 7).astype(cp.uint8)
    tiles = (-(-shape[0] // BLOCK[0]), -(-shape[1] // BLOCK[1]))
    scale = cp.full(tiles, 127 - 16, dtype=cp.uint8)
    return PackedMatrix(FP8, codes, scale, shape[1], BLOCK)


def random_fp4(cp, rng, shape: tuple[int, ...]) -> PackedMatrix:
    """Random E2M1 pairs (any byte is two valid codes) with scales 2^-8."""
    *lead, rows, cols = shape
    codes = rng.integers(0, 256, (*lead, rows, cols // 2), dtype=cp.int32).astype(cp.uint8)
    scale = cp.full((*lead, rows, cols // FP4_GROUP), 127 - 8, dtype=cp.uint8)
    return PackedMatrix(FP4, codes, scale, cols)


def packed_weights(cp, cfg) -> Weights:
    """One layer's tensors as an official checkpoint is held on the GPU."""
    rng = cp.random.default_rng(0)
    named = {}
    for name, shape in expected_shapes(cfg).items():
        if FP8_RE.search(official_of(name)):
            named[name] = random_fp8(cp, rng, shape)
        elif len(shape) == 2 and name.endswith(BF16_SUFFIXES):
            w = (rng.standard_normal(shape, dtype=cp.float32) * 0.02).view(cp.uint32)
            named[name] = (w >> 16).astype(cp.uint16)
        else:
            named[name] = rng.standard_normal(shape, dtype=cp.float32) * 0.1
    E, inter, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    bank = ExpertBank.from_stacks(cp, random_fp4(cp, rng, (E, 2 * inter, D)),
                                  random_fp4(cp, rng, (E, D, inter)))
    return Weights(named, [bank], {}, True)


def layer_model(cp, kind, small: bool, quantize: bool, load_format: str = "auto"):
    """The engine's Model on CuPy (or NumPy) holding one packed layer of this kind, or a
    layer of each kind of a list (load_format dummy: weights drawn by ds4's own dummy loader,
    ds4.model.dummy)."""
    from ds4.backend import get_backend
    from ds4.model.dummy import dummy_weights
    from ds4.model.forward import Model

    config = flash_config(kind if isinstance(kind, list) else [kind], small=small)
    config["quantization_config"] = {"fmt": "e4m3", "weight_block_size": list(BLOCK)}
    config["expert_dtype"] = "fp4"
    cfg = ModelConfig.from_dict(config)
    weights = dummy_weights(cfg, cp) if load_format == "dummy" else packed_weights(cp, cfg)
    return Model(cfg, weights, get_backend("numpy" if cp.__name__ == "numpy" else "cupy"), quantize)


def filled_state(cp, cfg, ctx: int):
    """A state at position ctx - 2 with random rows everywhere (no window closes there)."""
    from ds4.model.state import SessionState

    state, rng = SessionState(cp, cfg, ctx), cp.random.default_rng(1)
    state.n = ctx - 2
    for ls in state.layers:
        ls.raw[...] = rng.standard_normal(ls.raw.shape, dtype=cp.float32)
        for comp in ls.compressors().values():
            for arr in (comp.rows, comp.pending_kv, comp.pending_score, comp.overlap_kv,
                        comp.overlap_score):
                arr[...] = rng.standard_normal(arr.shape, dtype=cp.float32)
    return state


def decode_layer(cp, model, ctx: int) -> dict:
    """Seconds of one token through the layer (no embedding, no head) and the bytes it reads:
    a CUDA-graph replay of the kernel decoder where the kernels cover the model, else the
    model code run eagerly."""
    from timing import graph_time, timed

    from ds4.model.gpu_decode import KernelDecoder

    cfg, state = model.cfg, filled_state(cp, model.cfg, ctx)
    lw, ls = model.weights.layer(0), state.layers[0]
    t = {name[len("model.layers.0."):]: w for name, w in model.weights.tensors.items()
         if name.startswith("model.layers.0.")}
    t["experts.gate_up"], t["experts.down"] = lw.experts.stacked
    out = {"bytes": bytes_read_per_token(cfg, t, ls, state.n)}
    if model.kernel_decoder is None:
        step = model._step(state.n, [7])
        X = cp.random.default_rng(2).standard_normal((1, cfg.hc_mult, cfg.hidden_size),
                                                     dtype=cp.float32)
        out["s"] = timed(cp, lambda: model._layer(0, ls, X, step), repeat=10, warmup=2)
        out["path"] = "model code (eager)"
        return out
    dec = KernelDecoder.from_model(model)
    B = dec.prepare([state], [7])  # a batch of one
    dec.run(B)  # compiles and loads every kernel outside capture
    cp.cuda.Device().synchronize()
    out["s"] = graph_time(cp, dec.stream, lambda: dec.run_layer(0, B))
    t0 = dec.layers[0]
    out["stages"] = {"attention": graph_time(cp, dec.stream, lambda: dec._attention(0, t0, B)),
                     "moe": graph_time(cp, dec.stream, lambda: dec._moe(0, t0, B))}
    out["path"] = "CUDA graph"
    return out


def prefill_layer(cp, model, chunk: int) -> float:
    """Seconds of one chunk of random tokens from an empty context through the layer."""
    from timing import timed

    from ds4.model.state import SessionState

    ids = np.random.default_rng(chunk).integers(2, model.cfg.vocab_size, chunk).tolist()
    state = SessionState(cp, model.cfg, chunk)

    def run():
        """One chunk from an empty context."""
        state.reset()
        model.forward(state, ids)
    return timed(cp, run, repeat=3, warmup=1)


def packed_prefill_floor(model, kind: str, chunk: int, ceilings: dict) -> float:
    """The larger of the chunk's FLOPs at the GEMM rate and the packed bytes it must read
    (experts hit by chunk * top-k uniform picks) at the copy rate."""
    cfg, w = model.cfg, model.weights
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    hit = E * (1.0 - (1.0 - k / E) ** chunk)
    dense = sum(int(t.nbytes) for name, t in w.tensors.items() if name.startswith("model.layers."))
    bank = w.experts[0]
    read_s = (dense + hit * bank.nbytes / E) / ceilings["copy_bytes_per_s"]
    return max(matrix_flops(cfg, kind, chunk) / ceilings["gemm_flop_per_s"], read_s)


def official_bench(cp, kinds: list[str], chunks: list[int], ctx: int, small: bool,
                   ceilings: dict, quantize: bool = False, load_format: str = "auto") -> dict:
    """Per layer kind: packed decode vs its bytes floor, prefill per chunk vs its floor."""
    out = {}
    for kind in dict.fromkeys(kinds):
        model = layer_model(cp, kind, small, quantize, load_format)
        row = {"decode": decode_layer(cp, model, ctx), "weight_bytes": model.weights.nbytes}
        row["decode"]["floor_s"] = row["decode"]["bytes"] / ceilings["copy_bytes_per_s"]
        row["prefill"] = {c: {"s": prefill_layer(cp, model, c),
                              "floor_s": packed_prefill_floor(model, kind, c, ceilings)}
                          for c in chunks}
        out[kind] = row
        model = None
        cp.get_default_memory_pool().free_all_blocks()
    return out


def report_official(res: dict, quantize: bool = False) -> None:
    """Print the packed tables."""
    print(f"\nofficial format (FP8 + FP4 held packed), per layer, FP8/FP4 simulation "
          f"{'on' if quantize else 'off'}:", flush=True)
    for kind, row in res.items():
        d = row["decode"]
        stages = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in d.get("stages", {}).items())
        print(f"{kind[:10]:10} weights {row['weight_bytes'] / 1e9:.2f} GB (layer + embed + head); "
              f"decode ({d['path']}) {d['s'] * 1e3:.3f} ms, reads {d['bytes'] / 1e6:.1f} MB, "
              f"floor {d['floor_s'] * 1e3:.3f} ms ({d['s'] / d['floor_s']:.2f}x)  {stages}")
        for chunk, p in row["prefill"].items():
            print(f"{'':10} prefill chunk {chunk:5}: {p['s'] * 1e3:8.2f} ms, {chunk / p['s']:8.0f} "
                  f"tok/s, floor {p['floor_s'] * 1e3:.2f} ms ({p['s'] / p['floor_s']:.1f}x)")
