"""Expert parallel over the GPUs of one host (`--gpus N`, docs/ARCHITECTURE.md, Expert parallel).

Rank 0 is the engine's own GPU: it holds every tensor but the routed experts, runs attention,
the router, the shared expert and the head, and holds its share of the routed experts. Ranks
1..N-1 are expert workers (ds4/model/expert_worker.py), one process per GPU, holding only
their share. At each MoE, rank 0 broadcasts the normed hidden rows with their routes (one
"wire" buffer), every rank runs the picks of its own experts (the others are skipped), and an
NCCL all-reduce sums the partial outputs. Keeping attention on rank 0 keeps every session's
state in one place, so the scheduler, snapshots and batching do not change; the decode step
stays one CUDA graph per batch size on every rank (ds4/model/gpu_group.py).

`ExpertGroup` is rank 0's side: the owner table, its communicator and the links that tell the
workers which program to run next (each collective then pairs up in the same order on every
rank). On NumPy the ranks are threads exchanging host arrays (`HostComm`), the twin the CPU
tests run; N = 1 on a GPU is a real one-rank NCCL communicator.
"""

from __future__ import annotations

import os
import threading

import numpy as np

WIRE_ALIGN = 64  # floats: each wire section starts on a 256-byte boundary (16-byte row loads)


def owner_table(layers: int, experts: int, gpus: int, table=None) -> np.ndarray:
    """Owner rank [L, E] of every routed expert: `table` (one row for all layers, or one per
    layer) when given, else expert e on GPU e mod N."""
    if table is None:
        table = np.arange(experts) % gpus
    table = np.asarray(table)
    if table.shape not in ((experts,), (layers, experts)) or table.dtype.kind not in "iu":
        raise ValueError(f"an expert owner table is {experts} integer ranks (one per expert) "
                         f"or {layers} rows of them (one per layer), got shape "
                         f"{list(table.shape)} of {table.dtype}")
    owners = np.broadcast_to(table.astype(np.int64), (layers, experts)).copy()
    if owners.min() < 0 or owners.max() >= gpus:
        raise ValueError(f"expert owners must be ranks 0..{gpus - 1}")
    if any(len(np.unique(row)) < gpus for row in owners):
        raise ValueError(f"every layer needs at least one expert on each of the {gpus} GPUs "
                         f"(it has {experts} experts)")
    return owners


def local_maps(owners: np.ndarray, rank: int) -> np.ndarray:
    """int32 [L, E]: each expert's index among its layer's experts held by `rank` (in expert
    order), -1 where another rank holds it."""
    mine = owners == rank
    return np.where(mine, np.cumsum(mine, axis=1) - 1, -1).astype(np.int32)


def owned(owners: np.ndarray, rank: int) -> list[list[int]]:
    """Per layer, the experts `rank` holds, in increasing order."""
    return [np.nonzero(row == rank)[0].tolist() for row in owners]


class NcclComm:
    """One rank's NCCL communicator; collectives run on the caller's current stream, in place,
    on float32 device arrays."""

    def __init__(self, n: int, uid, rank: int):
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off (see docs/SCALE.md)
        from cupy.cuda import nccl

        self.nccl, self.rank = nccl, rank
        self.comm = nccl.NcclCommunicator(n, uid, rank)

    def _stream(self) -> int:
        import cupy

        return cupy.cuda.get_current_stream().ptr

    def broadcast(self, buf) -> None:
        """buf = rank 0's buf, on every rank."""
        self.comm.broadcast(buf.data.ptr, buf.data.ptr, buf.size, self.nccl.NCCL_FLOAT32, 0,
                            self._stream())

    def all_reduce(self, buf) -> None:
        """buf = the sum of every rank's buf, on every rank."""
        self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self.nccl.NCCL_FLOAT32,
                            self.nccl.NCCL_SUM, self._stream())


