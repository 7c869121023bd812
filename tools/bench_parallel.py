"""What `ds4-server --parallel 2` buys a second client, over real HTTP streams: A streams a long
greedy generation, B sends a long prompt once A has ~50 tokens; a --parallel 1 and a --parallel 2
server (same model, backend, prompts and env) are measured alike and the medians compared.

    python3 tools/bench_parallel.py --tokens-a 400 --prompt-b-tokens 3000 --prefill-ms 200 \\
        --repeat 3
    python3 tools/bench_parallel.py --model /models/DeepSeek-V4-Flash --backend cupy  # on a GPU
    python3 tools/bench_parallel.py --model deepseek-v4-flash --load-format dummy --backend cupy \
        --tokens-a 350 --prompt-b-tokens 3000 --repeat 1   # the whole V4-Flash on one GPU

With --model (or --sequential) the --parallel 1 server runs its repeats and stops before the
--parallel 2 one starts (two full-size servers cannot share one GPU). After the table come the
goals: B's TTFT at --parallel 2 against 1 s, and A's worst gap against one prefill slice plus
one decode burst (DS4_SERVER_SCHED_PREFILL_MS + decode-burst tokens x A's own per-token gap
before B arrived).

--streams 1,2,4,8 measures instead the aggregate decode tok/s of N concurrent greedy streams on
one server of --parallel max(N) (see concurrent_streams), each against the bytes-read bound of
its mean decode batch (see decode_bounds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx
from bench_batch import bound_bytes, copy_bandwidth, distinct_experts, expert_bytes

from ds4.engine import Engine, default_model_dir
from ds4.jobs.scheduler import SchedulerConfig
from ds4.tokenizer import Tokenizer

MODEL = "deepseek-chat"  # alias with thinking off, so temperature 0 is greedy
PROMPT_A = "Tell me a long story about a fox who learns to sail."
WORDS = ("river stone lantern harvest copper meadow thunder quiet orchard signal ferry marble "
         "winter cedar violin compass glacier ember saddle harbor 1987 the of, and; whispered "
         "(north) ancient:")


@contextlib.contextmanager
def server(parallel: int, args: argparse.Namespace):
    """A ds4-server subprocess on a free port, yielded as its base URL once /health is 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, DS4_SERVER_SCHED_PREFILL_MS=str(args.prefill_ms))
    cmd = [sys.executable, "-m", "ds4.cli.server", "--backend", args.backend, "--port", str(port),
           "--parallel", str(parallel), "--prefill-chunk", str(args.prefill_chunk), "--ctx", "8192",
           *model_flags(args)]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc, log, args.load_timeout)
            stream(url, "Say hi", 4)  # warm-up: first-request costs stay out of the numbers
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def model_flags(args: argparse.Namespace) -> list[str]:
    """ds4-server's model flags: --model, --load-format (unless auto), --gpu-memory-gib and
    --gpus, each only when given."""
    flags = ["--model", args.model] if args.model else []
    flags += ["--load-format", args.load_format] if args.load_format != "auto" else []
    flags += ["--gpus", str(args.gpus)] if args.gpus else []
    return flags + (["--gpu-memory-gib", str(args.gpu_memory_gib)] if args.gpu_memory_gib else [])


def wait_healthy(url: str, proc: subprocess.Popen, log, timeout: float = 120) -> None:
    """Poll GET /health until 200; fail with the server's output if it exits or stalls."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    log.seek(0)
    raise RuntimeError(f"ds4-server did not come up:\n{log.read().decode(errors='replace')}")


def stream(url: str, prompt: str, max_tokens: int, on_token=None,
           temperature: float = 0.0) -> dict:
    """Stream one chat turn (greedy unless temperature > 0); return send time, content-chunk
    arrival times and tokens."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    out = {"sent": time.monotonic(), "times": [], "tokens": 0}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=None) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                out["tokens"] = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                out["times"].append(time.monotonic())
                if on_token:
                    on_token(len(out["times"]))
    return out


def prompt_b(tokenizer: Tokenizer, n_tokens: int, seed: int) -> str:
    """Varied text of n_tokens tokens (a new seed per repeat, so no slot reuses a prefix)."""
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS.split()) for _ in range(2 * n_tokens))
    return tokenizer.decode(tokenizer.encode(text)[:n_tokens])


