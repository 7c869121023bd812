"""`ds4-server`: serve the model over the OpenAI, Responses and Anthropic HTTP APIs."""

from __future__ import annotations

import argparse
import sys
import threading

from ds4.backend import cuda_available
from ds4.server.config import DEFAULT_MAX_TOKENS, ServerConfig


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
    p = argparse.ArgumentParser(prog="ds4-server", description=__doc__)
    p.add_argument("--model", help="model directory (default: the built-in tiny model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=positive_int, default=8000)
    p.add_argument("--parallel", type=positive_int, default=1,
                   help="client sessions that run interleaved (one slot each)")
    p.add_argument("--ctx", type=positive_int, default=32768, help="context tokens per slot")
    p.add_argument("--prefill-chunk", type=positive_int, default=2048,
                   help="prompt tokens per prefill step")
    p.add_argument("--backend", choices=["auto", "numpy", "cupy"], default="auto")
    p.add_argument("--cors", action="store_true", help="allow browser clients of any origin")
    p.add_argument("--api-key", help="require this key (Bearer or x-api-key) on /v1 routes")
    p.add_argument("--trace", metavar="FILE", help="write one JSON line per finished job")
    p.add_argument("--ssd-streaming", action="store_true",
                   help="stream experts from disk (needs --parallel 1)")
    p.add_argument("--tokens", type=positive_int, default=DEFAULT_MAX_TOKENS,
                   help="default max output tokens of a request")
    p.add_argument("--kv-disk-dir", metavar="DIR",
                   help="keep session checkpoints in DIR (restored for prompts sharing a prefix)")
    p.add_argument("--kv-disk-space-mb", type=positive_int, default=4096,
                   help="disk budget of --kv-disk-dir in MiB (default 4096)")
    p.add_argument("--kv-disk-interval", type=positive_int, default=2048,
                   help="checkpoint every N prompt tokens (default 2048)")
    p.add_argument("--kv-disk-min-tokens", type=positive_int, default=512,
                   help="shortest prefix worth a checkpoint (default 512)")
    return p


def config_from(argv: list[str] | None) -> ServerConfig:
    """Parse flags into the config; bad combinations exit with status 2."""
    p = parser()
    a = p.parse_args(argv)
    if a.parallel > 1 and a.ssd_streaming:
        p.error("--parallel > 1 cannot be combined with --ssd-streaming: interleaved sessions "
                "would thrash the streamed expert cache; use --parallel 1")
    if a.ssd_streaming and (a.backend == "cupy" or (a.backend == "auto" and cuda_available())):
        p.error("--ssd-streaming is not supported on the CuPy backend yet; "
                "use --backend numpy or drop --ssd-streaming")
    return ServerConfig(model_dir=a.model, host=a.host, port=a.port, parallel=a.parallel,
                        ctx=a.ctx, prefill_chunk=a.prefill_chunk, backend=a.backend,
                        cors=a.cors, api_key=a.api_key, trace=a.trace,
                        ssd_streaming=a.ssd_streaming, tokens=a.tokens,
                        kv_disk_dir=a.kv_disk_dir, kv_disk_space_mb=a.kv_disk_space_mb,
                        kv_disk_interval=a.kv_disk_interval,
                        kv_disk_min_tokens=a.kv_disk_min_tokens)


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


def load_and_report(runtime) -> None:
    """Load the model (the server already answers /health with 503), then print figures."""
    if not runtime.load():
        print(f"ds4-server: model failed to load: {runtime.error}", file=sys.stderr, flush=True)
        return
    cfg = runtime.config
    print(f"ds4-server: model loaded from {runtime.model_dir()} "
          f"({cfg.parallel} slot(s) of {cfg.ctx} tokens)", flush=True)
    report_memory(runtime.engine, cfg)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ds4-server."""
    import uvicorn

    from ds4.server.app import build_app
    from ds4.server.runtime import Runtime

    config = config_from(argv)
    runtime = Runtime(config)
    try:  # before listening: a second server on the same directory is refused at once
        runtime.open_kvstore()
    except (RuntimeError, OSError) as exc:
        print(f"ds4-server: {exc}", file=sys.stderr, flush=True)
        return 2
    app = build_app(config, runtime, load=False)
    threading.Thread(target=load_and_report, args=(runtime,), daemon=True).start()
    print(f"ds4-server: listening on http://{config.host}:{config.port} "
          "(GET /health is 503 until the model is loaded)", flush=True)
    # a stream may run for minutes: on Ctrl-C give open requests 5 s, then cancel their jobs
    uvicorn.run(app, host=config.host, port=config.port, workers=1, log_level="warning",
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
