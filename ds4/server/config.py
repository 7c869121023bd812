"""Every server knob, read once at start-up into one dataclass."""

from __future__ import annotations

from dataclasses import dataclass

MODEL_ID = "deepseek-v4-flash"
# Aliases choose thinking only when the request carries no explicit thinking control.
MODEL_ALIASES = {MODEL_ID: None, "deepseek-chat": "none", "deepseek-reasoner": "high"}
THINK_MAX_MIN_CTX = 393216
DEFAULT_MAX_TOKENS = 393216
MAX_BODY_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ServerConfig:
    """Command-line choices of `ds4-server` (plus limits tests may lower)."""

    model_dir: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    parallel: int = 1
    ctx: int = 32768
    prefill_chunk: int = 2048
    backend: str = "auto"
    cors: bool = False
    api_key: str | None = None
    trace: str | None = None
    ssd_streaming: bool = False
    load_format: str = "auto"  # "dummy": random weights from config.json alone
    seed: int = 0  # of dummy weights
    gpu_memory_gib: float | None = None  # device memory for the weights (None: what is free)
    tokens: int = DEFAULT_MAX_TOKENS
    kv_disk_dir: str | None = None  # disk KV checkpoints (off without a directory)
    kv_disk_space_mb: int = 4096
    kv_disk_interval: int = 2048
    kv_disk_min_tokens: int = 512
    max_body_bytes: int = MAX_BODY_BYTES
    ping_interval_s: float = 5.0
    client_timeout_s: float = 10.0  # a request's headers or body may stall this long
    quiet: bool = False  # ds4-server writes no access log
    mtp: bool = False  # MTP speculative decoding of greedy jobs
    mtp_draft: int = 1
    mtp_margin: float = 0.0
    gpus: int | None = None  # expert parallel over this many GPUs (None: one, no group)
    expert_owners: list | None = None  # --expert-owners: a GPU per expert (or per layer row)
