"""One session's state, preallocated for ctx_size (docs/MODEL.md, Incremental state)."""

from __future__ import annotations

import numpy as np

from ds4.model.config import CSA, HCA, SLIDING, ModelConfig


class CompressorState:
    """A compressor's frontier (pending rows, CSA overlap) and its append-only compressed rows.

    Row w of `rows` is the entry of window w (tokens m*w .. m*w+m-1); the number of valid rows
    and pending rows follow from the session position n (n // m and n % m).
    """

    def __init__(self, xp, ratio: int, width: int, out_dim: int, overlap: bool, capacity: int):
        self.ratio = ratio
        self.overlap = overlap
        self.pending_kv = xp.zeros((ratio, width), dtype=xp.float32)
        self.pending_score = xp.zeros((ratio, width), dtype=xp.float32)
        half = out_dim if overlap else 0
        self.overlap_kv = xp.zeros((ratio, half), dtype=xp.float32)
        self.overlap_score = xp.full((ratio, half), -xp.inf, dtype=xp.float32)
        self.rows = xp.zeros((capacity, out_dim), dtype=xp.float32)

    def reset(self) -> None:
        """Back to position 0: no overlap yet (score -inf gives the missing slots weight 0)."""
        self.overlap_score.fill(-np.inf)

    def small_arrays(self) -> dict:
        """The fixed-size frontier arrays (what a rollback has to restore)."""
        return {"pending_kv": self.pending_kv, "pending_score": self.pending_score,
                "overlap_kv": self.overlap_kv, "overlap_score": self.overlap_score}


class LayerState:
    """Raw K=V ring (position p in slot p % window) plus the layer's compressor(s)."""

    def __init__(self, xp, cfg: ModelConfig, layer: int, ctx_size: int):
        self.kind = cfg.layer_types[layer]
        self.raw = xp.zeros((cfg.sliding_window, cfg.head_dim), dtype=xp.float32)
        self.compressor = self.indexer = None
        if self.kind == SLIDING:
            return
        m = cfg.compress_ratio(layer)
        cap = ctx_size // m
        c = 2 if self.kind == CSA else 1
        self.compressor = CompressorState(xp, m, c * cfg.head_dim, cfg.head_dim, self.kind == CSA,
                                          cap)
        if self.kind == CSA:
            k = cfg.index_head_dim
            self.indexer = CompressorState(xp, m, 2 * k, k, True, cap)
        assert self.kind in (CSA, HCA)

    def compressors(self) -> dict[str, CompressorState]:
        """{"compressor": ..., "indexer": ...} for the ones this layer has."""
        named = {"compressor": self.compressor, "indexer": self.indexer}
        return {k: v for k, v in named.items() if v is not None}


class SessionState:
    """All layers' state of one session plus the position counter n (the next token's position)."""

    def __init__(self, xp, cfg: ModelConfig, ctx_size: int):
        self.xp = xp
        self.ctx_size = ctx_size
        self.window = cfg.sliding_window
        self.n = 0
        self.layers = [LayerState(xp, cfg, i, ctx_size) for i in range(cfg.num_hidden_layers)]

    def reset(self) -> None:
        """Empty context (arrays stay allocated)."""
        self.n = 0
        for layer in self.layers:
            for comp in layer.compressors().values():
                comp.reset()

    def frontier_arrays(self) -> dict[str, object]:
        """Every fixed-size array (raw rings, pending rows, overlaps) by a stable name."""
        out = {}
        for i, layer in enumerate(self.layers):
            out[f"{i}.raw"] = layer.raw
            for cname, comp in layer.compressors().items():
                for aname, arr in comp.small_arrays().items():
                    out[f"{i}.{cname}.{aname}"] = arr
        return out

    def export(self, to_host) -> dict[str, np.ndarray]:
        """Host arrays holding exactly the live state (fixed arrays + valid compressed rows)."""
        out = {name: to_host(arr) for name, arr in self.frontier_arrays().items()}
        for i, layer in enumerate(self.layers):
            for cname, comp in layer.compressors().items():
                out[f"{i}.{cname}.rows"] = to_host(comp.rows[: self.n // comp.ratio])
        return out

    def load(self, arrays: dict[str, np.ndarray], n: int) -> None:
        """Inverse of export (shapes are checked by the caller's fingerprint)."""
        self.n = n
        for name, arr in self.frontier_arrays().items():
            arr[...] = self.xp.asarray(arrays[name])
        for i, layer in enumerate(self.layers):
            for cname, comp in layer.compressors().items():
                rows = arrays[f"{i}.{cname}.rows"]
                comp.rows[: rows.shape[0]] = self.xp.asarray(rows)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for this session's state."""
        total = 0
        for layer in self.layers:
            total += layer.raw.nbytes
            for comp in layer.compressors().values():
                total += comp.rows.nbytes + sum(a.nbytes for a in comp.small_arrays().values())
        return int(total)


def state_bytes(cfg: ModelConfig) -> tuple[float, int]:
    """(bytes per context token, fixed bytes) of one session's state for this model."""
    per_token, fixed = 0.0, 0
    for i, kind in enumerate(cfg.layer_types):
        fixed += cfg.sliding_window * cfg.head_dim * 4
        if kind == SLIDING:
            continue
        m = cfg.compress_ratio(i)
        widths = [(2 if kind == CSA else 1) * cfg.head_dim]
        outs = [cfg.head_dim]
        if kind == CSA:
            widths.append(2 * cfg.index_head_dim)
            outs.append(cfg.index_head_dim)
        for width, out in zip(widths, outs):
            per_token += out * 4 / m
            fixed += 2 * m * width * 4 + (2 * m * out * 4 if kind == CSA else 0)
    return per_token, fixed
