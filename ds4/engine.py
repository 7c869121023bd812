"""Engine: config, weights, scratch, tokenizer, and the batched decode step over its sessions
(one context each: ds4/session.py, re-exported here)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

# Re-exported so layers above the engine never import ds4.backend or ds4.model themselves.
from ds4.backend import cuda_available as cuda_available
from ds4.backend import describe as describe
from ds4.backend import get_backend
from ds4.builtin_model import default_model_dir as default_model_dir
from ds4.builtin_model import make_tiny as make_tiny
from ds4.model.budget import weight_budget
from ds4.model.config import ModelConfig
from ds4.model.dummy import CONFIG_DIR, LOAD_FORMATS, dummy_weights, model_path
from ds4.model.expert_group import owned
from ds4.model.expert_worker import open_group
from ds4.model.forward import Model
from ds4.model.mtp import MtpBlock, dummy_mtp, load_mtp, mtp_bytes
from ds4.model.placement import ReplacementRule
from ds4.model.state import state_bytes
from ds4.model.weights import load_weights, weight_block
from ds4.session import ContextOverflow as ContextOverflow
from ds4.session import Session, host_logits
from ds4.session import Speculated as Speculated

MAX_BATCH = 8  # sessions per batched decode step; larger batches run as several steps
log = logging.getLogger(__name__)


def compile_kernels(be):
    """On the GPU, start compiling every kernel family in the background (ds4.kernels.
    compile_ahead; DS4_COMPILE_AHEAD=0: each family compiles at its first launch instead);
    returns the join that lists the families that failed."""
    if not be.is_gpu or os.environ.get("DS4_COMPILE_AHEAD", "1") == "0":
        return list
    from ds4.kernels import compile_ahead

    return compile_ahead()


class StepLogits(Sequence):
    """What Engine.decode_batch returns: each session's logits after that step, copied to the
    host only when read."""

    def __init__(self, sessions: list[Session]):
        self._rows = [(s, s._host_logits, s._device_logits) for s in sessions]

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        session, host, device = self._rows[i]
        if host is None and device is not None:
            if session._device_logits is device:  # the session's own copy, made once
                return session.logits
            host = host_logits(session.engine.backend, device)
        return host


def _argmax_rows(xp, rows: list) -> list[int]:
    """Each device row's argmax (lowest id on ties, as greedy sampling), in one launch."""
    from ds4.kernels import sampling as kernels

    out = xp.zeros(len(rows), dtype=xp.int32)
    kernels.argmax(_as_block(xp, rows), out)
    return [int(v) for v in out.get()]


def _as_block(xp, rows: list):
    """rows as one [B, V] array: a view where they lie one after another in memory (the rows
    of one step's logits), else a stacked copy."""
    first = rows[0]
    if all(r.flags.c_contiguous and r.shape == first.shape and r.dtype == first.dtype
           and r.data.ptr == first.data.ptr + i * first.nbytes for i, r in enumerate(rows)):
        return xp.ndarray((len(rows), first.size), first.dtype, memptr=first.data)
    return xp.stack(rows)


