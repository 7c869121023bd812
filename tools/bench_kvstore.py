"""Benchmark disk KV checkpoints: restoring a prompt's prefix from disk against prefilling it.

For each prompt length, in one run: the cold prefill time of the prompt, the time to snapshot
the session and queue the checkpoint (the scheduler thread's share), the writer thread's time to
put it on disk, and the restore time (file read + checks + Session.restore into a fresh
session), their ratio, the checkpoint's size and its bytes per token. The restored session's
next-token logits are checked against the prefilled one's.

    PYTHONPATH=. python3 tools/bench_kvstore.py --tokens 8192 32768
    PYTHONPATH=. python3 tools/bench_kvstore.py --model deepseek-v4-flash --load-format dummy \
        --backend cupy --prefill-chunk 2048   # the full-size model on a GPU
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np

from ds4.engine import Engine, default_model_dir
from ds4.jobs.kvfile import model_fingerprint
from ds4.jobs.kvstore import KVStore


def timed(fn) -> tuple[float, object]:
    """(seconds, result) of one call."""
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    """n random ordinary token ids (no special tokens at the top of the vocabulary)."""
    return [int(t) for t in np.random.default_rng(seed).integers(100, min(vocab, 100000), n)]


def measure(engine: Engine, store: KVStore, n: int, ctx: int) -> dict:
    """Prefill, checkpoint and restore one n-token prompt."""
    ids = prompt_ids(n, engine.config.vocab_size, n)
    session = engine.new_session(ctx)
    prefill_s, logits = timed(lambda: np.array(session.sync(ids)))
    save_s, _ = timed(lambda: store.save(ids, session.snapshot(), "prompt"))
    write_s, _ = timed(store.flush)
    fresh = engine.new_session(ctx)

    def restore() -> np.ndarray:
        found = store.longest_prefix(ids + [ids[0]], 0)
        assert found is not None and found[0] == n, "checkpoint not found"
        fresh.restore(store.load(found[1], ids))
        return fresh.sync(ids)

    restore_s, restored = timed(restore)
    size = next(e.size for e in store.entries.values() if e.tokens == n)
    return {"tokens": n, "prefill_s": round(prefill_s, 3),
            "snapshot_and_queue_s": round(save_s, 3), "write_s": round(write_s, 3),
            "restore_s": round(restore_s, 3),
            "prefill_over_restore": round(prefill_s / restore_s, 1), "file_bytes": size,
            "bytes_per_token": round(size / n, 1),
            "logits_max_abs_diff": float(np.max(np.abs(restored - logits)))}


def main() -> None:
    """Print one JSON line per prompt length, then the marginal bytes per token."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--model", help="model directory (default: the built-in tiny model)")
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                    help="dummy: random weights from the config alone (e.g. --model "
                         "deepseek-v4-flash, the full-size architecture)")
    a = ap.parse_args()
    ctx = max(a.tokens) + 16
    engine = Engine.open(a.model or default_model_dir(), backend=a.backend,
                         prefill_chunk=a.prefill_chunk, load_format=a.load_format, ctx=ctx)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ds4-kvbench-") as directory:
        store = KVStore(directory, budget_bytes=1 << 40, interval=2048, min_tokens=1)
        try:
            store.use_model(model_fingerprint(engine))
            for n in a.tokens:
                rows.append(measure(engine, store, n, ctx))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            store.close()
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        extra = (last["file_bytes"] - first["file_bytes"]) / (last["tokens"] - first["tokens"])
        print(json.dumps({"marginal_bytes_per_token": round(extra, 1)}))


if __name__ == "__main__":
    main()