def one_run(url: str, args: argparse.Namespace, text_b: str) -> dict:
    """A streams; at its --b-after'th token B starts in a thread; return both clients' measures."""
    results: dict = {}
    b_thread = threading.Thread(target=lambda: results.__setitem__(
        "b", stream(url, text_b, args.tokens_b)))
    a = stream(url, PROMPT_A, args.tokens_a,
               on_token=lambda n: b_thread.start() if n == args.b_after else None)
    if not b_thread.is_alive() and "b" not in results:
        raise RuntimeError(f"A ended after {len(a['times'])} tokens, before --b-after")
    b_thread.join()
    return measures(a, results["b"])


def measures(a: dict, b: dict) -> dict:
    """B's TTFT and total, A's worst gap while B prefills, totals, tokens and decode rates."""
    b_first = b["times"][0]
    window = [t for t in a["times"] if b["sent"] <= t <= b_first]
    gaps = [y - x for x, y in zip([b["sent"]] + window, window)]
    before = [t for t in a["times"] if t < b["sent"]]
    steady = [y - x for x, y in zip(before[1:], before[2:])]  # the first gap holds A's TTFT
    return {"B TTFT (s)": b_first - b["sent"], "B total (s)": b["times"][-1] - b["sent"],
            "A worst gap during B prefill (s)": max(gaps, default=0.0),
            "A gap before B (s)": statistics.median(steady) if steady else 0.0,
            "A total (s)": a["times"][-1] - a["sent"],
            "A tokens": a["tokens"], "A decode tok/s": rate(a), "B tokens": b["tokens"],
            "B decode tok/s": rate(b)}


def rate(client: dict) -> float:
    """Tokens per second from the first content chunk to the last."""
    t = client["times"]
    return (client["tokens"] - 1) / (t[-1] - t[0]) if t[-1] > t[0] else 0.0


def table(med: dict[int, dict]) -> str:
    """Rows of measure, --parallel 1, --parallel 2 and the ratio p2/p1."""
    rows = [f"| {'measure':34} | {'--parallel 1':>12} | {'--parallel 2':>12} | {'p2/p1':>6} |",
            f"|{'-' * 36}|{'-' * 13}:|{'-' * 13}:|{'-' * 7}:|"]
    for key, one in med[1].items():
        two = med[2][key]
        ratio = f"{two / one:.2f}x" if one else "-"
        fmt = ".0f" if "tokens" in key and "tok/s" not in key else ".2f"
        rows.append(f"| {key:34} | {one:>12{fmt}} | {two:>12{fmt}} | {ratio:>6} |")
    return "\n".join(rows)


FLAGS = (("--tokens-a", int, 400, "A's generation length"),
         ("--tokens-b", int, 20, "B's generation length"),
         ("--prompt-b-tokens", int, 3000, "B's prompt length"),
         ("--b-after", int, 50, "A's tokens before B is sent"),
         ("--prefill-ms", float, 200, "DS4_SERVER_SCHED_PREFILL_MS"),
         ("--prefill-chunk", int, 64, "ds4-server --prefill-chunk"),
         ("--repeat", int, 3, "runs per server; medians are shown"),
         ("--load-timeout", float, 900, "seconds a server may take to load"))


