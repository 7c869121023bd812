"""What a batch graph of the kernel decode reads per replay, and its seam to the row kernels.

A graph captured for batch size B (ds4/model/gpu_decode.py) holds no session's address: member
b's position, token and state arrays are read by the kernels from a `MemberTable`, one int64
device array the host fills with one copy before each replay:

    [positions int32 [B] | tokens int32 [B]]      the first B int64 words
    [layer, slot, member] int64 addresses          slot: RAW, then 5 per compressor
    [live int32, 0]                                the last word: members that are live

so a kernel of member b = blockIdx.z finds slot k of its layer at group[k * B + b]
(ds4/kernels/attention.cu). Members at or past `live` are idle rows padding the graph's size
(a batch of 3 in the B=4 graph): the routed experts skip them (ds4/model/gpu_moe.py). The
shared matrices go through `matvec_rows` / `ProjectionPlan` / `moe_rows`: y[b] = W x[b] for
b < B, bitwise row-independent, so a member's row is the same in a batch as alone. Until
ds4/kernels/rows.py (tensor-core kernels reading W once for all rows) exists they loop b over
the single-row kernels, which reads W B times.
"""

from __future__ import annotations

import weakref

import numpy as np

from ds4.kernels.gemv import gemv, gemv_many, gemv_table
from ds4.model.packed import FP8, PackedMatrix

try:  # ds4/kernels/rows.py (tests swap it for None: the per-row fallback through twins)
    from ds4.kernels import rows as row_kernels
except ImportError:
    row_kernels = None

GROUP = ("pending_kv", "pending_score", "overlap_kv", "overlap_score", "rows")
RAW, COMPRESSOR, INDEXER = 0, 1, 1 + len(GROUP)  # first slot of each group in a layer
SLOTS = 1 + 2 * len(GROUP)
COMPRESSOR_ROWS, INDEXER_ROWS = COMPRESSOR + GROUP.index("rows"), INDEXER + GROUP.index("rows")


class MemberTable:
    """Positions, tokens and state addresses of the B members of one batch graph."""

    def __init__(self, xp, layers: int, batch: int):
        self.xp, self.layers, self.batch = xp, layers, batch
        self.host = np.zeros(batch + layers * SLOTS * batch + 1, dtype=np.int64)
        self.device = xp.zeros(self.host.size, dtype=xp.int64)
        words = self.device[:batch].view(xp.int32)
        self.pos, self.tokens = words[:batch], words[batch:]  # int32 [B] each
        self.live = self.device[-1:].view(xp.int32)[:1]  # int32 [1]: live members
        self.members: list = []
        self._addresses: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def fill(self, states: list, tokens: list[int], stream=None, live: int | None = None,
             positions: list[int] | None = None) -> None:
        """Write every member's position (default: its state's n), token and addresses, and how
        many of them (the first `live`, default all) are live; one host-to-device copy."""
        B = self.batch
        words = self.host[:B].view(np.int32)
        words[:B] = [s.n for s in states] if positions is None else positions
        words[B:] = tokens
        self.host[-1] = len(states) if live is None else live  # low int32 word: little-endian
        grid = self.host[B:-1].reshape(self.layers, SLOTS, B)
        for b, s in enumerate(states):
            grid[:, :, b] = self._of(s)
        self.members = list(states)
        if self.xp is np:
            self.device[...] = self.host
        else:
            self.device.set(self.host, stream=stream)

    def _of(self, state) -> np.ndarray:
        """[layers, SLOTS] addresses of a session's state arrays (kept: they never move)."""
        got = self._addresses.get(state)
        if got is None:
            got = np.array([[_address(_slot_array(ls, k)) for k in range(SLOTS)]
                            for ls in state.layers], dtype=np.int64)
            self._addresses[state] = got
        return got

    def group(self, layer: int, slot: int) -> np.uint64:
        """Device address of slot `slot` of layer `layer` for member 0 (member b: + 8 b)."""
        words = self.batch + (layer * SLOTS + slot) * self.batch
        return np.uint64(self.device.data.ptr + 8 * words)

    def arrays(self, layer: int, slot: int) -> list:
        """The members' arrays behind one slot (what the NumPy twins read)."""
        return [_slot_array(s.layers[layer], slot) for s in self.members]


def _slot_array(ls, slot: int):
    """The array of a layer state behind one table slot (None: the layer has none)."""
    if slot == RAW:
        return ls.raw
    cs = ls.compressor if slot < INDEXER else ls.indexer
    name = GROUP[(slot - COMPRESSOR) % len(GROUP)]
    if cs is None or (name.startswith("overlap") and not cs.overlap):
        return None
    return getattr(cs, name)


