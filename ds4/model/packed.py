"""Weights held in their stored FP8 / FP4 form and dequantized per use (docs/PERF.md).

An official checkpoint keeps most matrices as FP8 E4M3 codes with one power-of-two scale per
[block_rows x block_cols] tile, and the routed experts as FP4 E2M1 codes (two per byte, low
nibble = even column) with one scale per 32 columns. A PackedMatrix holds exactly those bytes
(a view of the mapped file on NumPy, device arrays on CuPy) and widens them only when a step
needs the matrix or the expert, into a buffer of the engine's scratch.
"""

from __future__ import annotations

from math import ceil

import numpy as np

from ds4.model import quant

FP8, FP4 = "fp8", "fp4"
FP4_GROUP = 32  # columns sharing one FP4 scale


class PackedMatrix:
    """Codes [..., rows, cols or cols/2] (uint8) and scales (E8M0 bytes or float32 values).

    Leading axes stack matrices of one shape (a layer's experts); `shape` is the logical
    shape, as if the matrix were widened.
    """

    def __init__(self, fmt: str, codes, scale, cols: int, block: tuple[int, int] = (128, 128)):
        self.fmt, self.codes, self.scale, self.block = fmt, codes, scale, tuple(block)
        self.shape = (*codes.shape[:-1], cols)
        self.scratch = None  # the engine's Scratch, bound once the model exists
        self.source = None  # the StoredTensor it was read from (host loading only)

    @property
    def nbytes(self) -> int:
        """Bytes held: codes plus scales."""
        return int(self.codes.nbytes + self.scale.nbytes)

    @property
    def ndim(self) -> int:
        """Number of logical axes."""
        return len(self.shape)

    def __getitem__(self, index) -> PackedMatrix:
        """The stacked matrices picked by index along the leading axis (an int or ids)."""
        out = PackedMatrix(self.fmt, self.codes[index], self.scale[index], self.shape[-1],
                           self.block)
        out.scratch = self.scratch
        return out

    def dense(self, xp, name: str = "dequant"):
        """fp32 values of the whole (stacked) matrix, written into scratch buffer `name`."""
        out = (self.scratch.view(name, self.shape) if self.scratch is not None
               else xp.empty(self.shape, dtype=xp.float32))
        if self.fmt == FP8:
            _fp8_into(xp, self.codes, self.scale, self.block, out)
        else:
            _fp4_into(xp, self.codes, self.scale, out)
        return out

    @property
    def kernel_ready(self) -> bool:
        """True when ds4/kernels/packed.cu can read it in place: E8M0 byte scales, whole 16-byte
        loads per row, and for FP8 a square power-of-two scale tile of at least 16."""
        if str(self.scale.dtype) != "uint8" or not self.codes.flags.c_contiguous:
            return False
        if self.fmt == FP4:
            return self.shape[-1] % 32 == 0
        br, bc = self.block
        return br == bc and br >= 16 and br & (br - 1) == 0 and self.shape[-1] % 16 == 0

    def words(self, xp, name: str = "dequant"):
        """bf16 words (uint16) of a 2-D matrix: exact, FP8 and FP4 values times powers of two
        all fit bf16's 8 significant bits. On the GPU one kernel pass writes them into scratch
        (the slab a tensor-core GEMM reads next, never a widened layer)."""
        if xp is not np and self.ndim == 2 and self.kernel_ready:
            return self._kernel_words(xp, name + ".words")
        bits = self.dense(xp, name).view(xp.uint32)
        return (bits >> 16).astype(xp.uint16)

    def _kernel_words(self, xp, name: str):
        from ds4.kernels import packed as kernels

        out = (self.scratch.view(name, self.shape, xp.uint16) if self.scratch is not None
               else xp.empty(self.shape, dtype=xp.uint16))
        if self.fmt == FP8:
            return kernels.dequant_fp8_bf16(self.codes, self.scale, self.block[0], out)
        return kernels.dequant_fp4_bf16(self.codes, self.scale, out)


