"""`ds4-server`: serve the model over the OpenAI, Responses and Anthropic HTTP APIs."""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import uvicorn

from ds4.cli.flags import (
    ShowDefaults,
    add_gpus,
    add_mtp,
    add_version,
    expert_owners,
    gpus_refusal,
    port_number,
    positive_float,
)
from ds4.engine import describe
from ds4.jobs.ssd_streaming import ssd_streaming_refusal
from ds4.server.config import DEFAULT_MAX_TOKENS, ServerConfig

if TYPE_CHECKING:
    from starlette.types import ASGIApp

    from ds4.server.runtime import Runtime


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def parser() -> argparse.ArgumentParser:
    """The command line of ds4-server."""
    p = argparse.ArgumentParser(prog="ds4-server", description=__doc__,
                                formatter_class=ShowDefaults)
    add_version(p)
    p.add_argument("--model", help="model directory, or with --load-format dummy the name of a "
                   "shipped config (deepseek-v4-flash); none: the built-in tiny model")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights in the checkpoint's formats from config.json alone")
    p.add_argument("--seed", type=int, default=0, help="seed of --load-format dummy weights")
    p.add_argument("--gpu-memory-gib", type=positive_float, metavar="N",
                   help="device memory for the weights; routed experts beyond it live in "
                        "mapped host memory (default: free memory less --parallel x --ctx "
                        "session state and the scratch)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port (0: any free one)")
    p.add_argument("--parallel", type=positive_int, default=1,
                   help="client sessions that run interleaved (one slot each)")
    p.add_argument("--ctx", type=positive_int, default=32768, help="context tokens per slot")
    p.add_argument("--prefill-chunk", type=positive_int, default=2048,
                   help="prompt tokens the engine runs through the model in one step; larger "
                        "chunks prefill faster and need more scratch memory")
    p.add_argument("--backend", choices=["auto", "numpy", "cupy"], default="auto",
                   help="auto: CuPy when a CUDA device is present, else NumPy")
    p.add_argument("--cors", action="store_true", help="allow browser clients of any origin")
    p.add_argument("--api-key", help="require this key (Bearer or x-api-key) on /v1 routes")
    p.add_argument("--trace", metavar="FILE",
                   help="write one JSON line per finished job (ds4-replay reads it)")
    p.add_argument("--ssd-streaming", action="store_true",
                   help="keep routed experts in the memory-mapped checkpoint and read them per "
                        "use instead of holding them in memory (NumPy only; needs --parallel 1)")
    p.add_argument("--tokens", type=positive_int, default=DEFAULT_MAX_TOKENS,
                   help="output token limit of a request that sets none (max_tokens, "
                        "max_output_tokens ...)")
    p.add_argument("--client-timeout", type=positive_float, default=10.0, metavar="S",
                   help="seconds a client may take to send a request's headers, or stall its "
                        "body, before it gets a 408")
    p.add_argument("--quiet", action="store_true", help="no access-log line per request")
    p.add_argument("--kv-disk-dir", metavar="DIR",
                   help="keep session checkpoints in DIR (restored for prompts sharing a prefix)")
    p.add_argument("--kv-disk-space-mb", type=positive_int, default=4096,
                   help="disk budget of --kv-disk-dir in MiB")
    p.add_argument("--kv-disk-interval", type=positive_int, default=2048,
                   help="checkpoint every N prompt tokens")
    p.add_argument("--kv-disk-min-tokens", type=positive_int, default=512,
                   help="shortest prefix worth a checkpoint")
    add_mtp(p)
    add_gpus(p)
    return p


def config_from(argv: list[str] | None) -> ServerConfig:
    """Parse flags into the config; bad combinations exit with status 2."""
    p = parser()
    a = p.parse_args(argv)
    if a.ssd_streaming and (why := ssd_streaming_refusal(a.parallel, a.backend, a.load_format)):
        p.error(why)
    owners, why = expert_owners(a.expert_owners, a.gpus)
    if why := why or gpus_refusal(a.gpus, a.backend, a.gpu_memory_gib, a.ssd_streaming):
        p.error(why)
    return ServerConfig(model_dir=a.model, host=a.host, port=a.port, parallel=a.parallel,
                        ctx=a.ctx, prefill_chunk=a.prefill_chunk, backend=a.backend,
                        cors=a.cors, api_key=a.api_key, trace=a.trace,
                        ssd_streaming=a.ssd_streaming, tokens=a.tokens,
                        client_timeout_s=a.client_timeout, quiet=a.quiet,
                        kv_disk_dir=a.kv_disk_dir, kv_disk_space_mb=a.kv_disk_space_mb,
                        kv_disk_interval=a.kv_disk_interval,
                        kv_disk_min_tokens=a.kv_disk_min_tokens,
                        load_format=a.load_format, seed=a.seed, gpu_memory_gib=a.gpu_memory_gib,
                        mtp=a.mtp, mtp_draft=a.mtp_draft, mtp_margin=a.mtp_margin,
                        gpus=a.gpus, expert_owners=owners)


