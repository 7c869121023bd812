"""The model, scheduler and tool memory behind the HTTP app, and jobs as the app sees them."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from starlette.concurrency import run_in_threadpool

from ds4.chat import ChatError, ToolMemory
from ds4.jobs.events import Failed, Finished, JobRequest
from ds4.server.config import ServerConfig
from ds4.server.errors import ApiError
from ds4.server.metrics import KVDiskCounters, Metrics
from ds4.server.sse import JobEvents
from ds4.server.turn import Prompt, Turn

LOADING, SERVING, BROKEN = "loading", "serving", "broken"
log = logging.getLogger("ds4.server")


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

    async def next(self, timeout: float) -> object | None:
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

    def _end(self, event: object) -> None:
        self.ended = True
        metrics = self.runtime.metrics
        if isinstance(event, Failed):
            metrics.requests.labels(self.turn.endpoint, "failed").inc()
            return
        metrics.requests.labels(self.turn.endpoint, event.finish_reason).inc()
        calls = event.output.tool_calls
        if calls and event.output.raw_block:
            self.runtime.tool_memory.remember([c.id for c in calls], event.output.raw_block,
                                              event.output.reasoning)


class Runtime:
    """Loads the model in the background and runs jobs through the scheduler."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.state = LOADING
        self.error: str | None = None
        self.engine = None
        self.scheduler = None
        self.kvstore = None
        self.tool_memory = ToolMemory()
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
        from ds4.engine import Engine
        from ds4.jobs import Scheduler, SchedulerConfig

        cfg = self.config
        try:
            self.open_kvstore()
            self.engine = Engine.open(self.model_dir(), backend=cfg.backend,
                                      prefill_chunk=cfg.prefill_chunk)
            if self.kvstore is not None:
                from ds4.jobs.kvstore import model_fingerprint

                self.kvstore.use_model(model_fingerprint(self.engine))
            sched_cfg = SchedulerConfig.from_env(parallel=cfg.parallel, ctx_size=cfg.ctx,
                                                 trace_path=cfg.trace,
                                                 ssd_streaming=cfg.ssd_streaming)
            self.scheduler = Scheduler(self.engine, sched_cfg, time.monotonic, self.kvstore)
        except Exception as exc:  # any load failure: the server stays up, /health says why
            log.exception("model failed to load")
            self.error = f"{type(exc).__name__}: {exc}"
            self.state = BROKEN
            self._close_kvstore()
            return False
        self.scheduler.stats.ttft_observers.append(self.metrics.ttft.observe)
        self.scheduler.stats.inter_token_observers.append(self.metrics.inter_token.observe)
        self.scheduler.start()
        self.state = SERVING
        return True

    def load_in_background(self) -> threading.Thread:
        """Start loading; /health answers 503 until it is done."""
        thread = threading.Thread(target=self.load, name="ds4-load", daemon=True)
        thread.start()
        return thread

    def model_dir(self) -> str:
        """The model directory: --model, else the built-in tiny model."""
        if self.config.model_dir:
            return self.config.model_dir
        from ds4.model.tiny import default_model_dir

        return str(default_model_dir())

    def stop(self) -> None:
        """Stop the scheduler thread (slots are checkpointed), then close the disk store."""
        if self.scheduler is not None:
            self.scheduler.stop()
        self._close_kvstore()

    def _close_kvstore(self) -> None:
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
        """A 503 while the model loads (or failed to load)."""
        if self.state != SERVING:
            raise ApiError(503, "model is loading" if self.state == LOADING
                           else f"model failed to load: {self.error}")

    async def tokenize(self, turn: Turn) -> Prompt:
        """Render and tokenize off the event loop; bad chat input becomes a 400."""
        self.require_serving()

        def work() -> Prompt:
            text = turn.render()
            return Prompt(text, self.engine.tokenizer.encode(text))

        try:
            return await run_in_threadpool(work)
        except ChatError as exc:
            raise ApiError(400, str(exc)) from exc

    async def start(self, turn: Turn) -> Running:
        """Render, check the context, and queue the job."""
        prompt = await self.tokenize(turn)
        self.check_context(turn, len(prompt.tokens))
        running = Running(self, turn, prompt)
        request = JobRequest(
            prompt_tokens=prompt.tokens, sampling=turn.sampling,
            max_tokens=min(turn.max_tokens, self.config.ctx - len(prompt.tokens)),
            stop=turn.stop, thinking=turn.thinking != "none" and not turn.raw_text,
            tools_active=turn.tools_active,
            forced_text=turn.forced_text, id_prefix=turn.id_prefix, call_ids=turn.call_ids,
            endpoint=turn.endpoint, raw_body=turn.raw_body)
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
