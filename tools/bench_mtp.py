"""MTP speculative decoding: greedy tokens/s without and with drafts, acceptance, and the
ceiling at forced 100% acceptance (drafts = the tokens plain greedy produced).

Every mode decodes the same prompt greedily for --tokens tokens and must produce the plain
run's tokens (the `same` column). Without MTP a token is `Session.decode` (on the GPU its
CUDA-graph step); with MTP a round is the MTP block's drafts (on the GPU one graph replay each)
and their verification: one pass of 1 + N tokens, through the chunk path on NumPy and as one
replay of the decode graph with N + 1 members on the GPU
(docs/ARCHITECTURE.md, Speculative decoding). Runs on any model and backend; --layers N keeps
a model's first N layers (the full-size model overflows to host memory on one H200, whose
reads grow with every token):

    PYTHONPATH=. python3 tools/bench_mtp.py                       # tiny model, NumPy
    PYTHONPATH=. python3 tools/bench_mtp.py --model deepseek-v4-flash --load-format dummy \
        --backend cupy --tokens 64 --drafts 1,2,3 [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from bench_batch import first_layers

from ds4.engine import Engine, default_model_dir
from ds4.jobs.speculative import DraftOracle, SpeculationConfig, Speculator


def synchronize(engine: Engine) -> None:
    """Wait for the device (a no-op on NumPy)."""
    if engine.backend.is_gpu:
        engine.backend.xp.cuda.Device().synchronize()


def prompt_ids(engine: Engine, length: int, seed: int) -> list[int]:
    """A random prompt of ordinary token ids (reproducible)."""
    rng = np.random.default_rng(seed)
    return rng.integers(1000, min(engine.config.vocab_size, 100000), size=length).tolist()


def plain(engine: Engine, ids: list[int], tokens: int, ctx: int) -> tuple[list[int], float]:
    """(greedy tokens, seconds) of plain one-token decoding."""
    s = engine.new_session(ctx)
    s.sync(ids)
    out = []
    synchronize(engine)
    start = time.perf_counter()
    for _ in range(tokens):
        out.append(int(np.argmax(s.logits)))
        s.decode(out[-1])
    synchronize(engine)
    return out, time.perf_counter() - start


def speculated(engine: Engine, ids: list[int], tokens: int, ctx: int, draft: int,
               margin: float, oracle: DraftOracle | None) -> tuple[list[int], float, Speculator]:
    """(greedy tokens, seconds, the speculator with its counters) in draft/verify rounds."""
    s = engine.new_session(ctx)
    s.sync(ids)
    spec = Speculator(SpeculationConfig(draft, margin), oracle=oracle)
    out: list[int] = []
    synchronize(engine)
    start = time.perf_counter()
    while len(out) < tokens:
        out += spec.round(s, int(np.argmax(s.logits)), tokens - len(out))
    synchronize(engine)
    return out, time.perf_counter() - start, spec


def rows(engine: Engine, a: argparse.Namespace) -> list[dict]:
    """One result per mode: plain, then MTP and forced acceptance at each draft length."""
    ids = prompt_ids(engine, a.prompt_tokens, a.seed)
    plain(engine, ids, min(4, a.tokens), a.ctx)  # warm-up: kernels, graphs, scratch
    reference, seconds = plain(engine, ids, a.tokens, a.ctx)
    out = [{"mode": "plain", "draft": 0, "tok_s": a.tokens / seconds, "acceptance": None,
            "tokens_per_round": 1.0, "same": True}]
    oracle = DraftOracle([ids + reference])
    for draft in a.drafts:
        for mode, use in (("mtp", None), ("forced", oracle)):
            speculated(engine, ids, min(draft + 2, a.tokens), a.ctx, draft, a.margin, use)
            got, seconds, spec = speculated(engine, ids, a.tokens, a.ctx, draft, a.margin, use)
            st = spec.stats
            out.append({"mode": mode, "draft": draft, "tok_s": len(got) / seconds,
                        "acceptance": st.acceptance_rate,
                        "tokens_per_round": st.tokens_per_round,
                        "same": got[: a.tokens] == reference})
    return out


def table(results: list[dict], header: str) -> str:
    """The results as a Markdown table."""
    lines = [header, "", "| mode | drafts | tok/s | acceptance | tokens/verify round | same |",
             "|---|---|---|---|---|---|"]
    for r in results:
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.1f}%"
        lines.append(f"| {r['mode']} | {r['draft']} | {r['tok_s']:.2f} | {acc} | "
                     f"{r['tokens_per_round']:.2f} | {'yes' if r['same'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory or shipped config (default: tiny)")
    p.add_argument("--backend", default="auto", choices=["auto", "numpy", "cupy"])
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--seed", type=int, default=0, help="dummy weights and the prompt")
    p.add_argument("--gpu-memory-gib", type=float, default=None)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per run")
    p.add_argument("--drafts", default="1,2,3", help="draft lengths, comma-separated")
    p.add_argument("--margin", type=float, default=0.0, help="--mtp-margin")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--layers", type=int, default=None,
                   help="only the model's first N layers (with --load-format dummy)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    a = p.parse_args(argv)
    a.drafts = [int(d) for d in a.drafts.split(",")]
    model = a.model or default_model_dir()
    if a.layers is not None:
        if a.load_format != "dummy":
            p.error("--layers takes --load-format dummy (the cut model has no weight files)")
        model = first_layers(model, a.layers)
    engine = Engine.open(model, backend=a.backend,
                         load_format=a.load_format, seed=a.seed,
                         gpu_memory_gib=a.gpu_memory_gib, ctx=a.ctx, mtp=True)
    results = rows(engine, a)
    if a.json:
        print(json.dumps(results, indent=2))
    else:
        layers = "" if a.layers is None else f" (first {a.layers} layers)"
        header = (f"model {a.model or 'tiny'}{layers}, backend {engine.backend.name}, prompt "
                  f"{a.prompt_tokens} tokens, {a.tokens} greedy tokens, margin {a.margin}")
        print(table(results, header))
    return 0 if all(r["same"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
