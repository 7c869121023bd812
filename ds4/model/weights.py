"""Model weights: every checkpoint layout mapped to HF names, checked (docs/MODEL.md, Weights)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ds4.kernels import exact_bf16
from ds4.model import packed as pk
from ds4.model.checkpoint_names import (
    expected_shapes,
    official_named,
    official_of,
    unhybrid,
)
from ds4.model.config import ModelConfig
from ds4.model.expert_bank import ExpertBank
from ds4.model.packed import PackedMatrix, concat_rows, on_device
from ds4.model.safetensors_file import StoredTensor, read_checkpoint


class WeightsError(ValueError):
    """A checkpoint tensor is missing or has the wrong shape."""


class Weights:
    """Named device arrays (HF names; GPU matrices as bf16 words), expert banks, MTP kept aside."""

    def __init__(self, tensors: dict, experts: list, mtp: dict, low_precision: bool):
        self.tensors = tensors
        self.experts = experts
        self.mtp = mtp  # official `mtp.*` tensors, mapped; ds4.model.mtp loads them on request
        self.low_precision = low_precision
        self.placement = None  # an ExpertPlacement when some experts live in host memory
        self.host_tensor_nbytes = 0  # bytes of named tensors in mapped host memory (embedding)

    def __getitem__(self, name: str):
        return self.tensors[name]

    def layer(self, i: int) -> LayerWeights:
        """Accessor for one decoder layer's tensors by their names inside the layer."""
        return LayerWeights(self, i)

    @property
    def nbytes(self) -> int:
        """Bytes of resident weights (tied tensors counted once; the embedding not where it
        went to host memory, as host experts are not)."""
        seen = {id(t): int(t.nbytes) for t in self.tensors.values()}
        return (sum(seen.values()) - self.host_tensor_nbytes
                + sum(bank.nbytes for bank in self.experts))

    @property
    def host_nbytes(self) -> int:
        """Bytes of routed experts placed in mapped host memory."""
        return sum(getattr(bank, "host_nbytes", 0) for bank in self.experts)

    @property
    def packed(self) -> bool:
        """True when some matrix or expert is held as FP8 / FP4 codes (widened per use)."""
        return (any(isinstance(t, PackedMatrix) for t in self.tensors.values())
                or any(getattr(bank, "packed", False) for bank in self.experts))

    def bind(self, scratch) -> None:
        """Packed weights widen into this scratch (the engine's) when a step uses them."""
        for t in self.tensors.values():
            if isinstance(t, PackedMatrix):
                t.scratch = scratch
        for bank in self.experts:
            if hasattr(bank, "bind"):  # (a benchmark's duck-typed banks hold no packing)
                bank.bind(scratch)


class LayerWeights:
    """`lw["self_attn.kv_proj.weight"]` for layer i, plus its expert bank."""

    def __init__(self, weights: Weights, i: int):
        self._tensors = weights.tensors
        self._prefix = f"model.layers.{i}."
        self.experts = weights.experts[i]

    def __getitem__(self, name: str):
        return self._tensors[self._prefix + name]

    def __contains__(self, name: str) -> bool:
        return self._prefix + name in self._tensors


