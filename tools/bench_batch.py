"""Batched decode per engine step (`bench_engine.py --batch 1,2,4,8`): seconds per step of
Engine.decode_batch for each batch size, against the bytes-read bound of that batch.

A batch reads the shared matrices once and each distinct routed expert once (counted from the
router's picks of the timed steps), so with uniform routing the bound grows with B much less
than B times one stream's rate. Runs on either backend and any model directory the engine
opens (default: the built-in tiny model on NumPy, a smoke test; on the GPU a Flash-sized model).

    PYTHONPATH=. python3 tools/bench_engine.py --batch 1,2,4,8 --model DIR --backend cupy
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import numpy as np

from ds4.engine import Engine
from ds4.model import moe as moe_module
from ds4.model.packed import is_packed


def copy_bandwidth(xp) -> float:
    """Bytes read + written per second of one large device (or host) copy."""
    n = (1 << 28) if xp is not np else (1 << 25)  # 1 GiB on the GPU, 128 MiB on the host
    a = xp.ones(n, dtype=xp.float32)
    b = xp.empty_like(a)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        xp.copyto(b, a)
        if xp is not np:
            xp.cuda.Device().synchronize()
        times.append(time.perf_counter() - start)
    return 2 * a.nbytes / min(times)


def expert_bytes(engine: Engine) -> list[int]:
    """Bytes of one routed expert (gate_up + down) as held, per layer."""
    out = []
    for bank in engine.model.weights.experts:
        bank = getattr(bank, "local", bank)  # expert parallel: rank 0's share
        out.append(bank.nbytes // bank.count if bank.resident else 0)
    return out


def shared_bytes(engine: Engine, batch: int) -> int:
    """Bytes of every non-expert weight a step reads (the embedding: only the batch's rows)."""
    w = engine.model.weights
    seen: dict[int, int] = {}
    for name, t in w.tensors.items():
        size = int(t.nbytes)
        if name == "model.embed_tokens.weight":
            size = size // t.shape[0] * batch
        elif name.endswith(("tid2eid", "position_bias")) and not is_packed(t):
            size = size // t.shape[0] * batch
        seen[id(t)] = size
    return sum(seen.values())


@contextlib.contextmanager
def recorded_routes(picks: list):
    """Note every router call's expert ids (host arrays) while the block runs."""
    route = moe_module.route

    def noting(xp, cfg, lw, x, token_ids, hashed):
        ids, weights = route(xp, cfg, lw, x, token_ids, hashed)
        picks.append(np.asarray(ids.get() if hasattr(ids, "get") else ids))
        return ids, weights
    moe_module.route = noting
    try:
        yield
    finally:
        moe_module.route = route


def sessions_at(engine: Engine, batch: int, prompt: int, ctx: int) -> list:
    """`batch` sessions holding distinct prompts of `prompt` tokens."""
    rng = np.random.default_rng(batch)
    vocab = min(engine.config.vocab_size, 50000)
    out = []
    for _ in range(batch):
        s = engine.new_session(ctx)
        s.sync([0] + rng.integers(2, vocab, prompt - 1).tolist())
        out.append(s)
    return out


def step_times(engine: Engine, sessions: list, steps: int) -> tuple[list[float], list]:
    """Seconds of each greedy batched step (the first one, a warm-up, left out) and the picks."""
    times, picks = [], []
    logits = [s.logits for s in sessions]
    for i in range(steps + 1):
        tokens = [int(np.argmax(row)) for row in logits]
        noted: list = []
        with recorded_routes(noted):
            start = time.perf_counter()
            logits = engine.decode_batch(sessions, tokens)
            _finish(engine)  # the logits stay on the device until read: wait for the step
            elapsed = time.perf_counter() - start
        if i:
            times.append(elapsed)
            picks.append(noted)
    return times, picks


def _finish(engine: Engine) -> None:
    """Wait until the device has run everything queued (nothing to wait for on NumPy)."""
    xp = engine.backend.xp
    if xp is not np:
        xp.cuda.Device().synchronize()


def bound_bytes(engine: Engine, batch: int, distinct: float, per_expert: list[int]) -> int:
    """Bytes a step of `batch` sessions must read: the non-expert weights once and `distinct`
    experts a layer once each (per_expert: expert_bytes, per layer)."""
    return shared_bytes(engine, batch) + sum(int(distinct * e) for e in per_expert)


def distinct_experts(picks: list, cfg, batch: int) -> float:
    """Mean distinct experts a step reads per layer: counted from the router's picks, or where
    no pick was seen (steps replayed as CUDA graphs: the model's router is not called) the
    uniform-routing expectation E (1 - (1 - k/E)^B)."""
    if picks and picks[0]:
        L = cfg.num_hidden_layers  # a step routes layer by layer, once or once per session
        return float(statistics.mean(len(np.unique(np.concatenate(step[layer::L])))
                                     for step in picks for layer in range(L)))
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return E * (1.0 - (1.0 - k / E) ** batch)


def graph_seconds(engine: Engine, batch: int) -> float | None:
    """Median replay seconds of the step graph that ran this batch size (the device's share of
    a step: the rest of step_s is the host's tables, launch and argmax), None without one."""
    dec = getattr(engine.model.kernel_decoder, "decoder", None)  # GraphDecode's, once built
    if dec is None:
        return None
    from timing import replay_time

    from ds4.model.gpu_decode import SIZES

    graph = dec.graphs.get(next(s for s in SIZES if s >= batch))
    return None if graph is None else replay_time(engine.backend.xp, dec.stream, graph)


def batch_bench(engine: Engine, batches: list[int], prompt: int, steps: int) -> dict:
    """Per batch size: median step seconds, tok/s, bytes bound and its share."""
    xp, cfg = engine.backend.xp, engine.config
    # the bytes a batch must read, at the copy rate (read + written), the convention of every
    # floor in docs/PERF.md: a read-only kernel can stream about that fast, not half of it
    bandwidth = copy_bandwidth(xp)
    per_expert = expert_bytes(engine)
    rows = {}
    for b in batches:
        sessions = sessions_at(engine, b, prompt, prompt + steps + 8)
        times, picks = step_times(engine, sessions, steps)
        distinct = distinct_experts(picks, cfg, b)
        moved = bound_bytes(engine, b, distinct, per_expert)
        step = statistics.median(times)
        rows[b] = {"step_s": step, "tok_per_s": b / step, "distinct_experts": distinct,
                   "bound_bytes": moved, "bound_s": moved / bandwidth,
                   "of_bound": moved / bandwidth / step, "graph_s": graph_seconds(engine, b)}
    return {"bandwidth_bytes_per_s": bandwidth, "rows": rows}


def report(res: dict, label: str) -> None:
    """One table row per batch size."""
    print(f"batched decode, {label}; bound read at the copy rate "
          f"{res['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")
    print(f"| {'B':>2} | {'ms/step':>8} | {'tok/s':>9} | {'x B=1':>6} | {'experts/layer':>13} "
          f"| {'bound MB':>9} | {'bound ms':>8} | {'of bound':>8} | {'graph ms':>8} |")
    print("|" + "|".join("-" * w for w in (4, 10, 11, 8, 15, 11, 10, 10, 10)) + "|")
    rows = res["rows"]
    base = rows[min(rows)]["tok_per_s"]
    for b, r in rows.items():
        graph = "" if r["graph_s"] is None else f"{r['graph_s'] * 1e3:.2f}"
        print(f"| {b:>2} | {r['step_s'] * 1e3:8.2f} | {r['tok_per_s']:9.1f} | "
              f"{r['tok_per_s'] / base:5.2f}x | {r['distinct_experts']:13.1f} | "
              f"{r['bound_bytes'] / 1e6:9.2f} | {r['bound_s'] * 1e3:8.3f} | "
              f"{100 * r['of_bound']:7.1f}% | {graph:>8} |")


def first_layers(model: str, layers: int) -> str:
    """A temporary model directory whose config.json is the model's with its first `layers`
    layers (and the MTP block's compress ratio); weights come from --load-format dummy."""
    import tempfile
    from pathlib import Path

    from ds4.model.dummy import model_path

    cfg = json.loads((model_path(model) / "config.json").read_text())
    ratios = cfg.get("compress_ratios")
    if ratios is not None:
        cfg["compress_ratios"] = ratios[:layers] + ratios[cfg["num_hidden_layers"]:]
    cfg["num_hidden_layers"] = layers
    if "num_hash_layers" in cfg:
        cfg["num_hash_layers"] = min(cfg["num_hash_layers"], layers)
    out = Path(tempfile.mkdtemp(prefix="ds4-layers-"))
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def main(argv: list[str] | None = None) -> int:
    """Parse the batch mode's flags, measure, print the table (and JSON when asked)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,2,4,8", help="batch sizes, comma separated")
    ap.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    ap.add_argument("--backend", default="numpy", choices=("numpy", "cupy", "auto"))
    ap.add_argument("--prompt", type=int, default=64, help="tokens each session holds first")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per batch size")
    ap.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                    help="dummy: random weights from the model's config.json (a shipped name)")
    ap.add_argument("--layers", type=int, default=None,
                    help="keep only the first N layers of the config (with --load-format dummy)")
    ap.add_argument("--json")
    args, _ = ap.parse_known_args(argv)
    if args.model is None:
        from ds4.engine import default_model_dir

        args.model = str(default_model_dir())
    model = args.model if args.layers is None else first_layers(args.model, args.layers)
    engine = Engine.open(model, backend=args.backend, prefill_chunk=256,
                         load_format=args.load_format)
    res = batch_bench(engine, [int(b) for b in args.batch.split(",")], args.prompt, args.steps)
    if engine.model.batch_rows:
        mode = "one batched pass of the model code"
    elif engine.model.kernel_decoder is not None:
        mode = "one CUDA graph replay of the batch's size"
    else:
        mode = "single steps in turn"
    report(res, f"{args.model} on {engine.backend.name} ({mode}), sessions at position "
                f"{args.prompt}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
