"""Memory-mapped safetensors reading (one file or a sharded index), widening to fp32 on use."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds4.model import quant

RAW_DTYPES = {
    "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "F8_E4M3": np.uint8, "F8_E8M0": np.uint8, "BOOL": np.bool_,
}


@dataclass
class StoredTensor:
    """One tensor as it lies on disk (a read-only view of the mapped file) plus its scale."""

    name: str
    dtype: str
    data: np.ndarray
    scale: StoredTensor | None = None
    block: tuple[int, int] = (128, 128)  # FP8 scale tile (config weight_block_size)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape after decoding (FP4 packs two columns per byte)."""
        if self.is_fp4:
            return (*self.data.shape[:-1], self.data.shape[-1] * 2)
        return tuple(self.data.shape)

    @property
    def is_fp4(self) -> bool:
        """Packed E2M1 routed-expert weight (I8 codes with an E8M0 scale)."""
        return self.dtype in ("I8", "U8") and self.scale is not None

    @property
    def is_low_precision(self) -> bool:
        """FP8 or FP4 weight that the official graph quantised."""
        return self.dtype == "F8_E4M3" or self.is_fp4

    @property
    def nbytes(self) -> int:
        """Bytes on disk, scale included."""
        return int(self.data.nbytes + (self.scale.nbytes if self.scale is not None else 0))

    def widen(self, index: int | None = None) -> np.ndarray:
        """fp32 (or int64 for integer tables) host array of the tensor, or of its row `index`."""
        data = self.data if index is None else self.data[index]
        if self.dtype == "F8_E4M3":
            scale = self.scale.data if index is None else self.scale.data[index]
            return quant.dequant_fp8_weight(data, _scale_values(self.scale, scale), self.block)
        if self.is_fp4:
            scale = self.scale.data if index is None else self.scale.data[index]
            return quant.dequant_fp4_weight(data, _scale_values(self.scale, scale))
        if self.dtype == "BF16":
            return np.left_shift(data, 16, dtype=np.uint32).view(np.float32)  # one allocation
        if self.dtype in ("I64", "I32", "I16", "I8", "U8"):
            return np.asarray(data, dtype=np.int64)
        if self.dtype == "F32":
            return data  # already fp32: the mapped view itself, no copy
        return data.astype(np.float32)


def _scale_values(scale: StoredTensor, data: np.ndarray) -> np.ndarray:
    if scale.dtype == "F8_E8M0":
        return quant.e8m0_to_float(data)
    return np.asarray(StoredTensor(scale.name, scale.dtype, data).widen(), dtype=np.float32)


def read_file(path: Path) -> dict[str, StoredTensor]:
    """Map one .safetensors file; tensors are views into the mapping (nothing read yet)."""
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info["dtype"]
        if dtype not in RAW_DTYPES:
            raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {dtype}")
        start, end = info["data_offsets"]
        raw = mapped[base + start : base + end].view(RAW_DTYPES[dtype]).reshape(info["shape"])
        tensors[name] = StoredTensor(name, dtype, raw)
    return tensors


def read_checkpoint(model_dir: str | Path) -> dict[str, StoredTensor]:
    """All tensors of a model directory (model.safetensors, an index's shards, or *.safetensors)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    tensors: dict[str, StoredTensor] = {}
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"weight shard {path} named by the index is missing")
        tensors.update(read_file(path))
    return _attach_scales(tensors)


def _attach_scales(tensors: dict[str, StoredTensor]) -> dict[str, StoredTensor]:
    """Pair `X.weight` with its block scale `X.scale` (or `X.weight_scale_inv`)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith((".scale", ".weight_scale_inv")) and _scale_owner(name) in tensors:
            continue
        out[name] = t
    for name, t in tensors.items():
        owner = _scale_owner(name)
        if owner in out and owner != name and name.endswith((".scale", ".weight_scale_inv")):
            out[owner].scale = t
    return out


def _scale_owner(name: str) -> str:
    if name.endswith(".weight_scale_inv"):
        return name[: -len("_scale_inv")]
    if name.endswith(".scale"):
        return name[: -len(".scale")] + ".weight"
    return name