def scale_values(xp, scale):
    """fp32 values of stored scales: E8M0 bytes 2^(byte - 127), float32 as they are."""
    if scale.dtype == xp.uint8:
        return xp.ldexp(xp.ones(scale.shape, xp.float32), scale.astype(xp.int32) - 127)
    return scale.astype(xp.float32, copy=False)


def _table(xp, values: np.ndarray):
    return values if xp is np else xp.asarray(values)


def _fp8_into(xp, codes, scale, block: tuple[int, int], out) -> None:
    """out = e4m3(codes) * scale broadcast over its [br x bc] tiles (ragged edge tiles too)."""
    xp.take(_table(xp, quant.E4M3_TABLE), codes, out=out)
    s = scale_values(xp, scale)
    rows, cols = out.shape[-2:]
    br, bc = block
    if rows % br == 0 and cols % bc == 0:
        tiles = out.reshape(*out.shape[:-2], rows // br, br, cols // bc, bc)
        tiles *= s[..., :, None, :, None]
        return
    for r in range(ceil(rows / br)):  # ragged edges: one band of rows at a time
        band = out[..., r * br:(r + 1) * br, :]
        band *= xp.repeat(s[..., r, :], bc, axis=-1)[..., None, :cols]


def _fp4_into(xp, codes, scale, out) -> None:
    """out = e2m1(low nibble | high nibble) * scale per 32 columns."""
    table = _table(xp, quant.FP4_TABLE)
    pairs = out.reshape(*codes.shape, 2)
    pairs[..., 0] = table[codes & 0xF]
    pairs[..., 1] = table[codes >> 4]
    groups = out.reshape(*out.shape[:-1], out.shape[-1] // FP4_GROUP, FP4_GROUP)
    groups *= scale_values(xp, scale)[..., None]


def is_packed(w) -> bool:
    """True for a PackedMatrix or a PlacedStack of them (weights that linear() must widen per
    use)."""
    return isinstance(w, PackedMatrix) or getattr(w, "placed", False)


def on_device(xp, m: PackedMatrix) -> PackedMatrix:
    """The same packed matrix with codes and scales copied to xp's device once (float32
    power-of-two scales as E8M0 bytes there: a quarter of the bytes, what the kernels read)."""
    if xp is np:
        return m
    scale = e8m0_bytes(np.asarray(m.scale))
    return PackedMatrix(m.fmt, xp.asarray(m.codes), xp.asarray(scale), m.shape[-1], m.block)


def e8m0_bytes(scale: np.ndarray) -> np.ndarray:
    """E8M0 bytes of float32 scales that are powers of two in range; other scales as they are."""
    if scale.dtype == np.uint8:
        return scale
    mant, exp = np.frexp(scale.astype(np.float32))
    if not (np.all(mant == 0.5) and np.all((exp >= -126) & (exp <= 128))):
        return scale
    return (exp - 1 + 127).astype(np.uint8)


def stack(parts: list[PackedMatrix]) -> PackedMatrix:
    """Matrices of one format stacked on a new leading axis (host copies of their bytes)."""
    first = parts[0]
    codes = np.stack([np.asarray(p.codes) for p in parts])
    scale = np.stack([np.asarray(p.scale) for p in parts])
    return PackedMatrix(first.fmt, codes, scale, first.shape[-1], first.block)


def concat_rows(parts: list[PackedMatrix]) -> PackedMatrix:
    """Matrices of one width joined along their rows (w1 then w3 of an expert); FP8 parts
    must end on whole scale tiles (the loader checks)."""
    if len(parts) == 1:
        return parts[0]
    codes = np.concatenate([np.asarray(p.codes) for p in parts], axis=-2)
    scale = np.concatenate([np.asarray(p.scale) for p in parts], axis=-2)
    return PackedMatrix(parts[0].fmt, codes, scale, parts[0].shape[-1], parts[0].block)