def parser() -> argparse.ArgumentParser:
    """The benchmark's flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, kind, default, text in FLAGS:
        p.add_argument(flag, type=kind, default=default, help=f"{text} (default {default})")
    p.add_argument("--model", help="ds4-server --model (default: the tiny model); a model this "
                   "size runs the two servers one after the other, not side by side")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    p.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="numpy")
    p.add_argument("--gpu-memory-gib", type=float, default=None)
    p.add_argument("--gpus", type=int, default=None, help="ds4-server --gpus N (expert "
                   "parallel); with --streams the bound stays one GPU's: every byte at one "
                   "device's copy rate, so a group may pass 100%%")
    p.add_argument("--sequential", action="store_true", help="run the --parallel 1 server, "
                   "then the --parallel 2 one (implied by --model)")
    return p


def medians(args: argparse.Namespace) -> dict[int, dict]:
    """Start both servers, alternate the repeats between them, return each one's medians."""
    tokenizer = Tokenizer.for_model(args.model or default_model_dir())  # builds the tiny one
    runs: dict[int, list[dict]] = {1: [], 2: []}
    if args.model or args.sequential:  # two full-size servers cannot share one GPU
        for parallel in (1, 2):
            with server(parallel, args) as url:
                for i in range(args.repeat):
                    text_b = prompt_b(tokenizer, args.prompt_b_tokens, seed=i)
                    runs[parallel].append(one_run(url, args, text_b))
        return _medians(runs)
    with server(1, args) as url1, server(2, args) as url2:
        for i in range(args.repeat):
            text_b = prompt_b(tokenizer, args.prompt_b_tokens, seed=i)
            for parallel, url in ((1, url1), (2, url2)):
                runs[parallel].append(one_run(url, args, text_b))
    return _medians(runs)


def _medians(runs: dict[int, list[dict]]) -> dict[int, dict]:
    return {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}


def settings(args: argparse.Namespace, load: float) -> str:
    """The line that says what was run, on what, under which load."""
    model = f"{args.model} ({args.load_format})" if args.model else "tiny model"
    return (f"{model}, {args.backend}, {os.cpu_count()} CPUs; A: {args.tokens_a} tokens greedy; "
            f"B: {args.prompt_b_tokens}-token prompt sent at A's token {args.b_after}, "
            f"{args.tokens_b} tokens; --prefill-chunk {args.prefill_chunk}, "
            f"DS4_SERVER_SCHED_PREFILL_MS={args.prefill_ms:g}, decode burst "
            f"{SchedulerConfig.from_env().decode_tokens} tokens; median of {args.repeat}; "
            f"load average {load:.2f} at start, {os.getloadavg()[0]:.2f} at end")