class Engine:
    """A loaded model; sessions share its weights and scratch buffers (one thread drives it)."""

    def __init__(self, model_dir: Path, cfg: ModelConfig, model: Model, prefill_chunk: int):
        self.model_dir = model_dir
        self.config = cfg
        self.model = model
        self.backend = model.backend
        self.prefill_chunk = prefill_chunk
        self.mtp: MtpBlock | None = None  # the draft block, when opened with mtp=True
        self._tokenizer = None

    @classmethod
    def open(cls, model_dir: str | Path, backend: str = "auto", prefill_chunk: int = 512,
             resident_experts: bool = True, quantize: bool | None = None,
             load_format: str = "auto", seed: int = 0, gpu_memory_gib: float | None = None,
             parallel: int = 1, ctx: int = 4096, mtp: bool = False,
             gpus: int | None = None, expert_owners=None) -> Engine:
        """Load a model directory (or a shipped config's name with load_format="dummy": random
        weights from config.json alone, drawn by `seed`); quantize=None simulates FP8/FP4 only
        for quantised checkpoints. gpu_memory_gib caps the weights' device memory (default on
        the GPU: free memory less `parallel` sessions of `ctx` tokens and the scratch); experts
        beyond it live in mapped host memory. mtp=True also loads the checkpoint's MTP block
        (`mtp.0.*`) for drafting (ds4.mtp). gpus=N splits the routed experts over N GPUs
        (expert parallel, ds4/model/expert_group.py; expert_owners: a rank per expert, default
        e mod N; gpus=1 runs that path on one GPU); None keeps them on one."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
        model_dir = model_path(model_dir)
        cfg = ModelConfig.from_dir(model_dir)
        be = get_backend(backend)
        compiled = compile_kernels(be)  # (while the weights load)
        budget = weight_budget(be, cfg, gpu_memory_gib, parallel, ctx, prefill_chunk)
        if mtp and budget is not None:  # the block stays in device memory beside the rest
            budget -= mtp_bytes(cfg)
        if load_format != "dummy" and model_dir.parent == CONFIG_DIR:
            raise ValueError(f"{model_dir.name} is a shipped config without weights; serve it "
                             "with --load-format dummy, or pass a checkpoint directory")
        group = None if gpus is None else open_group(be.xp, cfg, model_dir, load_format, seed,
                                                     gpus, expert_owners)
        try:
            experts = None if group is None else owned(group.owners, 0)
            budget = budget if group is None else None  # each GPU holds its share whole
            if load_format == "dummy":
                weights = dummy_weights(cfg, be.xp, seed, budget, experts=experts)
            else:
                weights = load_weights(model_dir, cfg, be.xp, resident_experts=resident_experts,
                                       budget=budget, experts=experts)
            if group is not None:
                group.join(weights)
        except BaseException:
            if group is not None:
                group.close()
            raise
        if quantize is None:
            quantize = weights.low_precision or cfg.quantization_config is not None
        engine = cls(model_dir, cfg, Model(cfg, weights, be, quantize), prefill_chunk)
        if mtp:
            block = (dummy_mtp(cfg, be.xp, seed) if load_format == "dummy" else
                     load_mtp(weights.mtp, cfg, be.xp, weights.low_precision, weight_block(cfg)))
            engine.mtp = MtpBlock(engine.model, block)
        if be.is_gpu:  # loading's cached temporaries back to the device: cuBLAS allocates
            be.xp.get_default_memory_pool().free_all_blocks()  # outside CuPy's pool
        failed = compiled()
        if failed:
            log.warning("kernel families %s did not compile ahead; each builds (or says why "
                        "it cannot) at its first launch", ", ".join(failed))
        return engine

    @property
    def tokenizer(self):
        """The model directory's tokenizer (loaded on first use; only text I/O needs it)."""
        if self._tokenizer is None:
            from ds4.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.for_model(self.model_dir)
        return self._tokenizer

    def new_session(self, ctx_size: int = 4096) -> Session:
        """A fresh, empty session with state preallocated for ctx_size tokens."""
        if ctx_size < 1:
            raise ValueError(f"ctx_size must be >= 1, got {ctx_size}")
        return Session(self, ctx_size)

    def memory_report(self) -> dict:
        """Bytes of weights, of session state (per context token and fixed) and of scratch."""
        per_token, fixed = state_bytes(self.config)
        weights = self.model.weights
        report = {
            "weight_bytes": weights.nbytes,
            "state_bytes_per_token": per_token,
            "state_fixed_bytes": fixed,
            "scratch_bytes": self.model.scratch.nbytes,
        }
        if self.mtp is not None:
            report["mtp_bytes"] = self.mtp.w.nbytes
        group = self.group
        if group is not None:
            own = sum(bank.nbytes for bank in weights.experts)
            report["weight_bytes"] += sum(group.worker_bytes)
            report["gpus"] = group.gpus
            report["expert_bytes_per_gpu"] = [own, *group.worker_bytes]
        if weights.host_tensor_nbytes:
            report["host_tensor_bytes"] = weights.host_tensor_nbytes  # the embedding
        if weights.placement is not None:
            report["host_expert_bytes"] = weights.host_nbytes
            report["expert_placement"] = weights.placement.split().describe()
        return report

    def replace_experts(self, rule: ReplacementRule | None = None, decay: float = 1.0) -> int:
        """Re-place routed experts by their (decayed) routing counts, hot ones on the GPU, as
        far as `rule` allows (default: whenever it helps); the number of experts moved. Call
        between steps (the scheduler's thread)."""
        placement = self.model.weights.placement
        return placement.replace(rule, decay) if placement is not None else 0

    def expert_placement_stats(self) -> dict | None:
        """Re-placements, experts moved and host-read share; None when every expert is
        resident."""
        placement = self.model.weights.placement
        return placement.stats() if placement is not None else None

    def decode_batch(self, sessions: Sequence[Session],
                     tokens: Sequence[int]) -> Sequence[np.ndarray]:
        """Append one token to each session in one engine step; logits (float32 [vocab]) per
        session, equal to each one's own `Session.decode` (see docs/PERF.md for the rounding),
        copied to the host when read (StepLogits).

        A batch of one is exactly `Session.decode`; more than MAX_BATCH sessions run as
        several steps of at most MAX_BATCH.
        """
        sessions, tokens = list(sessions), [int(t) for t in tokens]
        if len(sessions) != len(tokens):
            raise ValueError(f"{len(sessions)} sessions but {len(tokens)} tokens")
        if len({id(s) for s in sessions}) != len(sessions):
            raise ValueError("a session may appear only once in a decode batch")
        for s, t in zip(sessions, tokens):
            s._check_decode(self, t)
        for b in range(0, len(sessions), MAX_BATCH):
            self._decode_rows(sessions[b:b + MAX_BATCH], tokens[b:b + MAX_BATCH])
        return StepLogits(sessions)

    def _decode_rows(self, sessions: list[Session], tokens: list[int]) -> None:
        if len(sessions) == 1:  # (checked by decode_batch; _run leaves the logits lazy)
            sessions[0]._run([tokens[0]])
            return
        graph = self.model.kernel_decoder  # CuPy: one graph replay for the whole batch
        try:
            if graph is not None and not self.model.batch_rows:
                logits = graph.decode_batch([s.state for s in sessions], tokens)
            else:
                logits = self.model.decode_many([s.state for s in sessions], tokens)
            # GPU: the rows stay there (a session copies its own on first read) and one launch
            # takes every row's argmax, which greedy jobs then sample without a sync of their own
            greedy = (_argmax_rows(self.backend.xp, logits) if self.backend.is_gpu
                      else [None] * len(logits))
        except BaseException:
            for s in sessions:  # each one's layers may have written rows: back to a whole state
                s._rewind_after_failure()
            raise
        for s, token, row, best in zip(sessions, tokens, logits, greedy):
            s._took([token], None, row, best)

    @property
    def group(self):
        """The expert-parallel group (ds4/model/expert_group.py), None on one GPU."""
        return getattr(self.model.weights.experts[0], "group", None)

    def fault(self) -> str | None:
        """Why this engine can no longer step (an expert worker of its group has exited),
        None while it can."""
        return self.group.fault() if self.group is not None else None

    def close(self) -> None:
        """Free the shared scratch and stop expert workers (sessions of this engine must not
        be used afterwards)."""
        self.model.scratch.free()
        if self.group is not None:
            self.group.close()

    def fingerprint(self) -> dict:
        """What a snapshot must agree on to be restored into this engine."""
        c = self.config
        return {"layer_types": list(c.layer_types), "hidden_size": c.hidden_size,
                "head_dim": c.head_dim,
                "vocab_size": c.vocab_size, "sliding_window": c.sliding_window,
                "compress_rates": c.compress_rates, "index_head_dim": c.index_head_dim,
                "quantize": self.model.quantize}
