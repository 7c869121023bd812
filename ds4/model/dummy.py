"""`--load-format dummy`: random weights made from config.json alone, in the checkpoint's formats.

As vLLM's dummy format does, nothing but config.json is read. Every tensor the forward pass
reads is made directly in the form the loader would hold it in: FP8 E4M3 codes with E8M0
scales per quantization_config.weight_block_size tile for the matrices the official release
stores as FP8, FP4 E2M1 pairs with one E8M0 scale per 32 columns for routed experts when
expert_dtype is fp4, BF16 words for the other matrices and fp32 for norms, mHC, sinks and
biases. On CuPy the arrays are drawn by cupy.random on the device (no big tensor passes host
RAM). Codes are uniform over a fixed code set and the scale exponents are chosen so a matrix
has a standard deviation of about 1/sqrt(fan_in), so activations stay finite through every
layer. Each tensor has its own stream seeded by (seed, name), so the values depend only on
the seed, never on load order or on where an expert is placed.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import numpy as np

from ds4.model import packed as pk
from ds4.model import quant
from ds4.model.checkpoint_names import expected_shapes
from ds4.model.config import ModelConfig
from ds4.model.expert_bank import ExpertBank
from ds4.model.placement import (
    ExpertPlacement,
    HostMemory,
    PlacedStack,
    choose_resident,
    place_experts,
)
from ds4.model.weights import (
    Weights,
    WeightsError,
    weight_block,
)

CONFIG_DIR = Path(__file__).parent / "configs"
LOAD_FORMATS = ("auto", "dummy")
# matrices the official release stores as FP8 (HF names, inside a layer)
FP8_MATRICES = ("q_a_proj.weight", "q_b_proj.weight", "self_attn.kv_proj.weight",
                "o_a_proj.weight", "o_b_proj.weight", "indexer.q_b_proj.weight",
                "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
                "shared_experts.down_proj.weight")
WORD_MATRICES = ("_proj.weight", "embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")
EXPERT_CHUNK = 16  # experts drawn per random call (fixed: it is part of what a seed means)
ROW_CHUNK = 16384  # rows of a BF16 matrix drawn per call (bounds the fp32 temporary)
# fp32 tensors: (mean, std) by name suffix, as the built-in tiny model draws them
PLAIN = {"norm.weight": (1.0, 0.2), "hc.fn": (0.0, 0.1), "hc_fn": (0.0, 0.1),
         "hc.base": (0.0, 0.5), "hc_base": (0.0, 0.5), "hc.scale": (1.0, 0.3),
         "hc_scale": (1.0, 0.3), "sinks": (0.0, 1.0), "position_bias": (0.0, 0.5),
         "e_score_correction_bias": (0.0, 0.1)}


def shipped_configs() -> list[str]:
    """Names of the configs inside the package (`--model NAME` with `--load-format dummy`)."""
    return sorted(p.parent.name for p in CONFIG_DIR.glob("*/config.json"))


def model_path(model: str | Path) -> Path:
    """A model directory, or the directory of a shipped config when `model` names one."""
    path = Path(model)
    if path.is_dir() or str(model) not in shipped_configs():
        return path
    return CONFIG_DIR / str(model)


class Random:
    """One tensor's random stream on the array module xp, seeded by (seed, name)."""

    def __init__(self, xp, seed: int, name: str):
        self.xp, key = xp, zlib.crc32(name.encode())
        if xp is np:
            self.gen = np.random.default_rng([seed & 0xFFFFFFFF, key])
        else:  # Philox: cheap to seed, and thousands of streams are seeded per model
            curand = getattr(xp.cuda, "curand", None)
            method = getattr(curand, "CURAND_RNG_PSEUDO_PHILOX4_32_10", None)
            extra = {} if method is None else {"method": method}
            self.gen = xp.random.RandomState(((seed & 0xFFFFFFFF) << 32) | key, **extra)

    def normal(self, shape: tuple):
        """Standard normal float32 values."""
        return self.gen.standard_normal(shape, dtype=self.xp.float32)

    def bytes(self, shape: tuple):
        """Uniform uint8 values."""
        if self.xp is np:
            return self.gen.integers(0, 256, shape, dtype=np.uint8)
        return self.gen.randint(0, 256, size=shape, dtype=self.xp.int32).astype(self.xp.uint8)

    def uniform(self, shape: tuple):
        """Uniform float32 values in [0, 1)."""
        if self.xp is np:
            return self.gen.random(shape, dtype=np.float32)
        return self.gen.random_sample(shape, dtype=self.xp.float32)