def main(argv: list[str] | None = None) -> int:
    """Measure, then print the settings and the table."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--streams" or a.startswith("--streams=") for a in argv):
        return streams_main(argv)
    args = parser().parse_args(argv)
    load = os.getloadavg()[0]
    med = medians(args)
    print(settings(args, load))
    print(table(med))
    print(goals(med[2], args.prefill_ms, SchedulerConfig.from_env().decode_tokens))
    return 0


def goals(two: dict, prefill_ms: float, burst: int) -> str:
    """The --parallel 2 figures against the goals: B's TTFT <= 1 s; A's worst gap <= one
    prefill slice + one decode burst (burst tokens at A's own gap before B arrived)."""
    bound = prefill_ms / 1000 + burst * two["A gap before B (s)"]
    ttft, gap = two["B TTFT (s)"], two["A worst gap during B prefill (s)"]
    return (f"goal at --parallel 2: B's TTFT {ttft:.2f} s <= 1 s: "
            f"{'met' if ttft <= 1 else 'missed'}\n"
            f"goal at --parallel 2: A's worst gap {gap:.3f} s <= prefill slice "
            f"{prefill_ms / 1000:.3f} s + decode burst {burst} x "
            f"{two['A gap before B (s)']:.4f} s = {bound:.3f} s: "
            f"{'met' if gap <= bound else 'missed'}")


STREAM_PROMPTS = ("Tell me a long story about a fox who learns to sail.",
                  "Describe the water cycle for a child.", "Write a letter to a future city.",
                  "Explain how a compass works.", "List the moons you can name and why.",
                  "Invent a recipe with lanterns and copper.", "Narrate a ferry crossing at dawn.",
                  "Teach me the rules of a made-up game.")


def concurrent_streams(url: str, n: int, tokens: int, temperature: float = 0.0) -> dict:
    """n streams (greedy unless temperature > 0) started together: aggregate tok/s from the
    first token to the last."""
    results: dict[int, dict] = {}
    start = threading.Barrier(n)

    def client(i: int) -> None:
        start.wait()
        results[i] = stream(url, STREAM_PROMPTS[i % len(STREAM_PROMPTS)] + f" ({i})", tokens,
                            temperature=temperature)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = min(r["times"][0] for r in results.values())
    last = max(r["times"][-1] for r in results.values())
    total = sum(r["tokens"] for r in results.values())
    return {"streams": n, "tokens": total, "aggregate tok/s": (total - n) / (last - first),
            "per-stream tok/s": statistics.median(rate(r) for r in results.values())}


def batch_sizes(url: str) -> tuple[float, float]:
    """(engine decode steps, sessions decoded) so far, from the ds4_decode_batch_size histogram."""
    lines = httpx.get(url + "/metrics").text.splitlines()

    def value(name: str) -> float:
        return next((float(ln.split()[-1]) for ln in lines if ln.startswith(name)), 0.0)
    return value("ds4_decode_batch_size_count"), value("ds4_decode_batch_size_sum")


def streams_main(argv: list[str]) -> int:
    """--streams 1,2,4,8: aggregate decode rate of N concurrent streams (median of --repeat)."""
    p = parser()
    p.add_argument("--streams", required=True, help="concurrent stream counts, comma separated")
    p.add_argument("--stream-tokens", type=int, default=64, help="tokens per stream (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy streams; above "
                   "it each job samples its tokens (one by one, on the device)")
    args = p.parse_args(argv)
    counts = [int(n) for n in args.streams.split(",")]
    Tokenizer.for_model(default_model_dir())  # builds the tiny model once, outside the timing
    rows = []
    with server(max(counts), args) as url:
        for n in counts:
            runs, steps0, rows0 = [], *batch_sizes(url)
            for _ in range(args.repeat):
                runs.append(concurrent_streams(url, n, args.stream_tokens, args.temperature))
            steps, sessions = batch_sizes(url)
            row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            row["mean batch"] = (sessions - rows0) / max(1.0, steps - steps0)
            rows.append(row)
    bandwidth = decode_bounds(args, rows)  # after the server stopped: its device is free
    kind = "greedy" if args.temperature <= 0 else f"temperature {args.temperature:g}"
    print(f"{args.stream_tokens} {kind} tokens per stream, one server of --parallel "
          f"{max(counts)}, median of {args.repeat}; load average {os.getloadavg()[0]:.2f}; "
          f"bound read at the copy rate {bandwidth / 1e9:.1f} GB/s")
    print(f"| {'streams':>7} | {'aggregate tok/s':>15} | {'x 1 stream':>10} | "
          f"{'per-stream tok/s':>16} | {'mean batch':>10} | {'bound tok/s':>11} | "
          f"{'of bound':>8} |")
    print("|" + "|".join("-" * w for w in (9, 17, 12, 18, 12, 13, 10)) + "|")
    base = rows[0]["aggregate tok/s"]
    for r in rows:
        print(f"| {r['streams']:>7} | {r['aggregate tok/s']:>15.1f} | "
              f"{r['aggregate tok/s'] / base:>9.2f}x | {r['per-stream tok/s']:>16.1f} | "
              f"{r['mean batch']:>10.2f} | {r['bound tok/s']:>11.1f} | "
              f"{100 * r['aggregate tok/s'] / r['bound tok/s']:>7.1f}% |")
    return 0


def decode_bounds(args: argparse.Namespace, rows: list[dict]) -> float:
    """Give each row the tok/s its mean decode batch b could reach if a step only read its
    bytes (tools/bench_batch.py's bound: every non-expert weight once, each distinct routed
    expert once, uniform routing's E (1 - (1 - k/E)^b) of them, all at this device's copy
    rate; an expert counts its device-held bytes only, so with experts in host memory the
    bound is optimistic): b / (bytes / rate). The bytes come from an engine of the server's
    model opened here; returns the copy rate."""
    engine = Engine.open(args.model or default_model_dir(), backend=args.backend,
                         load_format=args.load_format, gpu_memory_gib=args.gpu_memory_gib,
                         prefill_chunk=args.prefill_chunk, gpus=args.gpus)
    bandwidth, per_expert = copy_bandwidth(engine.backend.xp), expert_bytes(engine)
    for r in rows:
        b = max(1.0, r["mean batch"])
        moved = bound_bytes(engine, round(b), distinct_experts([], engine.config, b), per_expert)
        r["bound tok/s"] = b * bandwidth / moved
    return bandwidth


if __name__ == "__main__":
    sys.exit(main())
