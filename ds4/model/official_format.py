"""Synthetic official-format checkpoints: any model quantised into the official V4 layout.

The official DeepSeek-V4-Flash release stores most matrices as FP8 E4M3 with one E8M0 scale
per 128 x 128 tile (`X.weight` + `X.scale`), the routed experts as FP4 E2M1 (I8 [out, in/2],
low nibble = even column) with one E8M0 scale per 32 columns, and embeddings, head, norms,
router, compressors, hc_*, sinks and ape as BF16 / F32, in shards named by
model.safetensors.index.json. `write_official` writes any model that way, so tests and
benchmarks have packed checkpoints of every size; `write_dequantized` writes the same values
widened to fp32, the reference a packed engine must match.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import numpy as np

from ds4.kernels import to_bf16
from ds4.model import quant
from ds4.model.checkpoint_names import official_of, unhybrid
from ds4.model.safetensors_file import read_checkpoint

FP8_RE = re.compile(r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b"
                    r"|ffn\.shared_experts\.w[123]|e_proj|h_proj)\.weight$")
FP4_RE = re.compile(r"(^|\.)ffn\.experts\.\d+\.w[123]\.weight$")
F32_RE = re.compile(r"((^|\.)hc_\w+|attn_sink|\.ape|gate\.bias)$")
HF_EXPERTS_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
E8M0_BIAS = 127
POSITIVE_E4M3 = quant.E4M3_TABLE[:0x7F]  # codes 0..126 in increasing order (0x7F is NaN)
POSITIVE_E2M1 = np.array(quant.FP4_VALUES, np.float32)
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _exponents(amax: np.ndarray, max_value: float) -> np.ndarray:
    """Power-of-two scale exponents ceil(log2(amax / max_value)) that fit E8M0 (0 for zeros)."""
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(amax / max_value))
    return np.clip(np.where(amax > 0, e, 0), -E8M0_BIAS, E8M0_BIAS).astype(np.int32)


def _codes(values: np.ndarray, positive: np.ndarray, sign_bit: int) -> np.ndarray:
    """Code of each exactly representable value: index in the positive table plus sign bit."""
    index = np.searchsorted(positive, np.abs(values)).astype(np.uint8)
    return np.where(values < 0, index | sign_bit, index).astype(np.uint8)


def quantize_fp8(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(E4M3 codes [r, c], E8M0 scale bytes [ceil(r/br), ceil(c/bc)]) of an fp32 matrix."""
    rows, cols = w.shape
    br, bc = block
    R, C = -(-rows // br), -(-cols // bc)
    padded = np.zeros((R * br, C * bc), np.float32)
    padded[:rows, :cols] = w
    tiles = padded.reshape(R, br, C, bc)
    e = _exponents(np.abs(tiles).max(axis=(1, 3)), quant.E4M3_MAX)
    scaled = tiles / np.ldexp(np.float32(1), e)[:, None, :, None]
    codes = _codes(quant.round_e4m3(np, scaled.astype(np.float32)), POSITIVE_E4M3, 0x80)
    return codes.reshape(R * br, C * bc)[:rows, :cols].copy(), (e + E8M0_BIAS).astype(np.uint8)


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(packed E2M1 pairs [r, c/2] (low nibble = even column), E8M0 bytes [r, c/32])."""
    rows, cols = w.shape
    if cols % 32:
        raise ValueError(f"an FP4 matrix needs a multiple of 32 columns, got {cols}")
    groups = w.reshape(rows, cols // 32, 32)
    e = _exponents(np.abs(groups).max(axis=2), quant.E2M1_MAX)
    scaled = (groups / np.ldexp(np.float32(1), e)[:, :, None]).astype(np.float32)
    codes = _codes(quant.round_e2m1(np, scaled), POSITIVE_E2M1, 0x8).reshape(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.astype(np.uint8), (e + E8M0_BIAS).astype(np.uint8)


def official_values(src: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a model directory under its official name, widened (fp32 / int64)."""
    out: dict[str, np.ndarray] = {}
    for name, t in unhybrid(read_checkpoint(src)).items():
        m = HF_EXPERTS_RE.match(name)
        if m:
            out.update(_split_experts(int(m.group(1)), m.group(2), t.widen()))
        elif name.startswith(("model.", "lm_head.")):
            out[official_of(name)] = t.widen()
        else:
            out[name] = t.widen()
    return out


def _split_experts(layer: int, kind: str, stacked: np.ndarray) -> dict[str, np.ndarray]:
    """HF's stacked experts as the official per-expert w1 / w3 (gate_up halves) and w2."""
    stem, out = f"layers.{layer}.ffn.experts.", {}
    for e, w in enumerate(stacked):
        if kind == "down_proj":
            out[f"{stem}{e}.w2.weight"] = w
        else:
            half = w.shape[0] // 2
            out[f"{stem}{e}.w1.weight"], out[f"{stem}{e}.w3.weight"] = w[:half], w[half:]
    return out


def official_tensors(values: dict[str, np.ndarray], block: tuple[int, int] = (128, 128),
                     scale_dtype: str = "e8m0") -> dict[str, tuple[str, np.ndarray]]:
    """name -> (safetensors dtype, raw array) in the official storage formats."""
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, w in values.items():
        if FP4_RE.search(name):
            codes, scale = quantize_fp4(np.asarray(w, np.float32))
            out[name] = ("I8", codes.view(np.int8))
        elif FP8_RE.search(name):
            codes, scale = quantize_fp8(np.asarray(w, np.float32), block)
            out[name] = ("F8_E4M3", codes)
        else:
            out[name] = _plain(name, w)
            continue
        out[name[: -len("weight")] + "scale"] = _scale(scale, scale_dtype)
    return out


def _plain(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
    """Integer tables as I64, hc_* / sinks / ape / router bias as F32, the rest BF16."""
    if w.dtype.kind in "iu":
        return "I64", w.astype(np.int64)
    if F32_RE.search(name):
        return "F32", w.astype(np.float32)
    return "BF16", to_bf16(w)


def _scale(scale_bytes: np.ndarray, scale_dtype: str) -> tuple[str, np.ndarray]:
    """E8M0 bytes as stored by the instruct release, or their float32 values (-Base)."""
    if scale_dtype == "e8m0":
        return "F8_E8M0", scale_bytes
    if scale_dtype == "f32":
        return "F32", np.ldexp(np.float32(1), scale_bytes.astype(np.int32) - E8M0_BIAS)
    raise ValueError(f"scale dtype must be e8m0 or f32, got {scale_dtype!r}")


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """One .safetensors file of (dtype, array) tensors, written in the given order."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, arr) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())


def write_shards(out: Path, tensors: dict[str, tuple[str, np.ndarray]], shard_bytes: int) -> None:
    """Shards of about shard_bytes each plus model.safetensors.index.json (a weight and its
    scale always share a shard)."""
    shards: list[dict] = [{}]
    size = 0
    for name in tensors:
        if name.endswith(".scale") and name[: -len("scale")] + "weight" in tensors:
            continue  # written with its weight
        group = {name: tensors[name]}
        scale = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
        if scale in tensors:
            group[scale] = tensors[scale]
        nbytes = sum(a.nbytes for _, a in group.values())
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1].update(group)
        size += nbytes
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / file, shard)
        weight_map.update({name: file for name in shard})
        total += sum(a.nbytes for _, a in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def official_config(config: dict, block: tuple[int, int]) -> dict:
    """config.json of the packed checkpoint: the source's plus the official quantisation keys."""
    config = dict(config)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    config["expert_dtype"] = "fp4"
    config["torch_dtype"] = "bfloat16"
    return config


def write_official(src: str | Path, out: str | Path, block: tuple[int, int] = (128, 128),
                   scale_dtype: str = "e8m0", shard_bytes: int = 2 << 30) -> Path:
    """Quantise the model in `src` into an official-format checkpoint directory `out`."""
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = official_tensors(official_values(src), block, scale_dtype)
    write_shards(out, tensors, shard_bytes)
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(official_config(config, block), indent=2))
    _copy_side_files(src, out)
    return out


def write_dequantized(packed: str | Path, out: str | Path) -> Path:
    """The packed checkpoint's values with every FP8 / FP4 tensor widened to F32 (one file)."""
    packed, out = Path(packed), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((packed / "config.json").read_text())
    block = tuple((config.get("quantization_config") or {}).get("weight_block_size", (128, 128)))
    tensors = {}
    for name, t in read_checkpoint(packed).items():
        t.block = block
        tensors[name] = ("F32", t.widen()) if t.is_low_precision else (t.dtype, t.data)
    write_safetensors(out / "model.safetensors", tensors)
    for key in ("quantization_config", "expert_dtype"):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_side_files(packed, out)
    return out


def _copy_side_files(src: Path, out: Path) -> None:
    for name in COPIED:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