def _address(a) -> int:
    """Device address of a CuPy array (0: none, or a NumPy array of the twins)."""
    if a is None or a.size == 0 or isinstance(a, np.ndarray):
        return 0
    return int(a.data.ptr)


# ---- the shared matrices: y[b] = W x[b] for b < batch


def matvec(w, x, y, rows_per_group: int | None = None) -> None:
    """y = W x for a bf16 / fp32 matrix or a packed FP8 / FP4 one, read in place."""
    if not isinstance(w, PackedMatrix):
        gemv(w, x, y, rows_per_group=rows_per_group)
        return
    from ds4.kernels import packed

    if w.fmt == FP8:
        packed.gemv_fp8(w.codes, w.scale, w.block[0], x, y, rows_per_group=rows_per_group)
    else:
        packed.gemv_fp4(w.codes, w.scale, x, y, rows_per_group=rows_per_group)


def matvec_rows(w, x, y, batch: int, rows_per_group: int | None = None) -> None:
    """y[b] = W x[b] for b < batch (x [>= batch, K], y [>= batch, N])."""
    if _row_ready(w, rows_per_group):
        row_kernels.matvec(w, x, y, batch, rows_per_group=rows_per_group)
        return
    for b in range(batch):  # fallback: one single-row launch per member (W read B times)
        matvec(w, x[b], y[b], rows_per_group)


def _row_ready(w, rows_per_group: int | None) -> bool:
    """Whether rows.matvec reads w: a format it takes, in (groups of) whole 32-row tiles."""
    if row_kernels is None or row_kernels.operand(w) is None:
        return False
    return (w.shape[-2] if rows_per_group is None else rows_per_group) % 32 == 0


class ProjectionPlan:
    """A layer's projections of h that the attention side needs, as few launches as the kernels
    allow: bf16 (or fp32) matrices of one dtype as one gemv_many launch, packed FP8 ones of one
    width and tile as one gemv_many_fp8 launch, any other one by one; per member row."""

    def __init__(self, xp, pairs: list, max_batch: int):
        """pairs: (W, y [max_batch, rows]) per projection."""
        self.xp, self.pairs = xp, pairs
        if row_kernels is not None:
            self.plan = row_kernels.matvec_plan(xp, [w for w, _ in pairs], [y for _, y in pairs])
            return
        self.rows = [self._groups([(w, y[b]) for w, y in pairs]) for b in range(max_batch)]

    def _groups(self, pairs: list) -> list:
        groups: dict = {}
        for w, y in pairs:
            groups.setdefault(_projection_kind(w), []).append((w, y))
        return [self._group(kind, members) for kind, members in groups.items()]

    def _group(self, kind, members: list) -> tuple:
        """(kind, weights, outputs, table) of one launch group (table None: one by one)."""
        weights, outs = [w for w, _ in members], [y for _, y in members]
        if self.xp is np or kind is None or len(members) == 1:
            return None, weights, outs, None
        if kind[0] == FP8:
            from ds4.kernels import packed

            table = packed.gemv_table_fp8(self.xp, [w.codes for w in weights],
                                          [w.scale for w in weights], outs)
            return kind, weights, outs, table
        return kind, weights, outs, gemv_table(self.xp, weights, outs)

    def run(self, h, batch: int) -> None:
        """Every projection of h[b] for b < batch."""
        if row_kernels is not None:
            row_kernels.matvec_many(self.plan, h, batch)
            return
        for b in range(batch):
            for kind, weights, outs, table in self.rows[b]:
                _run_group(kind, weights, outs, table, h[b])


def _run_group(kind, weights: list, outs: list, table, x) -> None:
    if table is None:
        for w, y in zip(weights, outs):
            matvec(w, x, y)
    elif kind[0] == FP8:
        from ds4.kernels import packed

        packed.gemv_many_fp8(table, [w.codes for w in weights], [w.scale for w in weights],
                             weights[0].block[0], x, outs)
    else:
        gemv_many(table, weights, x, outs)


def _projection_kind(w):
    """What may share one launch with w: (FP8, width, tile) for kernel-ready FP8 matrices, the
    dtype for plain ones, None (alone) for anything else."""
    if not isinstance(w, PackedMatrix):
        return ("plain", str(w.dtype))
    if w.fmt == FP8 and w.kernel_ready:
        return (FP8, w.shape[-1], w.block)
    return None
