"""Expert parallel against one GPU (docs/ARCHITECTURE.md, Expert parallel): prefill tok/s and
decode tok/s at several concurrencies, for one engine without a group and one per --gpus
count, each row with its ratio to the one-GPU engine measured in the same run, and whether
its greedy tokens are the one-GPU engine's.

    python3 tools/bench_gpus.py --model deepseek-v4-flash --load-format dummy --gpus 1,2 \\
        --concurrency 1,4,8 [--layers 4]

The one-GPU engine of a model larger than its GPU keeps the overflow in mapped host memory
(the default budget), which is what a group of GPUs removes. Engines open one after another,
so each has the devices to itself. --gpus 1 measures the group path's own cost (its
broadcast and all-reduce through a one-rank NCCL communicator) on one GPU.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from bench_batch import first_layers

from ds4.engine import Engine, default_model_dir


def sync(engine: Engine) -> None:
    """Wait for the device (no-op on NumPy)."""
    if engine.backend.is_gpu:
        engine.backend.xp.cuda.Device().synchronize()


def measure(engine: Engine, prompt: int, tokens: int, concurrency: list[int]) -> dict:
    """Prefill tok/s of one prompt (after an untimed one: compiles, cuBLAS plans, the pool),
    then decode tok/s of `c` sessions stepping together (after two untimed warm-up steps),
    and the first session's greedy tokens."""
    ids = [1 + i % 1000 for i in range(prompt)]
    s = engine.new_session(prompt + tokens + 16)
    s.sync(ids[::-1])
    s = engine.new_session(prompt + tokens + 16)
    sync(engine)
    start = time.perf_counter()
    s.sync(ids)
    sync(engine)
    out = {"prefill tok/s": prompt / (time.perf_counter() - start)}
    for c in concurrency:
        sessions = [engine.new_session(prompt + tokens + 16) for _ in range(c)]
        for j, x in enumerate(sessions):
            x.sync(ids[j:])
        picked = []
        for step in range(tokens + 2):
            if step == 2:
                sync(engine)
                start = time.perf_counter()
            picks = [int(np.argmax(x.logits)) for x in sessions]
            picked.append(picks[0])
            engine.decode_batch(sessions, picks)
        sync(engine)
        out[f"decode c={c}"] = c * tokens / (time.perf_counter() - start)
        out.setdefault("tokens", picked)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-v4-flash", help="a model directory or a "
                   "shipped config's name; 'tiny': the built-in tiny model")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="dummy")
    p.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="cupy")
    p.add_argument("--layers", type=int, default=None, help="only the first N layers (dummy)")
    p.add_argument("--gpus", default="1", help="group sizes to compare with one GPU")
    p.add_argument("--concurrency", default="1,4,8", help="decoding sessions per step")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=32, help="timed decode steps")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    a = p.parse_args(argv)
    model = default_model_dir() if a.model == "tiny" else a.model
    model = first_layers(model, a.layers) if a.layers else model
    concurrency = [int(c) for c in a.concurrency.split(",")]
    rows = []
    for gpus in [None] + [int(g) for g in a.gpus.split(",")]:
        engine = Engine.open(model, backend=a.backend, load_format=a.load_format,
                             prefill_chunk=a.prefill_chunk, gpus=gpus,
                             ctx=a.prompt_tokens + a.tokens + 16, parallel=max(concurrency))
        placed = engine.memory_report().get("expert_placement", "all experts on the device")
        rows.append((gpus, placed, measure(engine, a.prompt_tokens, a.tokens, concurrency)))
        engine.close()
    base = rows[0][2]
    keys = [k for k in base if k != "tokens"]
    print(f"model {a.model}{f' (first {a.layers} layers)' if a.layers else ''}, prompt "
          f"{a.prompt_tokens} tokens, {a.tokens} decode steps")
    print("| gpus | " + " | ".join(keys) + " | tokens | experts |")
    print("|---" * (len(keys) + 3) + "|")
    for gpus, placed, r in rows:
        cells = [f"{r[k]:.1f} ({r[k] / base[k]:.2f}x)" for k in keys]
        same = "same" if r["tokens"] == base["tokens"] else "DIFFER"
        name = "one GPU, no group" if gpus is None else f"--gpus {gpus}"
        print(f"| {name} | " + " | ".join(cells) + f" | {same} | {placed} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