class HostExchange:
    """What the ranks of a NumPy group share: one slot each and a barrier (a rank that fails
    makes the others' wait time out instead of hanging)."""

    def __init__(self, n: int, timeout: float = 300.0):
        self.slots: list = [None] * n
        self.barrier = threading.Barrier(n, timeout=timeout)


class HostComm:
    """NumPy twin of NcclComm for ranks that are threads of one process; all_reduce adds the
    ranks' arrays in rank order."""

    def __init__(self, exchange: HostExchange, rank: int):
        self.exchange, self.rank = exchange, rank

    def broadcast(self, buf) -> None:
        """buf = rank 0's buf, on every rank."""
        ex = self.exchange
        ex.slots[self.rank] = buf
        ex.barrier.wait()
        if self.rank:
            buf[...] = ex.slots[0]
        ex.barrier.wait()

    def all_reduce(self, buf) -> None:
        """buf = the sum of every rank's buf (in rank order), on every rank."""
        ex = self.exchange
        ex.slots[self.rank] = buf.copy()
        ex.barrier.wait()
        total = ex.slots[0].copy()
        for part in ex.slots[1:]:
            total += part
        ex.barrier.wait()
        buf[...] = total


def wire_layout(rows: int, k: int, hidden: int) -> dict[str, tuple[int, int]]:
    """(offset, length) in floats of each section of a wire for `rows` tokens: the live count
    (a graph's idle members), the picks (int32 bits), their weights, the hidden rows."""
    out, at = {}, 0
    for name, n in (("live", 1), ("idx", rows * k), ("wts", rows * k), ("h", rows * hidden)):
        out[name] = (at, n)
        at += -(-n // WIRE_ALIGN) * WIRE_ALIGN
    out["size"] = (at, 0)
    return out


def wire_views(xp, wire, rows: int, k: int, hidden: int) -> dict:
    """The sections of a float32 wire as arrays: live and idx int32, wts and h float32."""
    views = {}
    for name, (at, n) in wire_layout(rows, k, hidden).items():
        if name != "size":
            part = wire[at:at + n]
            views[name] = part.view(xp.int32) if name in ("live", "idx") else part
    views["idx"] = views["idx"].reshape(rows, k)
    views["wts"] = views["wts"].reshape(rows, k)
    views["h"] = views["h"].reshape(rows, hidden)
    return views


def rows_part(xp, cfg, bank, expert_map, wire, rows: int, to_host):
    """One rank's part of the routed MoE of a broadcast wire: the picks of its own experts
    (expert_map: its local id per global expert, -1 elsewhere, on its device), float32
    [rows, D]."""
    from ds4.model.moe import routed_local

    v = wire_views(xp, wire, rows, cfg.num_experts_per_tok, cfg.hidden_size)
    ids = expert_map[v["idx"]]
    part = routed_local(xp, cfg, bank, v["h"], ids, v["wts"], to_host)
    return xp.ascontiguousarray(part, dtype=xp.float32)


class GroupBank:
    """Layer `layer`'s routed experts held across a group: rank 0's share in `local` (an
    ExpertBank over its experts only), the rest in the workers. The MoE asks it for the
    routed sum (`routed`); the decode kernels read rank 0's stacks (`stacked`)."""

    def __init__(self, group: ExpertGroup, layer: int, local):
        self.group, self.layer, self.local = group, layer, local
        self.count = group.owners.shape[1]
        self.resident, self.packed = True, getattr(local, "packed", False)
        self.placed_stacks = ()

    @property
    def stacked(self) -> tuple:
        """Rank 0's (gate_up, down) stacks, its experts in expert order."""
        return self.local.stacked

    @property
    def nbytes(self) -> int:
        """Bytes of rank 0's share (the workers report theirs: ExpertGroup.worker_bytes)."""
        return self.local.nbytes

    def bind(self, scratch) -> None:
        """Rank 0's packed experts widen into the engine's scratch."""
        self.local.bind(scratch)

    def pick_counts(self) -> np.ndarray:
        """No re-placement counts: a group holds every expert in device memory."""
        return np.zeros(self.count, dtype=np.int64)

    def routed(self, xp, cfg, x, ids, weights, to_host):
        """sum_k weights[:, k] * expert_{ids[:, k]}(x) for x [S, D], over every rank."""
        return self.group.routed(self.layer, x, ids, weights, to_host)


class ExpertGroup:
    """Rank 0 of an expert-parallel group: owners [L, E], its communicator (made by
    `make_comm` once every worker has loaded), and one link per worker (a connection that
    takes the next program's name before its collectives run)."""

    def __init__(self, xp, cfg, owners: np.ndarray, make_comm, links: list, stop=None,
                 workers: list | None = None):
        self.xp, self.cfg, self.owners, self.links = xp, cfg, owners, links
        self.workers = workers or []  # their threads or processes (is_alive), rank order
        self.gpus = int(owners.max()) + 1
        self.maps = local_maps(owners, 0)
        self.comm = None
        self.banks: list = []
        self.worker_bytes: list[int] = []
        self._make_comm, self._stop, self._device_maps = make_comm, stop, None

    @property
    def device_maps(self):
        """Rank 0's local maps [L, E] on its device."""
        if self._device_maps is None:
            self._device_maps = self.xp.asarray(self.maps)
        return self._device_maps

    def ready(self) -> None:
        """Wait for every worker's share (their bytes into worker_bytes; a worker's failure to
        load is raised here), then connect the communicators (collective: every rank)."""
        try:
            self.worker_bytes = [int(_reply(link)) for link in self.links]
        except BaseException:
            self.close()
            raise
        self.comm = self._make_comm()

    def fault(self) -> str | None:
        """Why the group cannot step (a worker has exited), None while every worker runs."""
        for rank, worker in enumerate(self.workers, start=1):
            if not worker.is_alive():
                code = getattr(worker, "exitcode", None)
                return (f"the expert worker of GPU {rank} has exited"
                        f"{'' if code is None else f' (exit code {code})'}; restart the server")
        return None

    def tell(self, *program) -> None:
        """Tell every worker which program runs next (rank 0 then runs its own side); a
        worker that has exited is an error here, before rank 0 would wait for it in NCCL."""
        if (why := self.fault()) is not None:
            raise RuntimeError(why)
        for link in self.links:
            link.send(program)

    def routed(self, layer: int, x, ids, weights, to_host):
        """The routed MoE of rows x [S, D] with global picks ids/weights [S, k] (on rank 0):
        broadcast, every rank's part, all-reduce."""
        xp, cfg = self.xp, self.cfg
        S, k = ids.shape
        self.tell("rows", layer, S)
        layout = wire_layout(S, k, cfg.hidden_size)
        wire = xp.zeros(layout["size"][0], dtype=xp.float32)
        v = wire_views(xp, wire, S, k, cfg.hidden_size)
        v["idx"][...] = ids
        v["wts"][...] = weights
        v["h"][...] = x
        self.comm.broadcast(wire)
        part = rows_part(xp, cfg, self.banks[layer].local, self.device_maps[layer], wire, S,
                         to_host)
        self.comm.all_reduce(part)
        return part

    def join(self, weights) -> None:
        """Rank 0's weights (its own share of the experts loaded) join the group: the
        workers' shares are awaited, the communicators connected, and the layer banks become
        GroupBanks."""
        self.ready()
        weights.experts = self.banks = [GroupBank(self, i, bank)
                                        for i, bank in enumerate(weights.experts)]

    def close(self) -> None:
        """Stop the workers (each frees its GPU)."""
        for link in self.links:
            try:
                link.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        if self._stop is not None:
            self._stop()
        self.links = []


def _reply(link):
    """A worker's answer: its value, or its error raised here."""
    kind, value = link.recv()
    if kind == "error":
        raise RuntimeError(f"expert worker failed: {value}")
    return value
