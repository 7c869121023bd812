"""Where each routed expert lives: GPU memory, or pinned device-mapped host memory.

A packed V4-Flash holds ~137 GiB of routed experts, more than one H200 keeps beside the rest
of the model. `choose_resident` (a pure function) picks the experts that stay in device memory
under a byte budget, hottest first by their routing counts; the others live in pinned host
memory mapped into the device's address space, where the same expert kernels read them in
place over PCIe. A `PlacedStack` holds one layer's stack of one matrix kind split over the two
memories, with a per-expert address table the kernels follow; `ExpertPlacement.replace()`
swaps experts between the memories when the counts drift (the tables are rewritten in place,
so captured decode graphs stay valid). On NumPy both memories are host RAM, so the same code
and its bookkeeping run in CI.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ds4.model.packed import PackedMatrix

GIB = 1 << 30


def choose_resident(budget: int, expert_bytes, counts) -> np.ndarray:
    """Resident mask [L, E]: the most-picked experts whose bytes fit `budget`.

    expert_bytes is one expert's bytes (an int, or one per layer); counts [L, E] are routing
    picks. Ties go to the lower expert id, then the lower layer, so with equal counts every
    layer keeps about the same number of experts.
    """
    counts = np.asarray(counts)
    L, E = counts.shape
    sizes = np.broadcast_to(np.asarray(expert_bytes, dtype=np.int64), (L,))
    layer, expert = np.meshgrid(np.arange(L), np.arange(E), indexing="ij")
    order = np.lexsort((layer.ravel(), expert.ravel(), -counts.ravel()))
    cost = np.cumsum(sizes[layer.ravel()[order]])
    mask = np.zeros(L * E, dtype=bool)
    mask[order[cost <= budget]] = True
    return mask.reshape(L, E)


def choose_within_layers(quota, counts) -> np.ndarray:
    """Resident mask [L, E] keeping each layer's number of resident experts (`quota[l]`), the
    most-picked ones (lower id on ties): the re-placement rule, which moves no memory between
    layers."""
    counts = np.asarray(counts)
    mask = np.zeros(counts.shape, dtype=bool)
    for l, row in enumerate(counts):
        order = np.lexsort((np.arange(row.size), -row))
        mask[l, order[: int(quota[l])]] = True
    return mask


class HostMemory:
    """Pinned host memory mapped into the device's address space (CuPy), or plain RAM (NumPy).

    The device-side view is an ordinary CuPy array whose pointer is the mapped one, so
    kernels, copies and CUDA graphs treat it like device memory.
    """

    def __init__(self, xp, nbytes: int):
        self.xp, self.nbytes = xp, int(nbytes)
        if xp is np:
            self.array = np.empty(self.nbytes, dtype=np.uint8)
            return
        runtime = xp.cuda.runtime
        self._host = runtime.hostAlloc(max(self.nbytes, 1), 0x01 | 0x02)  # portable | mapped
        memory = xp.cuda.UnownedMemory(_device_pointer(runtime, self._host),
                                       max(self.nbytes, 1), self, xp.cuda.Device().id)
        self.array = xp.ndarray((self.nbytes,), xp.uint8, xp.cuda.MemoryPointer(memory, 0))

    def view(self, offset: int, shape: tuple, dtype=np.uint8):
        """An array over bytes [offset, offset + its size) of this memory."""
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.array[offset : offset + n].view(dtype).reshape(shape)

    def __del__(self):
        host = getattr(self, "_host", None)
        if host is not None:
            self.xp.cuda.runtime.freeHost(host)


EMBEDDING = "model.embed_tokens.weight"


def place_experts(xp, tensors: dict, budget: int, dense: int, expert_bytes: int,
                  shape: tuple[int, int]) -> tuple[np.ndarray, int]:
    """(resident mask [L, E], bytes of tensors moved to host memory) of packed experts under
    `budget` after `dense` bytes of other tensors: the embedding leaves the device first where
    the experts overflow (embedding_to_host), then the experts that fit stay (both loaders)."""
    L, E = shape
    moved = embedding_to_host(xp, tensors, budget - dense - L * E * expert_bytes)
    return choose_resident(budget - dense + moved, expert_bytes, np.zeros((L, E))), moved


def embedding_to_host(xp, tensors: dict, room: int) -> int:
    """Moves the token embedding into mapped host memory when the weights overflow the device
    (room < 0: the budget less the dense tensors and every expert); its bytes moved (0: none).

    A step reads one embedding row a token (8 KB for V4-Flash; a 2048-token prefill chunk 16
    MB), while every GiB of device memory holds ~80 more experts, each of which a step would
    otherwise read over PCIe with probability k / E a layer: ~0.5 ms a token on one H200
    (docs/PERF.md). A head tied to the embedding stays: the head reads all of it."""
    embed = tensors.get(EMBEDDING)
    if (room >= 0 or embed is None or tensors.get("lm_head.weight") is embed
            or getattr(embed, "dtype", None) != np.uint16):  # (fp32 rows would be widened back)
        return 0
    if xp is np:  # the budget's arithmetic as on the GPU; host memory is where it already is
        return int(embed.nbytes)
    host = HostMemory(xp, int(embed.nbytes)).view(0, embed.shape, embed.dtype)
    host[...] = embed
    tensors[EMBEDDING] = host
    return int(embed.nbytes)


def _aligned(n: int) -> int:
    return -(-n // 256) * 256


def _device_pointer(runtime, host_ptr: int) -> int:
    """The device address of mapped host memory (the host address itself under unified
    addressing, which every 64-bit CUDA device has)."""
    try:
        return int(runtime.pointerGetAttributes(host_ptr).devicePointer) or host_ptr
    except (AttributeError, RuntimeError):  # an older CuPy: unified addressing makes them equal
        return host_ptr


class PlacedStack:
    """E packed matrices of one shape (a layer's gate_up or down experts), each expert in
    device slots or mapped host slots; `self[e]` is expert e's PackedMatrix wherever it is."""

    placed = True

    def __init__(self, xp, fmt: str, cols: int, block, device: tuple, host: tuple, resident):
        self.xp, self.fmt, self.block = xp, fmt, tuple(block)
        self.device, self.host = device, host  # (codes [n, ...], scale [n, ...]) each
        self.resident = np.array(resident, dtype=bool)
        self.slot = np.zeros(self.resident.size, dtype=np.int64)
        self.slot[self.resident] = np.arange(int(self.resident.sum()))
        self.slot[~self.resident] = np.arange(int((~self.resident).sum()))
        self.shape = (self.resident.size, *device[0].shape[1:-1], cols)
        self.scratch = None
        self.code_ptrs = self.scale_ptrs = self.on_host = None
        if xp is not np:
            self.code_ptrs = xp.zeros(self.resident.size, dtype=xp.int64)
            self.scale_ptrs = xp.zeros(self.resident.size, dtype=xp.int64)
            self.on_host = xp.zeros(self.resident.size, dtype=xp.int32)  # kernels: host first
            self._write_tables(range(self.resident.size))

    @classmethod
    def allocate(cls, xp, fmt: str, shape: tuple, scale_shape: tuple, cols: int, block,
                 resident, host_memory: HostMemory | None, host_offset: int = 0) -> PlacedStack:
        """Empty stacks for experts codes [E, *shape] and scales [E, *scale_shape]: resident ones
        in device memory, the rest in host_memory from host_offset on."""
        resident = np.asarray(resident, dtype=bool)
        n_dev, n_host = int(resident.sum()), int((~resident).sum())
        device = (xp.empty((n_dev, *shape), xp.uint8), xp.empty((n_dev, *scale_shape), xp.uint8))
        code_bytes = _aligned(n_host * int(np.prod(shape)))
        if n_host:
            host = (host_memory.view(host_offset, (n_host, *shape)),
                    host_memory.view(host_offset + code_bytes, (n_host, *scale_shape)))
        else:
            host = (xp.empty((0, *shape), xp.uint8), xp.empty((0, *scale_shape), xp.uint8))
        return cls(xp, fmt, cols, block, device, host, resident)

    @classmethod
    def copy_of(cls, xp, w, resident) -> PlacedStack:
        """The experts of packed stack w (codes [E, ...]) placed: resident ones in device
        memory, the others in (on CuPy mapped) host memory of their own (tests, benchmarks)."""
        resident = np.asarray(resident, dtype=bool)
        shape, scale_shape = w.codes.shape[1:], w.scale.shape[1:]
        host = HostMemory(xp, cls.host_bytes_of(shape, scale_shape, int((~resident).sum())))
        stack = cls.allocate(xp, w.fmt, shape, scale_shape, w.shape[-1], w.block, resident, host)
        for e in range(resident.size):
            stack.fill(e, w.codes[e], w.scale[e])
        return stack

    @staticmethod
    def host_bytes_of(shape: tuple, scale_shape: tuple, n_host: int) -> int:
        """Host bytes allocate() takes for n_host experts of these shapes (each region starts
        on a 256-byte boundary: the kernels read codes in 16-byte loads)."""
        return _aligned(n_host * int(np.prod(shape))) + _aligned(n_host * int(np.prod(scale_shape)))

    @property
    def ndim(self) -> int:
        """Number of logical axes (3: experts, rows, cols)."""
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes in device memory (on NumPy: the 'resident' share of RAM)."""
        return int(self.device[0].nbytes + self.device[1].nbytes)

    @property
    def host_nbytes(self) -> int:
        """Bytes in mapped host memory."""
        return int(self.host[0].nbytes + self.host[1].nbytes)

    @property
    def kernel_ready(self) -> bool:
        """True when the packed kernels can read its experts (as for a PackedMatrix)."""
        return self[0].kernel_ready

    def memory_of(self, e: int) -> tuple:
        """(codes, scale) arrays of expert e where it lives."""
        codes, scale = self.device if self.resident[e] else self.host
        s = int(self.slot[e])
        return codes[s], scale[s]

    def fill(self, e: int, codes, scale) -> None:
        """Write expert e's codes and scales into its memory."""
        dst_codes, dst_scale = self.memory_of(e)
        dst_codes[...] = codes
        dst_scale[...] = scale

    def __getitem__(self, index) -> PackedMatrix:
        """Expert `index` (an int) as a view, or experts `index` (ids) stacked as a copy."""
        if isinstance(index, (int, np.integer)):
            out = PackedMatrix(self.fmt, *self.memory_of(int(index)), self.shape[-1], self.block)
        else:
            ids = np.asarray(index.get() if hasattr(index, "get") else index).reshape(-1)
            parts = [self.memory_of(int(e)) for e in ids.tolist()]
            xp = self.xp
            out = PackedMatrix(self.fmt, xp.stack([c for c, _ in parts]),
                               xp.stack([s for _, s in parts]), self.shape[-1], self.block)
        out.scratch = self.scratch
        return out

    def swap(self, going: int, coming: int) -> None:
        """Expert `going` (resident) leaves for `coming`'s host slot; `coming` takes its
        device slot. Bytes move through one temporary copy; the address table follows."""
        xp = self.xp
        d_codes, d_scale = self.memory_of(going)
        h_codes, h_scale = self.memory_of(coming)
        tmp = (d_codes.copy(), d_scale.copy())
        d_codes[...], d_scale[...] = h_codes, h_scale
        h_codes[...], h_scale[...] = tmp
        self.slot[going], self.slot[coming] = self.slot[coming], self.slot[going]
        self.resident[going], self.resident[coming] = False, True
        if xp is not np:
            self._write_tables([going, coming])

    def _write_tables(self, experts) -> None:
        """Device addresses of the given experts' codes and scales, and whether each lives in
        host memory (the kernels' tables)."""
        experts = list(experts)
        codes = [self.memory_of(e)[0].data.ptr for e in experts]
        scales = [self.memory_of(e)[1].data.ptr for e in experts]
        ids = self.xp.asarray(np.array(experts, dtype=np.int64))
        self.code_ptrs[ids] = self.xp.asarray(np.array(codes, dtype=np.int64))
        self.scale_ptrs[ids] = self.xp.asarray(np.array(scales, dtype=np.int64))
        self.on_host[ids] = self.xp.asarray((~self.resident[experts]).astype(np.int32))


@dataclass
class Split:
    """What a placement put where."""

    device_bytes: int
    host_bytes: int
    host_experts: list[int]  # per layer

    def describe(self) -> str:
        """One line for start-up: GiB per memory and host experts per layer."""
        per_layer = ",".join(str(n) for n in self.host_experts)
        return (f"routed experts: {_size(self.device_bytes)} on the GPU, "
                f"{_size(self.host_bytes)} in mapped host memory; host experts per "
                f"layer: {per_layer}")


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.2f} MiB"


