"""A layer's routed experts as the model reads them: resident stacks (packed as stored, bf16
words, or split over device and mapped host memory) or mapped views widened per use
(docs/MODEL.md, Weights)."""

from __future__ import annotations

import numpy as np

from ds4.kernels import exact_bf16, widen
from ds4.model.packed import PackedMatrix, concat_rows, on_device, stack


class ExpertBank:
    """One layer's routed experts: stacks resident on the device, or mapped views widened per use.

    Resident stacks hold the experts as stored when packed (FP4 codes + scales, widened per use
    into the engine's scratch), else bf16 words (uint16) when every value is exactly bf16, else
    fp32. On the GPU the prefill GEMMs (and, for bf16 words, the decode kernels) read these
    stacks in place, so every expert is in device memory once. Streamed banks (NumPy only) keep
    views of the mapped file and read the experts a step picks from it each time.
    """

    def __init__(self, xp, gate_up: list, down: list, resident: bool, packed: bool = False):
        self.xp, self.resident, self.packed = xp, resident, packed
        self.count = len(down)
        self.scratch = None  # the engine's Scratch (bound by the model) for per-use widening
        if resident and packed:
            self._gate_up = on_device(xp, stack([concat_rows(s) for s in gate_up]))
            self._down = on_device(xp, stack([concat_rows(s) for s in down]))
        elif resident:
            self._gate_up = xp.asarray(_stack(gate_up))
            self._down = xp.asarray(_stack(down))
        else:
            self._gate_up_src, self._down_src = gate_up, down

    @classmethod
    def from_stacks(cls, xp, gate_up, down) -> ExpertBank:
        """A resident bank over stacks already held (packed, bf16 words, or PlacedStacks split
        over device and mapped host memory), e.g. a benchmark's or the dummy loader's."""
        placed = getattr(gate_up, "placed", False)
        bank = cls(xp, [], [], resident=False, packed=placed or isinstance(gate_up, PackedMatrix))
        bank.resident, bank.count = True, gate_up.shape[0]
        bank._gate_up, bank._down = gate_up, down
        if placed:  # routing picks, for re-placement (decode counts them)
            bank.counts = xp.zeros(bank.count, dtype=xp.int64 if xp is np else xp.int32)
        return bank

    @property
    def placed_stacks(self) -> tuple:
        """(gate_up, down) PlacedStacks when this bank's experts are split over two memories."""
        gate_up = getattr(self, "_gate_up", None)  # streamed banks hold no stacks
        return (gate_up, self._down) if getattr(gate_up, "placed", False) else ()

    def pick_counts(self) -> np.ndarray:
        """Routing picks per expert counted by decode steps (zeros when not placed)."""
        counts = getattr(self, "counts", None)
        if counts is None:
            return np.zeros(self.count, dtype=np.int64)
        return np.asarray(counts.get() if hasattr(counts, "get") else counts, dtype=np.int64)

    @property
    def host_nbytes(self) -> int:
        """Bytes of this bank's experts in mapped host memory."""
        return sum(s.host_nbytes for s in self.placed_stacks)

    def bind(self, scratch) -> None:
        """Widen packed experts into this scratch (the engine's, shared by its sessions)."""
        self.scratch = scratch
        if self.resident and self.packed:
            self._gate_up.scratch = self._down.scratch = scratch

    @property
    def stacked(self) -> tuple | None:
        """(gate_up [E, 2I, D], down [E, D, I]) as held (packed, bf16 words or fp32); None when
        streamed."""
        return (self._gate_up, self._down) if self.resident else None

    @property
    def nbytes(self) -> int:
        """Bytes held resident (0 when streamed from the mapped file)."""
        return int(self._gate_up.nbytes + self._down.nbytes) if self.resident else 0

    def gather(self, ids) -> tuple:
        """(gate_up [k, 2I, D], down [k, D, I]) fp32 for expert ids [k]
        (streaming reads them on host)."""
        if self.placed_stacks and self.xp is np:
            np.add.at(self.counts, np.asarray(ids).reshape(-1), 1)
        if self.resident and self.packed:
            return (self._gate_up[ids].dense(self.xp, "experts.gate_up"),
                    self._down[ids].dense(self.xp, "experts.down"))
        if self.resident:
            return widen(self._gate_up[ids], self.xp), widen(self._down[ids], self.xp)
        ids = (ids.get() if hasattr(ids, "get") else np.asarray(ids)).tolist()
        if self.packed:
            return (self._streamed(self._gate_up_src, ids, "experts.gate_up"),
                    self._streamed(self._down_src, ids, "experts.down"))
        gate_up = np.stack([_widen_source(self._gate_up_src[e]) for e in ids])
        down = np.stack([_widen_source(self._down_src[e]) for e in ids])
        return self.xp.asarray(gate_up), self.xp.asarray(down)

    def expert(self, e: int) -> tuple:
        """(gate_up [2I, D], down [D, I]) fp32 of one expert."""
        if self.resident and self.packed:
            return (self._gate_up[e].dense(self.xp, "expert.gate_up"),
                    self._down[e].dense(self.xp, "expert.down"))
        if self.resident:
            return widen(self._gate_up[e], self.xp), widen(self._down[e], self.xp)
        if self.packed:
            return (self._streamed(self._gate_up_src, [e], "expert.gate_up")[0],
                    self._streamed(self._down_src, [e], "expert.down")[0])
        return (self.xp.asarray(_widen_source(self._gate_up_src[e])),
                self.xp.asarray(_widen_source(self._down_src[e])))

    def _streamed(self, sources: list, ids: list[int], name: str):
        """Experts `ids` read from the mapped file now and widened into scratch `name`."""
        picked = stack([concat_rows(sources[e]) for e in ids])
        picked.scratch = self.scratch
        return picked.dense(self.xp, name)


def _widen_source(src) -> np.ndarray:
    """A source is a (StoredTensor, row) slice of a stacked tensor or a tuple of parts to concat."""
    if len(src) == 2 and isinstance(src[1], int):
        return src[0].widen(src[1])
    return np.concatenate([part.widen() for part in src], axis=0)


def _stack(sources: list) -> np.ndarray:
    """The experts stacked as bf16 words when every value is exactly bf16, else as fp32."""
    first = _widen_source(sources[0])
    words = np.empty((len(sources), *first.shape), dtype=np.uint16)
    for e in range(len(sources)):
        exact = exact_bf16(first if e == 0 else _widen_source(sources[e]))
        if exact is None:
            return np.stack([_widen_source(s) for s in sources]).astype(np.float32, copy=False)
        words[e] = exact
    return words
