"""Expert workers: ranks 1..N-1 of an expert-parallel group (ds4/model/expert_group.py).

`start_group` opens the group for an engine: on CuPy one spawned process per extra GPU (one
GPU per process, as NCCL recommends for CUDA-graph-captured collectives), on NumPy one thread
per rank (the CPU twin). A worker loads only its share of the routed experts, from the same
model directory (or the same dummy seed) as rank 0, then follows rank 0's programs: `rows`
(one layer's MoE of a prefill chunk or an eager step) and `step` (every layer's MoE of a
decode graph step: eager, captured, or replayed). Each program runs the same collectives in
the same order as rank 0's side, so they pair up.
"""

from __future__ import annotations

import multiprocessing
import threading
import traceback
from dataclasses import dataclass
from functools import partial

import numpy as np

from ds4.model.expert_group import (
    ExpertGroup,
    HostComm,
    HostExchange,
    NcclComm,
    local_maps,
    owned,
    owner_table,
    rows_part,
    wire_layout,
)


@dataclass(frozen=True)
class ShardSource:
    """Where a worker finds its experts: rank 0's model directory, load format and seed."""

    model_dir: str
    load_format: str
    seed: int


def open_group(xp, cfg, model_dir, load_format: str, seed: int, gpus: int,
               table=None) -> ExpertGroup:
    """An expert-parallel group of `gpus` ranks over the model at model_dir (rank 0 is this
    process's current GPU, or the host on NumPy), its workers started."""
    if int(gpus) < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    owners = owner_table(cfg.num_hidden_layers, cfg.n_routed_experts, int(gpus), table)
    return start_group(xp, cfg, ShardSource(str(model_dir), load_format, seed), owners)


def start_group(xp, cfg, source: ShardSource, owners: np.ndarray) -> ExpertGroup:
    """Rank 0's ExpertGroup with its workers started (they load while rank 0 does; call
    `ready()` once rank 0's own weights are loaded)."""
    gpus = int(owners.max()) + 1
    if xp is np:
        return _thread_group(xp, cfg, source, owners, gpus)
    return _process_group(xp, cfg, source, owners, gpus)


def _thread_group(xp, cfg, source: ShardSource, owners: np.ndarray, gpus: int) -> ExpertGroup:
    exchange = HostExchange(gpus)
    links, threads = [], []
    for rank in range(1, gpus):
        mine, theirs = multiprocessing.Pipe()
        t = threading.Thread(target=_serve, daemon=True, name=f"ds4-expert-rank{rank}",
                             args=(np, source, owners, rank, lambda r=rank: HostComm(exchange, r),
                                   theirs))
        t.start()
        links.append(mine)
        threads.append(t)

    def stop():
        for t in threads:
            t.join(timeout=30)

    return ExpertGroup(xp, cfg, owners, lambda: HostComm(exchange, 0), links, stop, threads)


def _process_group(xp, cfg, source: ShardSource, owners: np.ndarray, gpus: int) -> ExpertGroup:
    from cupy.cuda import nccl

    have = xp.cuda.runtime.getDeviceCount()
    if gpus > have:
        raise ValueError(f"--gpus {gpus} needs {gpus} CUDA devices; this machine has {have}")
    uid = nccl.get_unique_id()
    links, procs = [], []
    for rank in range(1, gpus):
        link, p = spawn_worker(source, owners, rank, partial(NcclComm, gpus, uid, rank))
        links.append(link)
        procs.append(p)

    def stop():
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()

    return ExpertGroup(xp, cfg, owners, lambda: NcclComm(gpus, uid, 0), links, stop, procs)


def spawn_worker(source: ShardSource, owners, rank: int, connect, backend: str = "cupy"):
    """(rank 0's end of the link, the process) of a worker process for `rank` that loads its
    share, reports, then calls `connect()` for its communicator (picklable: NcclComm's
    arguments in a partial)."""
    ctx = multiprocessing.get_context("spawn")  # CUDA state must not be forked
    mine, theirs = ctx.Pipe()
    p = ctx.Process(target=_process_main, args=(source, owners, rank, connect, theirs, backend),
                    daemon=True, name=f"ds4-expert-rank{rank}")
    p.start()
    return mine, p


def _process_main(source: ShardSource, owners, rank: int, connect, link, backend: str) -> None:
    """A worker process: on CuPy its GPU is device `rank` (NumPy: the tests' host twin)."""
    if backend == "numpy":
        _serve(np, source, owners, rank, connect, link)
        return
    import cupy

    cupy.cuda.Device(rank).use()
    _serve(cupy, source, owners, rank, connect, link)


def _serve(xp, source: ShardSource, owners, rank: int, make_comm, link) -> None:
    """Load the share, report its bytes (or the error), connect, then follow rank 0."""
    try:
        worker = Worker.load(xp, source, owners, rank)
        link.send(("ready", worker.nbytes))
    except BaseException as e:  # rank 0 raises it from ExpertGroup.ready
        link.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    worker.comm = make_comm()
    worker.serve(link)


class Worker:
    """One worker rank: its experts per layer, their local maps, its communicator."""

    def __init__(self, xp, cfg, banks: list, maps: np.ndarray):
        self.xp, self.cfg, self.banks = xp, cfg, banks
        self.maps = xp.asarray(maps)  # on its device once (every program reads a row)
        self.comm = None
        self._decoder = None

    @classmethod
    def load(cls, xp, source: ShardSource, owners: np.ndarray, rank: int) -> Worker:
        """Rank `rank`'s share of the model at `source`."""
        from ds4.model.config import ModelConfig
        from ds4.model.dummy import dummy_experts, model_path
        from ds4.model.scratch import Scratch
        from ds4.model.weights import checkpoint_experts

        model_dir = model_path(source.model_dir)
        cfg = ModelConfig.from_dir(model_dir)
        experts = owned(owners, rank)
        banks = (dummy_experts(cfg, xp, source.seed, experts) if source.load_format == "dummy"
                 else checkpoint_experts(model_dir, cfg, xp, experts))
        scratch = Scratch(xp)
        for bank in banks:
            bank.bind(scratch)
        return cls(xp, cfg, banks, local_maps(owners, rank))

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's experts."""
        return sum(b.nbytes for b in self.banks)

    def serve(self, link) -> None:
        """Run rank 0's programs until it says stop."""
        while True:
            try:
                program = link.recv()
            except (EOFError, OSError):  # rank 0 is gone (its engine was dropped unclosed)
                return
            if program[0] == "stop":
                return
            getattr(self, "_" + program[0])(*program[1:])

    def _rows(self, layer: int, rows: int) -> None:
        """One layer's MoE of `rows` tokens: the wire, this rank's part, the sum."""
        xp, cfg = self.xp, self.cfg
        wire = xp.empty(wire_layout(rows, cfg.num_experts_per_tok, cfg.hidden_size)["size"][0],
                        dtype=xp.float32)
        self.comm.broadcast(wire)
        part = rows_part(xp, cfg, self.banks[layer], self.maps[layer], wire, rows,
                         lambda a: a.get() if hasattr(a, "get") else np.asarray(a))
        self.comm.all_reduce(part)

    def _step(self, key, batch: int, mode: str) -> None:
        """Every layer's MoE of one decode graph step (see gpu_group.DecoderShard.step)."""
        if self._decoder is None:
            from ds4.model.gpu_group import DecoderShard

            self._decoder = DecoderShard.for_worker(self)
        self._decoder.step(key, batch, mode)