@dataclass
class ReplacementRule:
    """When a re-placement moves experts: the cut of expected host reads it must reach, how
    much hotter (relative, and in standard deviations of count noise) a host expert must be
    than the resident one it displaces, and the most swaps one re-placement makes (each
    copies an expert both ways over PCIe, ~1 ms at full size, while the step waits)."""

    min_cut: float = 0.0
    margin: float = 0.0
    evidence: float = 0.0
    max_swaps: int | None = None


class ExpertPlacement:
    """The placed expert banks of a model, their routing counts, and re-placement.

    Decode steps count picks per expert into the banks' device counters; `observe()` folds
    them into `heat`, a decayed count (the scheduler decays it by the tokens since its last
    look, so the placement follows the workload), and zeroes the counters in place.
    """

    def __init__(self, banks: list, budget: int):
        self.banks, self.budget = banks, budget
        self.heat = np.zeros((len(banks), banks[0].count if banks else 0))
        self.replacements = 0  # re-placements done
        self.moved = 0  # experts that changed memory, over all of them

    def pending(self) -> np.ndarray:
        """Picks [L, E] counted by the banks since the last observe()."""
        return np.stack([np.asarray(b.pick_counts()) for b in self.banks])

    def counts(self) -> np.ndarray:
        """Routing picks [L, E]: the decayed heat plus the picks not yet folded in."""
        return self.heat + self.pending()

    def observe(self, decay: float = 1.0) -> None:
        """heat = heat * decay + the new picks; the banks' counters restart at zero (written
        in place: captured decode graphs hold their addresses)."""
        self.heat = self.heat * decay + self.pending()
        for bank in self.banks:
            if bank.placed_stacks:
                bank.counts.fill(0)

    def resident(self) -> np.ndarray:
        """Resident mask [L, E] now."""
        return np.stack([b.placed_stacks[0].resident if b.placed_stacks
                         else np.ones(b.count, dtype=bool) for b in self.banks])

    def host_read_share(self) -> float:
        """Share of the counted picks that read a host expert (0 before any pick)."""
        heat, total = self.counts(), self.counts().sum()
        return float(heat[~self.resident()].sum() / total) if total else 0.0

    def split(self) -> Split:
        """Bytes per memory and host experts per layer."""
        dev = sum(s.nbytes for b in self.banks for s in b.placed_stacks)
        host = sum(s.host_nbytes for b in self.banks for s in b.placed_stacks)
        return Split(dev, host, [int((~m).sum()) for m in self.resident()])

    def plan(self, rule: ReplacementRule) -> list[list[tuple[int, int]]]:
        """Per layer, (going, coming) swaps: the hottest host experts take the device slots of
        the coldest resident ones while hotter by more than `rule.margin` of the resident one's
        heat plus `rule.evidence` standard deviations of count noise (picks are Poisson-like:
        the spread of uniform routing must not look like hot experts; equal heat never
        moves)."""
        heat, resident = self.counts(), self.resident()
        return [_layer_swaps(h, m, rule.margin, rule.evidence) for h, m in zip(heat, resident)]

    def cut(self, plan: list) -> float:
        """Share of the expected host reads a plan removes."""
        heat, resident = self.counts(), self.resident()
        host = heat[~resident].sum()
        gain = sum(heat[l, c] - heat[l, g] for l, swaps in enumerate(plan) for g, c in swaps)
        return float(gain / host) if host else 0.0

    def replace(self, rule: ReplacementRule | None = None, decay: float = 1.0) -> int:
        """Fold in the new picks (decaying the old by `decay`); when moving the hottest experts
        of each layer onto the device (each layer keeps its number of device slots) would cut
        the expected host reads by more than `rule.min_cut`, move them, at most
        `rule.max_swaps` of the largest gains (the rest wait for the next look). Returns how
        many experts changed memory. Call between steps."""
        rule = rule or ReplacementRule()
        self.observe(decay)
        plan = self.plan(rule)
        if not any(plan) or self.cut(plan) <= rule.min_cut:
            return 0
        plan = self._largest(plan, rule.max_swaps)
        for bank, swaps in zip(self.banks, plan):
            for going, coming in swaps:
                for stack in bank.placed_stacks:
                    stack.swap(going, coming)
        moved = 2 * sum(len(swaps) for swaps in plan)
        self.replacements += 1
        self.moved += moved
        return moved

    def _largest(self, plan: list, limit: int | None) -> list[list[tuple[int, int]]]:
        """The plan cut to its `limit` largest-gain swaps (per layer a prefix: gains fall
        along a layer's swaps)."""
        if limit is None or sum(len(s) for s in plan) <= limit:
            return plan
        heat = self.counts()
        ranked = sorted(((heat[l, c] - heat[l, g], l, j) for l, swaps in enumerate(plan)
                         for j, (g, c) in enumerate(swaps)), key=lambda t: -t[0])
        keep = {(l, j) for _, l, j in ranked[:limit]}
        return [[sw for j, sw in enumerate(swaps) if (l, j) in keep]
                for l, swaps in enumerate(plan)]

    @contextmanager
    def host_reads_off(self):
        """For benchmarks: while open, each host expert's table entries point at a resident
        expert's memory (other values, device-only reads), so a replayed decode graph costs
        what it would with everything resident; the tables are restored on exit. Yields False
        on NumPy (no tables)."""
        stacks = [s for b in self.banks for s in b.placed_stacks if s.code_ptrs is not None]
        saved = [(s.code_ptrs.copy(), s.scale_ptrs.copy()) for s in stacks]
        try:
            for stack in stacks:
                _alias_host_to_resident(stack)
            yield bool(stacks)
        finally:
            for stack, (codes, scales) in zip(stacks, saved):
                stack.code_ptrs[...], stack.scale_ptrs[...] = codes, scales

    def stats(self) -> dict:
        """Re-placements done, experts moved, and the host-read share of the counted picks."""
        return {"replacements": self.replacements, "moved": self.moved,
                "host_read_share": self.host_read_share()}


