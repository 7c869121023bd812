"""The model, scheduler and tool memory behind the HTTP app, and jobs as the app sees them."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool

from ds4.chat import ChatError, ToolMemory
from ds4.jobs.events import Failed, Finished, JobEvent, JobRequest
from ds4.server.config import ServerConfig
from ds4.server.errors import ApiError
from ds4.server.exchange import note_tokens
from ds4.server.metrics import KVDiskCounters, Metrics
from ds4.server.prompt_tokens import encode_prompt
from ds4.server.request_fields import lone_surrogate, lone_surrogate_error
from ds4.server.sealed_reasoning import ReasoningSeal
from ds4.server.sse import JobEvents
from ds4.server.turn import Prompt, Turn

if TYPE_CHECKING:
    from ds4.engine import Engine

LOADING, SERVING, BROKEN = "loading", "serving", "broken"
log = logging.getLogger("ds4.server")


class LoadError(ValueError):
    """A model directory that cannot be served; the message says what and where."""


class Runtime:
    """Loads the model in the background and runs jobs through the scheduler."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.state = LOADING
        self.error: str | None = None
        self.engine = None
        self.scheduler = None
        self.kvstore = None
        self.model_fingerprint: str | None = None  # a trace's header names the same one
        self.tool_memory = ToolMemory()
        self.reasoning_seal = ReasoningSeal()  # Responses encrypted_content, this process's key
        self._stop_lock = threading.Lock()
        self._stopped = False
        self.metrics = Metrics(self.queue_depth, self.busy_slots,
                               lambda: self.scheduler.stats if self.scheduler else None)
        if config.kv_disk_dir:
            self.metrics.registry.register(KVDiskCounters(lambda: self.kvstore))

    def open_kvstore(self) -> None:
        """Lock and open --kv-disk-dir (KVStoreBusy when another server holds it)."""
        from ds4.jobs.kvstore import KVStore

        cfg = self.config
        if cfg.kv_disk_dir and self.kvstore is None:
            self.kvstore = KVStore(cfg.kv_disk_dir, cfg.kv_disk_space_mb * 2**20,
                                   cfg.kv_disk_interval, cfg.kv_disk_min_tokens)

    def load(self) -> bool:
        """Open the engine and start the scheduler (blocking); False when that failed."""
        from ds4.jobs import Scheduler, SchedulerConfig

        cfg, model_dir = self.config, self.config.model_dir or "the built-in tiny model"
        try:
            self.open_kvstore()
            model_dir = self.model_dir()
            self.engine = open_engine(model_dir, cfg)
            if self.kvstore is not None:
                from ds4.jobs.kvfile import model_fingerprint

                self.kvstore.use_model(model_fingerprint(self.engine))
            sched_cfg = SchedulerConfig.from_env(parallel=cfg.parallel, ctx_size=cfg.ctx,
                                                 trace_path=cfg.trace,
                                                 ssd_streaming=cfg.ssd_streaming,
                                                 mtp_draft=cfg.mtp_draft if cfg.mtp else 0,
                                                 mtp_margin=cfg.mtp_margin)
            self.scheduler = Scheduler(self.engine, sched_cfg, time.monotonic, self.kvstore)
            self.write_trace_header(str(self.engine.model_dir))
        except Exception as exc:  # any load failure: the server stays up, /health says why
            log.debug("model failed to load", exc_info=True)  # the one-line reason is enough
            self.error = f"{model_dir}: {load_failure(exc)}"
            self.state = BROKEN
            self._close_kvstore()
            return False
        self.scheduler.stats.ttft_observers.append(self.metrics.ttft.observe)
        self.scheduler.stats.inter_token_observers.append(self.metrics.inter_token.observe)
        self.scheduler.lockstep.observers.append(self.metrics.decode_batch.observe)
        self.scheduler.start()
        self.state = SERVING
        return True

    def engine_fault(self) -> str | None:
        """Why the serving engine can no longer step (Engine.fault), None while it can."""
        fault = getattr(self.engine, "fault", None)  # (the tests' scripted engines have none)
        return fault() if fault is not None else None

    def write_trace_header(self, model_dir: str) -> None:
        """Note the model's fingerprint (/health shows it) and write the --trace file's first
        line: the fingerprint and the slots' settings, so ds4-replay can refuse another
        model's trace and rebuild the same slots."""
        from ds4.jobs.trace import model_fingerprint, trace_header

        self.model_fingerprint = model_fingerprint(model_dir)
        if self.scheduler.trace is not None:
            cfg, sched = self.config, self.scheduler.config
            self.scheduler.trace.write(trace_header(
                model_dir, parallel=cfg.parallel, ctx=cfg.ctx, prefill_chunk=cfg.prefill_chunk,
                backend=self.engine.backend.name, prefill_ms=sched.prefill_ms,
                decode_tokens=sched.decode_tokens))

    def trace_file(self) -> dict | None:
        """The --trace file's identity, so a replayer can refuse to feed a server its own
        trace; None without --trace or before the file is open."""
        if not self.config.trace or self.scheduler is None:
            return None
        file_id = trace_file_id(self.config.trace)
        return {"file_id": file_id} if file_id else None

    def load_in_background(self) -> threading.Thread:
        """Start loading; /health answers 503 until it is done."""
        thread = threading.Thread(target=self.load, name="ds4-load", daemon=True)
        thread.start()
        return thread

    def model_dir(self) -> str:
        """The model directory: --model, else the built-in tiny model."""
        if self.config.model_dir:
            return self.config.model_dir
        from ds4.engine import default_model_dir

        return str(default_model_dir())

    def stop(self) -> None:
        """Stop the scheduler thread; its queued and running jobs end failed (shutdown).
        Safe to call again and from two threads (a signal's drain, then the app's shutdown)."""
        with self._stop_lock:
            if self.scheduler is not None and not self._stopped:
                self._stopped = True
                self.scheduler.stop()  # checkpoints the slots first when a disk store is on
            self._close_kvstore()

    def _close_kvstore(self) -> None:
        """Close the disk store (its writer thread drains first)."""
        if self.kvstore is not None:
            self.kvstore.close()
            self.kvstore = None

    def queue_depth(self) -> int:
        """Jobs waiting for a slot."""
        return self.scheduler.stats.queue_depth if self.scheduler is not None else 0

    def busy_slots(self) -> int:
        """Slots that run a job now."""
        return self.scheduler.stats.busy_slots if self.scheduler is not None else 0

    def require_serving(self) -> None:
        """A 503 while the model loads (or failed to load), or once the engine can no longer
        step (an expert worker has exited)."""
        if self.state != SERVING:
            raise ApiError(503, "model is loading" if self.state == LOADING
                           else f"model failed to load: {self.error}")
        if (fault := self.engine_fault()) is not None:
            raise ApiError(503, fault)

    async def tokenize(self, turn: Turn, limit: int | None = None) -> Prompt:
        """Render and tokenize off the event loop; bad chat input becomes a 400, and so does a
        prompt that surely has more than `limit` tokens."""
        self.require_serving()

        def work() -> Prompt:
            text = turn.render()
            ids = turn.prompt_ids
            if ids is not None:
                return Prompt(text, ids)
            if hit := lone_surrogate(text):  # one inside a JSON string, e.g. tool arguments
                raise lone_surrogate_error("", hit[1])
            return Prompt(text, encode_prompt(self.engine.tokenizer, text, limit,
                                              turn.prompt_field))

        try:
            prompt = await run_in_threadpool(work)
        except ChatError as exc:
            raise ApiError(400, str(exc)) from exc
        note_tokens(prompt=len(prompt.tokens))
        return prompt

    async def start(self, turn: Turn) -> Running:
        """Render, check the context, and queue the job."""
        prompt = await self.tokenize(turn, self.config.ctx)
        self.check_context(turn, len(prompt.tokens))
        running = Running(self, turn, prompt)
        request = JobRequest(
            prompt_tokens=prompt.tokens, sampling=turn.sampling,
            max_tokens=min(turn.max_tokens, self.config.ctx - len(prompt.tokens)),
            stop=turn.stop, thinking=turn.thinking != "none" and not turn.raw_text,
            tools_active=turn.tools_active,
            forced_text=turn.forced_text, id_prefix=turn.id_prefix, call_ids=turn.call_ids,
            streamed=turn.stream, endpoint=turn.endpoint, raw_body=turn.raw_body)
        running.job = self.scheduler.submit(request, running.events.sink)
        return running

    def check_context(self, turn: Turn, n_prompt: int) -> None:
        """Prompts that leave no room in a slot's context are refused before queueing."""
        ctx = self.config.ctx
        if n_prompt < ctx:
            return
        raise ApiError(400, f"Prompt has {n_prompt} tokens, but the configured context size "
                       f"is {ctx} tokens", param=turn.prompt_field,
                       code="context_length_exceeded",
                       extra={"n_prompt_tokens": n_prompt, "n_ctx": ctx})