def figure(name: str, value: object) -> str:
    """One memory figure; byte counts also in MiB."""
    if name.endswith("_bytes") and isinstance(value, (int, float)):
        return f"  {name}: {value:.0f} ({value / 2**20:.1f} MiB)"
    return f"  {name}: {value}"


def report_memory(engine: object, config: ServerConfig) -> None:
    """Print the engine's memory figures and what the slots' contexts take."""
    report = engine.memory_report()
    items = report.items() if isinstance(report, dict) else [("memory", report)]
    lines = [figure(k, v) for k, v in items]
    per_token = report.get("state_bytes_per_token") if isinstance(report, dict) else None
    if per_token:
        slot = report.get("state_fixed_bytes", 0) + per_token * config.ctx
        lines.append(f"  context per slot ({config.ctx} tokens): {slot / 2**20:.1f} MiB; "
                     f"{config.parallel} slot(s): {slot * config.parallel / 2**20:.1f} MiB")
    print("ds4-server: model memory\n" + "\n".join(lines), flush=True)


def load_and_report(runtime: Runtime, server: Server) -> None:
    """Load the model (the server already answers /health with 503), then print figures;
    a model that cannot load ends the server: one line on stderr, exit status 1."""
    if not runtime.load():
        print(f"ds4-server: model failed to load: {runtime.error}", file=sys.stderr, flush=True)
        server.exit_code = 1
        server.should_exit = True
        return
    cfg = runtime.config
    print(f"ds4-server: model loaded from {runtime.model_dir()} "
          f"({cfg.parallel} slot(s) of {cfg.ctx} tokens) {describe(runtime.engine.backend)}",
          flush=True)
    report_memory(runtime.engine, cfg)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket; an address that cannot be bound exits 1 with one line."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        reason = exc.strerror.lower() if exc.strerror else str(exc)
        print(f"ds4-server: cannot listen on {host}:{port}: {reason}", file=sys.stderr)
        raise SystemExit(1) from None
    return sock


class Server(uvicorn.Server):
    """uvicorn's server with ds4's stop: the first SIGINT/SIGTERM fails every job still
    queued or running ("server shutting down"), so each stream ends with its protocol's
    error event at once instead of running on until the graceful timeout cuts it."""

    def __init__(self, config: uvicorn.Config, runtime: Runtime) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.exit_code = 0

    def handle_exit(self, sig: int, frame: object) -> None:
        """A stop signal: end the jobs (off the signal handler: it may wait for a turn)."""
        if not self.should_exit:
            threading.Thread(target=self.runtime.stop, name="ds4-stop", daemon=True).start()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Take SIGINT/SIGTERM while serving; unlike uvicorn's, do not raise them again
        afterwards (that would print a KeyboardInterrupt traceback): the stop was clean."""
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def uvicorn_config(app: ASGIApp, config: ServerConfig, runtime: Runtime) -> uvicorn.Config:
    """How uvicorn runs the app: one worker, warnings only, a short graceful stop (the jobs
    are failed first, so open streams end within it), and h11 connections that answer slow
    clients with a 408."""
    from ds4.server.connection import client_protocol

    protocol = client_protocol(config.client_timeout_s, runtime.metrics)
    return uvicorn.Config(app, workers=1, log_level="warning", timeout_graceful_shutdown=1,
                          http=protocol)


def serve(config: ServerConfig) -> int:
    """Bind, start loading the model, serve until a stop signal or a failed load."""
    from ds4.server.app import build_app
    from ds4.server.exchange import log_access_to_stderr
    from ds4.server.runtime import Runtime

    sock = bind(config.host, config.port)
    if not config.quiet:
        log_access_to_stderr()
    runtime = Runtime(config)
    try:  # before listening: a second server on the same directory is refused at once
        runtime.open_kvstore()
    except (RuntimeError, OSError) as exc:
        print(f"ds4-server: {exc}", file=sys.stderr, flush=True)
        sock.close()
        return 2
    app = build_app(config, runtime, load=False)
    server = Server(uvicorn_config(app, config, runtime), runtime)
    threading.Thread(target=load_and_report, args=(runtime, server), daemon=True).start()
    port = sock.getsockname()[1]
    host = f"[{config.host}]" if ":" in config.host else config.host
    print(f"ds4-server: listening on http://{host}:{port} "
          "(GET /health is 503 until the model is loaded)", flush=True)
    server.run(sockets=[sock])
    return server.exit_code


def main(argv: list[str] | None = None) -> int:
    """Entry point of ds4-server."""
    config = config_from(argv)
    try:
        return serve(config)
    except KeyboardInterrupt:  # Ctrl-C before the server took the signals over
        return 130


if __name__ == "__main__":
    sys.exit(main())