def _alias_host_to_resident(stack: PlacedStack) -> None:
    """Point host experts' table entries at distinct resident experts (round robin)."""
    host, dev = np.nonzero(~stack.resident)[0], np.nonzero(stack.resident)[0]
    if host.size == 0 or dev.size == 0:
        return
    xp = stack.xp
    take = xp.asarray(dev[np.arange(host.size) % dev.size])
    ids = xp.asarray(host)
    stack.code_ptrs[ids] = stack.code_ptrs[take]
    stack.scale_ptrs[ids] = stack.scale_ptrs[take]


def _layer_swaps(heat: np.ndarray, resident: np.ndarray, margin: float,
                 evidence: float) -> list[tuple[int, int]]:
    """(going, coming) pairs of one layer: hottest host expert against coldest resident one
    (lower id first on ties), while the host one is hotter by more than the margin and the
    noise allowance."""
    ids = np.arange(heat.size)
    host = ids[~resident][np.lexsort((ids[~resident], -heat[~resident]))]
    dev = ids[resident][np.lexsort((-ids[resident], heat[resident]))]
    swaps = []
    for coming, going in zip(host.tolist(), dev.tolist()):
        noise = evidence * np.sqrt(heat[coming] + heat[going])
        if heat[coming] <= heat[going] * (1 + margin) + noise:
            break
        swaps.append((going, coming))
    return swaps