class Running:
    """A submitted job: its scheduler handle, its event queue and its timings."""

    def __init__(self, runtime: Runtime, turn: Turn, prompt: Prompt):
        self.runtime = runtime
        self.turn = turn
        self.prompt = prompt
        self.events = JobEvents(asyncio.get_running_loop())
        self.job = None
        self.ended = False
        self.cancelled = False

    async def next(self, timeout: float) -> JobEvent | None:
        """The next job event (None on timeout), with counters and tool memory kept up to date."""
        event = await self.events.next(timeout)
        if isinstance(event, (Finished, Failed)):
            self._end(event)
        return event

    def cancel(self) -> None:
        """Stop the job (client gone); safe to call more than once."""
        if not self.ended:
            self.ended = self.cancelled = True
            self.runtime.metrics.requests.labels(self.turn.endpoint, "cancelled").inc()
            self.runtime.scheduler.cancel(self.job)

    def _end(self, event: Finished | Failed) -> None:
        self.ended = True
        metrics = self.runtime.metrics
        if isinstance(event, Failed):
            metrics.requests.labels(self.turn.endpoint, "failed").inc()
            return
        metrics.requests.labels(self.turn.endpoint, event.finish_reason).inc()
        note_tokens(event.usage.prompt_tokens, event.usage.completion_tokens)
        calls = event.output.tool_calls
        if calls and event.output.raw_block:
            self.runtime.tool_memory.remember([c.id for c in calls], event.output.raw_block,
                                              event.output.reasoning)


