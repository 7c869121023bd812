"""The built-in tiny model on the NumPy backend: a long prompt's prefill and sampled decode of
several streams through the scheduler, each against what the CPU can do, measured in one run.

- prefill: tok/s of one `--prompt`-token prompt at `--chunk`, and the seconds the same chunks'
  GEMM FLOPs (every matrix product the layers must do) take at the fp32 GEMM rate this machine
  shows in the same run (a floor: attention, indexer scores and small ops come on top);
- decode: ms a token of `--streams` greedy or sampled streams (`--temperature`, `--top-p`)
  through the scheduler's batched turns, and the share of it spent drawing tokens.

    python3 tools/bench_cpu.py --prompt 20000 --streams 4 --top-p 0.9 --temperature 0.7
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds4.engine import Engine, default_model_dir  # noqa: E402  (after the sys.path line)
from ds4.jobs.events import JobRequest, SamplingOptions  # noqa: E402
from ds4.jobs.scheduler import Scheduler, SchedulerConfig  # noqa: E402


def gemm_rate() -> float:
    """fp32 FLOP/s of a 2048^3 NumPy product on this machine (best of three)."""
    a = np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2 * 2048 ** 3 / best


def matrix_flops(engine: Engine, tokens: int) -> float:
    """FLOPs of every weight matrix a token meets (each routed expert k times), times tokens."""
    cfg, weights = engine.config, engine.model.weights
    dense = sum(int(np.prod(t.shape[-2:])) for name, t in weights.tensors.items()
                if t.ndim >= 2 and "embed" not in name and "tid2eid" not in name)
    expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size
    routed = cfg.num_hidden_layers * cfg.num_experts_per_tok * expert
    return 2.0 * tokens * (dense + routed)


def prefill(engine: Engine, n: int) -> float:
    """Seconds to sync one n-token prompt (random ids)."""
    ids = [0] + np.random.default_rng(0).integers(2, 100000, n - 1).tolist()
    session = engine.new_session(n + 16)
    start = time.perf_counter()
    session.sync(ids)
    return time.perf_counter() - start


def decode(engine: Engine, streams: int, tokens: int, opts: SamplingOptions) -> tuple:
    """(seconds a token, share of it in ds4.sampling.sample) of `streams` jobs in one scheduler."""
    sched = Scheduler(engine, SchedulerConfig(parallel=streams, ctx_size=512, decode_tokens=6))
    for i in range(streams):
        prompt = engine.tokenizer.encode(f"Stream {i}: tell me about rivers")
        sched.submit(JobRequest(prompt_tokens=prompt, max_tokens=tokens, sampling=opts),
                     lambda event: None)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    while sched.run_turn():
        pass
    profile.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profile).stats
    drawing = sum(v[3] for k, v in stats.items() if k[2] == "sample" and k[0].endswith(
        str(Path("ds4", "sampling.py"))))
    return wall / (streams * tokens), drawing / wall


def main(argv=None) -> int:
    """Run both measures and print them."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=20000)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    args = ap.parse_args(argv)
    engine = Engine.open(default_model_dir(), backend="numpy", prefill_chunk=args.chunk)
    rate = gemm_rate()
    seconds = prefill(engine, args.prompt)
    floor = matrix_flops(engine, args.prompt) / rate
    print(f"fp32 GEMM rate {rate / 1e9:.0f} GFLOP/s")
    print(f"prefill of {args.prompt} tokens at chunk {args.chunk}: {seconds:.2f} s "
          f"({args.prompt / seconds:.0f} tok/s); matrix FLOPs at that rate {floor:.2f} s "
          f"({seconds / floor:.1f}x)")
    opts = SamplingOptions(temperature=args.temperature, top_p=args.top_p, seed=1)
    per_token, drawing = decode(engine, args.streams, args.tokens, opts)
    print(f"decode, {args.streams} streams, temperature {args.temperature}, top_p {args.top_p}: "
          f"{per_token * 1e3:.2f} ms a token, {drawing:.0%} of it drawing tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
