"""Engine-owned transient buffers shared by all sessions, grown on demand to the largest chunk."""

from __future__ import annotations

from math import prod


class Scratch:
    """Named flat fp32 buffers; `view(name, shape)` returns a reshaped prefix of one of them.

    A view is written and consumed inside one forward call, so every session of an engine can
    share the same buffers; they only ever grow (to the largest chunk any session asked for).
    """

    def __init__(self, xp):
        self.xp = xp
        self._buffers: dict[str, object] = {}

    def view(self, name: str, shape: tuple[int, ...], dtype=None):
        """A [shape] array backed by buffer `name`, grown when too small (contents undefined)."""
        dtype = dtype or self.xp.float32
        size = prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = self.xp.empty(max(size, 1), dtype=dtype)
            self._buffers[name] = buf
        return buf[:size].reshape(shape)

    @property
    def nbytes(self) -> int:
        """Bytes currently held."""
        return int(sum(b.nbytes for b in self._buffers.values()))

    def free(self) -> None:
        """Drop every buffer (the engine is closing)."""
        self._buffers.clear()