def check_model_dir(model_dir: str) -> None:
    """Refuse a missing, unreadable or config-less directory before any weight is read."""
    path = Path(model_dir)
    if not path.exists():
        raise LoadError("no such directory")
    if not path.is_dir():
        raise LoadError("not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise LoadError("directory is not readable")
    config = path / "config.json"
    if not config.is_file():
        raise LoadError("no config.json in it")
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise LoadError(f"{config.name} cannot be read as JSON: {exc}") from exc


def check_vocabulary(engine: Engine) -> None:
    """Every id the tokenizer can produce must have a row in the model's embedding: checked
    at load, so no request meets an out-of-range id."""
    tokenizer, rows = engine.tokenizer, engine.config.vocab_size
    if tokenizer.vocab_size > rows:
        raise LoadError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens but the "
                        f"model's vocab_size is {rows}; they do not belong together")


def trace_file_id(path: str | Path) -> str | None:
    """A digest of the file's device and inode: equal for every path (link, relative, other
    mount) to one file, and it tells nothing of the server's directories; None if absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return hashlib.sha256(f"{st.st_dev}:{st.st_ino}".encode()).hexdigest()[:32]


def open_engine(model_dir: str, cfg: ServerConfig) -> Engine:
    """The checked engine of a model directory."""
    from ds4.engine import Engine, model_path

    model_dir = str(model_path(model_dir))  # a shipped config's name resolves to its directory
    check_model_dir(model_dir)
    engine = Engine.open(model_dir, backend=cfg.backend, prefill_chunk=cfg.prefill_chunk,
                         resident_experts=not cfg.ssd_streaming, load_format=cfg.load_format,
                         seed=cfg.seed, gpu_memory_gib=cfg.gpu_memory_gib,
                         parallel=cfg.parallel, ctx=cfg.ctx, mtp=cfg.mtp, gpus=cfg.gpus,
                         expert_owners=cfg.expert_owners)
    check_vocabulary(engine)
    return engine


def load_failure(exc: BaseException) -> str:
    """One line for a failed load: the checks' own words, else the error's type and text."""
    if isinstance(exc, (LoadError, OSError, ValueError, RuntimeError)):
        return str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {exc}"