def _fp8_codes(xp, raw):
    """E4M3 codes from random bytes: random sign and mantissa, exponent field 5..8 (values of
    magnitude 0.25..3.75: no NaN, no subnormal)."""
    return (raw & 0x87) | ((((raw >> 3) & 3) + 5) << 3).astype(xp.uint8)


def _rms(values: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(values.astype(np.float64)))))


FP8_RMS = _rms(quant.E4M3_TABLE[_fp8_codes(np, np.arange(256, dtype=np.uint8))])
FP4_RMS = _rms(quant.FP4_TABLE)
JITTER_RMS = math.sqrt((0.25 + 1 + 4) / 3)  # scale exponents jitter by -1, 0 or +1


def scale_exponent(fan_in: int, code_rms: float, gain: float = 1.0) -> int:
    """E8M0 exponent that gives codes of this rms a std of about gain / sqrt(fan_in)."""
    return round(math.log2(gain / math.sqrt(fan_in) / code_rms / JITTER_RMS))


def _scales(rnd: Random, shape: tuple, exponent: int):
    """E8M0 bytes 127 + exponent + a jitter of -1, 0 or +1 per scale."""
    jitter = (rnd.bytes(shape) % 3).astype(rnd.xp.int32) - 1
    return (127 + exponent + jitter).astype(rnd.xp.uint8)