def load_weights(model_dir: str | Path, cfg: ModelConfig, xp, resident_experts: bool = True,
                 budget: int | None = None, experts: list | None = None) -> Weights:
    """Map and check a checkpoint; every tensor stays in its stored format where it is packed
    (FP8 / FP4 codes + scales), routed experts stay mapped when not resident. `budget` (bytes
    of device memory for all weights; None: no limit) sends the coldest packed experts to
    mapped host memory. `experts` (per layer, the expert ids to hold: one rank's share under
    expert parallel) holds only those, in that order, all resident."""
    stored = unhybrid(read_checkpoint(model_dir))
    mtp = {k: v for k, v in stored.items() if k.startswith("mtp.")}
    official = not any(k.startswith(("model.", "lm_head.")) for k in stored)
    named = (official_named(stored) if official
             else {k: v for k, v in stored.items() if k not in mtp})
    expected = expected_shapes(cfg)
    if cfg.tie_word_embeddings and "lm_head.weight" in named:
        expected["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for name, shape in expected.items():
        _check(named, name, shape, official)
    block = weight_block(cfg)
    for t in stored.values():
        t.block = block
    packed = any(t.is_low_precision for t in stored.values())
    dense = {name: _held(named[name], _label(name, official), block, packed) for name in expected}
    expert_sources = [_expert_sources(stored if official else named, cfg, i, official, block)
                      for i in range(cfg.num_hidden_layers)]
    expert_bytes = sum(_source_bytes(s) for pair in expert_sources for part in pair for s in part)
    progress = _progress(sum(named[n].nbytes for n in expected)
                         + (expert_bytes if resident_experts else 0))
    tensors = {}
    for name in expected:
        tensors[name] = _device_tensor(xp, name, named[name], dense[name])
        progress.update(named[name].nbytes)
    if "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    if experts is not None:  # one rank's share: those experts only, all resident
        banks = [_share_bank(xp, pair, ids) for pair, ids in zip(expert_sources, experts)]
        progress.close()
        return Weights(tensors, banks, mtp, packed)
    mask, moved = _resident_mask(xp, cfg, expert_sources, budget, tensors, resident_experts)
    host = _host_memory(xp, expert_sources, mask)
    experts, offset = [], 0
    for (gate_up, down), keep in zip(expert_sources, mask):
        bank_packed = isinstance(gate_up[0][0], PackedMatrix)
        if keep.all():
            experts.append(ExpertBank(xp, gate_up, down, resident_experts, bank_packed))
        else:
            bank, offset = _placed_bank(xp, gate_up, down, keep, host, offset)
            experts.append(bank)
        progress.update(sum(_source_bytes(s) for s in gate_up + down) if resident_experts else 0)
    progress.close()
    weights = Weights(tensors, experts, mtp, packed)
    weights.host_tensor_nbytes = moved
    if not mask.all():
        from ds4.model.placement import ExpertPlacement

        weights.placement = ExpertPlacement(experts, budget)
    return weights


def checkpoint_experts(model_dir: str | Path, cfg: ModelConfig, xp, experts: list) -> list:
    """Per layer, an ExpertBank of the experts `experts[layer]` of a checkpoint (an expert
    worker's share: nothing else is read)."""
    stored = unhybrid(read_checkpoint(model_dir))
    official = not any(k.startswith(("model.", "lm_head.")) for k in stored)
    block = weight_block(cfg)
    for t in stored.values():
        t.block = block
    return [_share_bank(xp, _expert_sources(stored, cfg, i, official, block), ids)
            for i, ids in enumerate(experts)]


def _share_bank(xp, sources: tuple, ids: list) -> ExpertBank:
    """A resident bank of experts `ids` (in that order) of one layer's (gate_up, down)."""
    gate_up, down = ([part[e] for e in ids] for part in sources)
    return ExpertBank(xp, gate_up, down, True, isinstance(gate_up[0][0], PackedMatrix))


def device_tensors(xp, named: dict, packed: bool, block: tuple[int, int]) -> dict:
    """Stored tensors by name in the form the forward pass reads them (as load_weights holds
    them: packed matrices packed, bf16 words where the products read words, else fp32)."""
    return {name: _device_tensor(xp, name, t, _held(t, name, block, packed))
            for name, t in named.items()}


def official_bank(xp, stored: dict, cfg: ModelConfig, layer: int,
                  block: tuple[int, int]) -> ExpertBank:
    """Layer `layer`'s routed experts from official per-expert names, held in device memory."""
    gate_up, down = _expert_sources(stored, cfg, layer, True, block)
    return ExpertBank(xp, gate_up, down, True, isinstance(gate_up[0][0], PackedMatrix))


def _resident_mask(xp, cfg: ModelConfig, sources: list, budget: int | None, tensors: dict,
                   resident_experts: bool) -> tuple[np.ndarray, int]:
    """(which experts stay in device memory, bytes of tensors moved to host memory): all
    without a budget, else the choice of ds4.model.placement under the budget left after the
    dense tensors (the embedding moved to host memory first where the experts overflow)."""
    from ds4.model.placement import place_experts

    L, E = cfg.num_hidden_layers, cfg.n_routed_experts
    if budget is None or not resident_experts:
        return np.ones((L, E), dtype=bool), 0
    dense = sum({id(t): int(t.nbytes) for t in tensors.values()}.values())
    if not all(isinstance(gate_up[0][0], PackedMatrix) for gate_up, _ in sources):
        held = dense + sum(_source_bytes(s) for pair in sources for part in pair for s in part)
        if held > budget:  # a bf16 checkpoint that fits is simply held whole
            raise WeightsError(f"the weights need {held / 2**30:.1f} GiB of device memory and "
                               f"the budget is {budget / 2**30:.1f} GiB; only packed (FP8 / FP4) "
                               "experts can be placed in host memory")
        return np.ones((L, E), dtype=bool), 0
    per_expert = sum(concat_rows(s).nbytes for s in (sources[0][0][0], sources[0][1][0]))
    return place_experts(xp, tensors, budget, dense, per_expert, (L, E))


def _host_memory(xp, sources: list, mask: np.ndarray):
    """One mapped host allocation for every expert the mask leaves out (None: none)."""
    from ds4.model.placement import HostMemory, PlacedStack

    if mask.all():  # nothing placed (and BF16 sources are no packed matrices)
        return None
    total = 0
    for sources_of, keep in zip(sources, mask):
        for part in (concat_rows(sources_of[0][0]), concat_rows(sources_of[1][0])):
            total += PlacedStack.host_bytes_of(part.codes.shape, part.scale.shape,
                                               int((~keep).sum()))
    return HostMemory(xp, total) if total else None


def _placed_bank(xp, gate_up: list, down: list, keep: np.ndarray, host, offset: int):
    """A layer's packed experts over device slots (keep) and host slots; (bank, next offset)."""
    from ds4.model.placement import PlacedStack

    stacks = []
    for sources in (gate_up, down):
        first = concat_rows(sources[0])
        scale_shape = first.scale.shape
        stack = PlacedStack.allocate(xp, first.fmt, first.codes.shape, scale_shape,
                                     first.shape[-1], first.block, keep, host, offset)
        offset += PlacedStack.host_bytes_of(first.codes.shape, scale_shape, int((~keep).sum()))
        for e, src in enumerate(sources):
            m = concat_rows(src)
            scale = pk.e8m0_bytes(np.asarray(m.scale))
            if scale.dtype != np.uint8:
                raise WeightsError("expert scales that are not powers of two cannot be placed")
            stack.fill(e, xp.asarray(np.asarray(m.codes)), xp.asarray(scale))
        stacks.append(stack)
    return ExpertBank.from_stacks(xp, *stacks), offset


def weight_block(cfg: ModelConfig) -> tuple[int, int]:
    """FP8 scale tile [rows, cols] from quantization_config.weight_block_size (128 x 128 when
    the config names none)."""
    block = (cfg.quantization_config or {}).get("weight_block_size") or [128, 128]
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise WeightsError(f"config quantization_config.weight_block_size must be two positive "
                           f"integers, got {block!r}")
    return int(block[0]), int(block[1])


FLOAT_DTYPES = ("F32", "BF16", "F16", "F64", "F8_E4M3")
INT_DTYPES = ("I64", "I32", "I16", "I8", "U8")


def _held(stored: StoredTensor, label: str, block: tuple[int, int], packed_ckpt: bool):
    """The form a dense tensor is held in: a PackedMatrix (host, mapped) for FP8 / FP4, the
    mapped bf16 words for matrices of a packed checkpoint, else None (widen at load)."""
    if stored.name.endswith("tid2eid"):
        if stored.dtype not in INT_DTYPES:
            raise WeightsError(f"tensor {label} has dtype {stored.dtype}; an expert table is "
                               "integer")
        return None
    if stored.dtype in INT_DTYPES and stored.scale is None:
        raise WeightsError(f"tensor {label} has dtype {stored.dtype} and no .scale: integer "
                           f"codes without a scale are no weights (FP4 needs its .scale)")
    if stored.dtype not in FLOAT_DTYPES and not stored.is_fp4:
        raise WeightsError(f"tensor {label} has dtype {stored.dtype}, which cannot hold weights")
    if stored.dtype == "F8_E4M3" or stored.is_fp4:
        return packed_matrix(stored, label, block)
    if packed_ckpt and stored.dtype == "BF16" and stored.data.ndim == 2:
        return stored.data  # held as its stored words; linear() widens per use
    return None


def packed_matrix(stored: StoredTensor, label: str, block: tuple[int, int]) -> PackedMatrix:
    """A checked PackedMatrix over the mapped codes and scales of an FP8 or FP4 tensor."""
    problem = _packing_problem(stored, block)
    if problem:
        raise WeightsError(f"tensor {label}: {problem}")
    fmt = pk.FP8 if stored.dtype == "F8_E4M3" else pk.FP4
    return PackedMatrix(fmt, stored.data.view(np.uint8), _scale_array(stored.scale),
                        stored.shape[-1], block)


def _packing_problem(stored: StoredTensor, block: tuple[int, int]) -> str | None:
    """Why an FP8 / FP4 tensor cannot be read (None when its codes and scale agree)."""
    scale = stored.scale
    if scale is None:
        return f"{stored.dtype} weight has no {_scale_name(stored.name)} tensor"
    if scale.dtype not in ("F8_E8M0", "F32"):
        return f"scale {scale.name} has dtype {scale.dtype}, expected F8_E8M0 or F32"
    if stored.data.ndim < 2:
        return f"packed weight has shape {list(stored.data.shape)}; a matrix is 2-D"
    *lead, rows, cols = stored.shape
    if stored.dtype == "F8_E4M3":
        want = (*lead, -(-rows // block[0]), -(-cols // block[1]))
    else:
        if cols % pk.FP4_GROUP:
            return (f"packed width {stored.data.shape[-1]} holds {cols} FP4 columns, not a "
                    f"multiple of {pk.FP4_GROUP} (one scale per {pk.FP4_GROUP} columns)")
        want = (*lead, rows, cols // pk.FP4_GROUP)
    if tuple(scale.data.shape) != want:
        return f"scale {scale.name} has shape {list(scale.data.shape)}, expected {list(want)}"
    return None


def _scale_name(weight: str) -> str:
    return weight[: -len(".weight")] + ".scale" if weight.endswith(".weight") else weight + ".scale"


def _scale_array(scale: StoredTensor) -> np.ndarray:
    """E8M0 bytes as uint8, -Base float32 scales as float32 (both mapped, not copied)."""
    return scale.data.view(np.uint8) if scale.dtype == "F8_E8M0" else scale.data


def _label(name: str, official: bool) -> str:
    return f"{official_of(name)} (HF {name})" if official else name


WORD_MATRICES = ("_proj.weight", "embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")


def _device_tensor(xp, name: str, stored: StoredTensor, held):
    """A packed matrix's codes and scales on the device; a GPU matrix of exact bf16 values as
    bf16 words (kernels and GEMMs read them); else fp32."""
    if isinstance(held, PackedMatrix):
        return on_device(xp, held)
    if held is not None:
        return xp.asarray(held)  # NumPy: the mapped words themselves
    # held once in the form both decode kernels and GemmEx read; NumPy keeps fp32, which its
    # matmul reads fastest
    if xp is not np and name.endswith(WORD_MATRICES):
        if stored.dtype == "BF16":  # already the words: no fp32 copy to narrow again
            return xp.asarray(stored.data)
        words = exact_bf16(stored.widen())
        if words is not None:
            return xp.asarray(words)
    return xp.asarray(stored.widen())


def _check(named: dict, name: str, shape: tuple, official: bool) -> None:
    label = f"{official_of(name)} (HF {name})" if official else name
    if name not in named:
        raise WeightsError(f"checkpoint lacks tensor {label}, expected shape {list(shape)}")
    got = named[name].shape
    if tuple(got) != tuple(shape):
        raise WeightsError(f"tensor {label} has shape {list(got)}, expected {list(shape)}")


def _expert_sources(tensors: dict, cfg: ModelConfig, i: int, official: bool,
                    block: tuple[int, int] = (128, 128)) -> tuple[list, list]:
    E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if not official:
        stem = f"model.layers.{i}.mlp.experts."
        _check(tensors, stem + "gate_up_proj", (E, 2 * I, D), False)
        _check(tensors, stem + "down_proj", (E, D, I), False)
        gate_up, down = tensors[stem + "gate_up_proj"], tensors[stem + "down_proj"]
        return [(gate_up, e) for e in range(E)], [(down, e) for e in range(E)]
    gate_up, down = [], []
    for e in range(E):
        stem = f"layers.{i}.ffn.experts.{e}."
        parts = {}
        for part, shape in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
            name = f"{stem}{part}.weight"
            if name in tensors:
                parts[part] = _expert_part(tensors[name], block)
            _check(tensors, name, shape, False)
        gate_up.append((parts["w1"], parts["w3"]))
        down.append((parts["w2"],))
    if _packable(gate_up, block):
        return gate_up, down
    return ([tuple(_stored_of(p) for p in s) for s in gate_up],
            [tuple(_stored_of(p) for p in s) for s in down])


def _expert_part(stored: StoredTensor, block: tuple[int, int]):
    """An expert matrix as a checked PackedMatrix when FP8 / FP4, else the stored tensor."""
    held = _held(stored, stored.name, block, False)
    if isinstance(held, PackedMatrix):
        held.source = stored
        return held
    return stored


def _packable(gate_up: list, block: tuple[int, int]) -> bool:
    """Experts stay packed when every part is packed and w1 | w3 join on whole scale tiles."""
    parts = [p for pair in gate_up for p in pair]
    if not all(isinstance(p, PackedMatrix) for p in parts):
        return False
    return all(p.fmt == pk.FP4 or p.shape[0] % block[0] == 0 for p in parts)


def _stored_of(part):
    return part.source if isinstance(part, PackedMatrix) else part


def _source_bytes(src) -> int:
    if isinstance(src, PackedMatrix):
        return src.nbytes
    if len(src) == 2 and isinstance(src[1], int):
        return src[0].nbytes // src[0].data.shape[0]
    return sum(part.nbytes for part in src)


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int):
    """A stderr progress bar for checkpoints over 256 MiB; silent for small models."""
    if total < 256 << 20:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", file=sys.stderr)
