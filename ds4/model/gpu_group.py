"""One rank's MoE inside the decode graph under expert parallel (ds4/model/expert_group.py).

Per layer: rank 0's router has written the picks and their weights into the wire beside the
normed hidden rows (rank 0's decode buffers are views of it); the wire is broadcast, each rank
maps the global picks to its own experts (`moe_localize`: -1 for another rank's), runs them
through ds4/kernels/rows_moe.py (rank 0 adds the shared expert), and an all-reduce sums the
ranks' outputs in place. Rank 0 runs `layer` inside its KernelDecoder; a worker runs `step`,
all layers at once, eagerly or as its own CUDA graph captured alongside rank 0's."""

from __future__ import annotations

from ds4.kernels import moe, rows_moe
from ds4.model.expert_group import wire_layout, wire_views


class DecoderShard:
    """The wire, the local picks, the output rows and the MoE scratch of one rank, for up to
    `members` tokens a step; stacks[i]: layer i's (gate_up, down) of this rank's experts."""

    def __init__(self, xp, cfg, comm, maps, stacks: list, members: int, scratch, y=None):
        k, D = cfg.num_experts_per_tok, cfg.hidden_size
        self.xp, self.cfg, self.comm, self.maps, self.stacks = xp, cfg, comm, maps, stacks
        self.layout = wire_layout(members, k, D)
        self.wire = xp.zeros(self.layout["size"][0], dtype=xp.float32)
        self.views = wire_views(xp, self.wire, members, k, D)
        self.local = xp.zeros((members, k), dtype=xp.int32)
        self.y = xp.zeros((members, D), dtype=xp.float32) if y is None else y
        self.scratch = scratch
        self.graphs: dict = {}
        self._stream = None

    @classmethod
    def for_rank0(cls, decoder, group, members: int) -> DecoderShard:
        """Rank 0's shard inside a KernelDecoder: the router's picks and the normed hidden
        rows then live in its wire (the decoder's idx, wts and h buffers become its views),
        and the MoE's sum lands in the decoder's y."""
        if not all(decoder.row_moe):
            raise ValueError("expert parallel decode needs every layer's experts in a format "
                             "ds4/kernels/rows_moe.py reads")
        stacks = [(t["experts.gate_up"], t["experts.down"]) for t in decoder.layers]
        shard = cls(decoder.cp, decoder.cfg, group.comm, group.device_maps, stacks, members,
                    decoder.moe_scratch, y=decoder.buf["y"])
        for name in ("idx", "wts", "h"):
            decoder.buf[name] = shard.views[name]
        return shard

    @classmethod
    def for_worker(cls, worker) -> DecoderShard:
        """A worker's shard over its banks (no shared expert: rank 0 adds it)."""
        from ds4.model.gpu_decode import MAX_MEMBERS
        from ds4.model.gpu_weights import kernel_weight

        xp, cfg = worker.xp, worker.cfg
        stacks = [tuple(kernel_weight(xp, w) for w in b.stacked) for b in worker.banks]
        scratch = rows_moe.moe_scratch(xp, MAX_MEMBERS, cfg.num_experts_per_tok,
                                       cfg.moe_intermediate_size, cfg.hidden_size)
        return cls(xp, cfg, worker.comm, worker.maps, stacks, MAX_MEMBERS, scratch)

    def sent(self, batch: int) -> int:
        """Floats of the wire a step of `batch` tokens broadcasts (through its hidden rows)."""
        return self.layout["h"][0] + batch * self.cfg.hidden_size

    def layer(self, i: int, batch: int, shared=None) -> None:
        """y[:batch] = layer i's routed experts (every rank's) + `shared` (rank 0's shared
        expert, None elsewhere) of the wire's hidden rows."""
        cfg, v = self.cfg, self.views
        self.comm.broadcast(self.wire[:self.sent(batch)])
        moe.moe_localize(self.maps[i], v["idx"][:batch], self.local[:batch])
        gate_up, down = self.stacks[i]
        rows_moe.moe(gate_up, down, self.local, v["wts"], v["h"], self.scratch, self.y, batch,
                     cfg.moe_intermediate_size, cfg.swiglu_limit, shared=shared,
                     live=v["live"])
        self.comm.all_reduce(self.y[:batch])

    def run(self, batch: int) -> None:
        """Every layer's MoE of one step (a worker's side of rank 0's decode graph)."""
        for i in range(len(self.stacks)):
            self.layer(i, batch)

    def step(self, key, batch: int, mode: str) -> None:
        """One step as rank 0 runs it: "eager", "capture" (a new graph for key, then its
        replay) or "replay"."""
        if mode == "eager" or self.xp.__name__ == "numpy":
            self.run(batch)
            return
        cuda = self.xp.cuda
        if self._stream is None:
            self._stream = cuda.Stream(non_blocking=True)
        stream = self._stream
        # after the `rows` programs before it and before the ones after it, as on rank 0
        # (its collectives must keep rank 0's order)
        stream.wait_event(cuda.get_current_stream().record())
        with stream:
            if mode == "capture":
                stream.begin_capture()
                self.run(batch)
                self.graphs[key] = stream.end_capture()
            self.graphs[key].launch(stream)
        cuda.get_current_stream().wait_event(stream.record())