def fp8_matrix(rnd: Random, shape: tuple, block: tuple, gain: float = 1.0) -> pk.PackedMatrix:
    """A random FP8 matrix [..., rows, cols] with E8M0 scales per block tile."""
    *lead, rows, cols = shape
    tiles = (*lead, -(-rows // block[0]), -(-cols // block[1]))
    codes = _fp8_codes(rnd.xp, rnd.bytes(tuple(shape)))
    scale = _scales(rnd, tiles, scale_exponent(cols, FP8_RMS, gain))
    return pk.PackedMatrix(pk.FP8, codes, scale, cols, block)


def fp4_matrix(rnd: Random, shape: tuple, gain: float = 1.0) -> pk.PackedMatrix:
    """A random FP4 matrix [..., rows, cols] (two codes a byte) with E8M0 scales per 32 cols."""
    *lead, rows, cols = shape
    if cols % pk.FP4_GROUP:
        raise WeightsError(f"FP4 experts need a multiple of {pk.FP4_GROUP} columns, got {cols}")
    codes = rnd.bytes((*lead, rows, cols // 2))
    scale = _scales(rnd, (*lead, rows, cols // pk.FP4_GROUP), scale_exponent(cols, FP4_RMS, gain))
    return pk.PackedMatrix(pk.FP4, codes, scale, cols)


def bf16_words(rnd: Random, shape: tuple, std: float):
    """A random matrix as BF16 words (uint16), drawn ROW_CHUNK rows at a time."""
    xp, (rows, cols) = rnd.xp, shape
    out = xp.empty(shape, dtype=xp.uint16)
    for r0 in range(0, rows, ROW_CHUNK):
        n = min(ROW_CHUNK, rows - r0)
        values = rnd.normal((n, cols)) * xp.float32(std)
        out[r0 : r0 + n] = (values.view(xp.uint32) >> 16).astype(xp.uint16)
    return out


def dense_tensor(xp, cfg: ModelConfig, name: str, shape: tuple, seed: int, fp8: bool):
    """One non-expert tensor in its held form (FP8 PackedMatrix, BF16 words, fp32 or int64)."""
    rnd = Random(xp, seed, name)
    if name.endswith("tid2eid"):  # distinct experts per token, as a hash table holds them
        keys = rnd.uniform((shape[0], cfg.n_routed_experts))
        return xp.argsort(keys, axis=1)[:, : shape[1]].astype(xp.int64)
    if fp8 and name.endswith(FP8_MATRICES):
        return fp8_matrix(rnd, shape, weight_block(cfg))
    if len(shape) == 2 and name.endswith(WORD_MATRICES):
        gain = 2.0 if name == "lm_head.weight" else 1.0  # as the tiny model: a peakier head
        std = 1.0 if name.endswith("embed_tokens.weight") else gain / math.sqrt(shape[1])
        return bf16_words(rnd, shape, std)
    mean, std = next((v for k, v in PLAIN.items() if name.endswith(k)), (0.0, 0.1))
    return xp.float32(mean) + xp.float32(std) * rnd.normal(shape)


def expert_format(cfg: ModelConfig) -> str | None:
    """How routed experts are stored: fp4 (expert_dtype fp4), fp8 (a quantization_config
    without it) or None (BF16)."""
    declared = cfg.raw.get("expert_dtype")
    if declared not in (None, "fp4", "fp8", "bf16"):
        raise WeightsError(f"config field 'expert_dtype' must be fp4, fp8 or bf16, got "
                           f"{declared!r}")
    if declared == "fp4":
        return pk.FP4
    if declared == "bf16":
        return None
    return pk.FP8 if cfg.quantization_config is not None else None


def expert_shapes(cfg: ModelConfig, fmt: str) -> dict[str, tuple[tuple, tuple]]:
    """(codes, scales) shapes of one expert's gate_up [2I, D] and down [D, I] matrices."""
    I, D = cfg.moe_intermediate_size, cfg.hidden_size
    br, bc = weight_block(cfg)
    out = {}
    for kind, (rows, cols) in (("gate_up", (2 * I, D)), ("down", (D, I))):
        if fmt == pk.FP4:
            out[kind] = ((rows, cols // 2), (rows, cols // pk.FP4_GROUP))
        else:
            out[kind] = ((rows, cols), (-(-rows // br), -(-cols // bc)))
    return out


def expert_chunk(xp, cfg: ModelConfig, fmt: str, layer: int, kind: str, first: int, n: int,
                 seed: int) -> pk.PackedMatrix:
    """Experts first..first+n of one layer's gate_up or down stack, drawn in one call."""
    I, D = cfg.moe_intermediate_size, cfg.hidden_size
    shape = (n, 2 * I, D) if kind == "gate_up" else (n, D, I)
    rnd = Random(xp, seed, f"model.layers.{layer}.mlp.experts.{kind}.{first}")
    return fp4_matrix(rnd, shape) if fmt == pk.FP4 else fp8_matrix(rnd, shape, weight_block(cfg))


def expert_bytes(cfg: ModelConfig) -> int:
    """Bytes of one routed expert (gate_up and down, codes and scales) as stored."""
    fmt = expert_format(cfg)
    if fmt is None:
        return 3 * cfg.moe_intermediate_size * cfg.hidden_size * 2
    return sum(int(np.prod(c)) + int(np.prod(s)) for c, s in expert_shapes(cfg, fmt).values())


def dummy_weights(cfg: ModelConfig, xp, seed: int = 0, budget: int | None = None,
                  experts: list | None = None) -> Weights:
    """Random weights of every tensor the forward pass reads; `budget` (bytes of device memory
    for all weights, None: no limit) sends the coldest experts to mapped host memory.
    `experts` (per layer, the expert ids to hold: one rank's share under expert parallel)
    holds only those, with the values they have in the whole model."""
    fmt, fp8 = expert_format(cfg), cfg.quantization_config is not None
    if fp8:
        weight_block(cfg)  # a bad weight_block_size is an error before anything is drawn
    shapes = expected_shapes(cfg)
    tensors = {name: dense_tensor(xp, cfg, name, shape, seed, fp8)
               for name, shape in shapes.items()}
    tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
    if experts is not None:
        return Weights(tensors, dummy_experts(cfg, xp, seed, experts), {}, fp8)
    dense = sum(int(t.nbytes) for name, t in tensors.items() if name in shapes)
    L, E = cfg.num_hidden_layers, cfg.n_routed_experts
    resident, moved = np.ones((L, E), dtype=bool), 0
    if budget is not None and fmt is not None:
        resident, moved = place_experts(xp, tensors, budget, dense, expert_bytes(cfg), (L, E))
    elif budget is not None:  # bf16 experts: all of them, or the error below
        resident = choose_resident(budget - dense, expert_bytes(cfg), np.zeros((L, E)))
    if fmt is None:
        if not resident.all():
            raise WeightsError("BF16 experts cannot be placed in host memory; the budget "
                               "must hold every weight")
        banks = [_word_bank(xp, cfg, i, seed) for i in range(L)]
    else:
        banks = _packed_banks(xp, cfg, fmt, seed, resident)
    weights = Weights(tensors, banks, {}, fp8)
    weights.host_tensor_nbytes = moved
    if xp is not np:  # the draws' temporaries: back to the device for sessions and scratch
        xp.get_default_memory_pool().free_all_blocks()
    if not resident.all():
        weights.placement = ExpertPlacement(banks, budget)
    return weights


def dummy_experts(cfg: ModelConfig, xp, seed: int, experts: list) -> list:
    """Per layer, a resident bank of the experts `experts[layer]` (in that order), drawn as
    dummy_weights draws the whole model (an expert worker's share)."""
    fmt = expert_format(cfg)
    if fmt is None:
        return [_word_bank(xp, cfg, i, seed, ids) for i, ids in enumerate(experts)]
    return [ExpertBank.from_stacks(xp, *(_whole_stack(xp, cfg, fmt, i, kind, seed, ids)
                                         for kind in ("gate_up", "down")))
            for i, ids in enumerate(experts)]


def _word_bank(xp, cfg: ModelConfig, i: int, seed: int, ids: list | None = None) -> ExpertBank:
    """A layer's BF16 experts as stacked words (ids: only those, in that order)."""
    I, D, E = cfg.moe_intermediate_size, cfg.hidden_size, cfg.n_routed_experts
    stem = f"model.layers.{i}.mlp.experts."
    gate_up = bf16_words(Random(xp, seed, stem + "gate_up"), (E * 2 * I, D), 1 / math.sqrt(D))
    down = bf16_words(Random(xp, seed, stem + "down"), (E * D, I), 1 / math.sqrt(I))
    gate_up, down = gate_up.reshape(E, 2 * I, D), down.reshape(E, D, I)
    if ids is not None:
        pick = xp.asarray(np.asarray(ids, dtype=np.int64))
        gate_up, down = xp.ascontiguousarray(gate_up[pick]), xp.ascontiguousarray(down[pick])
    return ExpertBank.from_stacks(xp, gate_up, down)


def _packed_banks(xp, cfg: ModelConfig, fmt: str, seed: int, resident: np.ndarray) -> list:
    """Every layer's packed experts: whole device stacks where all are resident, else
    PlacedStacks over the device and one mapped host allocation."""
    shapes, block = expert_shapes(cfg, fmt), weight_block(cfg)
    cols = {"gate_up": cfg.hidden_size, "down": cfg.moe_intermediate_size}
    host_total = sum(PlacedStack.host_bytes_of(c, s, int((~r).sum()))
                     for r in resident for c, s in shapes.values())
    host = HostMemory(xp, host_total) if host_total else None
    banks, offset = [], 0
    for i, mask in enumerate(resident):
        stacks = []
        for kind, (code_shape, scale_shape) in shapes.items():
            if mask.all():
                stacks.append(_whole_stack(xp, cfg, fmt, i, kind, seed))
                continue
            stack = PlacedStack.allocate(xp, fmt, code_shape, scale_shape, cols[kind], block,
                                         mask, host, offset)
            offset += PlacedStack.host_bytes_of(code_shape, scale_shape, int((~mask).sum()))
            _fill_placed(xp, cfg, fmt, i, kind, seed, stack)
            stacks.append(stack)
        banks.append(ExpertBank.from_stacks(xp, *stacks))
    return banks


def _whole_stack(xp, cfg, fmt: str, i: int, kind: str, seed: int,
                 ids: list | None = None) -> pk.PackedMatrix:
    """A layer's resident stack, drawn chunk by chunk into one device array (no second copy
    of the layer while it is drawn); ids: only those experts, in that order."""
    E, (code_shape, scale_shape) = cfg.n_routed_experts, expert_shapes(cfg, fmt)[kind]
    ids = list(range(E)) if ids is None else list(ids)
    at = {e: j for j, e in enumerate(ids)}
    codes = xp.empty((len(ids), *code_shape), xp.uint8)
    scale = xp.empty((len(ids), *scale_shape), xp.uint8)
    for first in range(0, E, EXPERT_CHUNK):
        n = min(EXPERT_CHUNK, E - first)
        here = [(e - first, at[e]) for e in range(first, first + n) if e in at]
        if not here:
            continue
        part = expert_chunk(xp, cfg, fmt, i, kind, first, n, seed)
        src, dst = (np.array(c) for c in zip(*here))
        if len(here) == n and dst[0] + n - 1 == dst[-1]:  # the whole chunk, in order
            codes[dst[0]:dst[0] + n], scale[dst[0]:dst[0] + n] = part.codes, part.scale
        else:
            codes[xp.asarray(dst)] = part.codes[xp.asarray(src)]
            scale[xp.asarray(dst)] = part.scale[xp.asarray(src)]
    return pk.PackedMatrix(fmt, codes, scale, part.shape[-1], part.block)


def _fill_placed(xp, cfg, fmt: str, i: int, kind: str, seed: int, stack: PlacedStack) -> None:
    """Draw a layer's experts chunk by chunk (the same values as _whole_stack) into their
    device or host slots."""
    E = cfg.n_routed_experts
    for first in range(0, E, EXPERT_CHUNK):
        part = expert_chunk(xp, cfg, fmt, i, kind, first, min(EXPERT_CHUNK, E - first), seed)
        for j in range(part.codes.shape[0]):
            stack.fill(first + j, part.codes[j], part.scale[j])
