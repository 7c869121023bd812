"""Poisson-arrival load against a running ds4-server (or any OpenAI/Anthropic server),
printed in the shape of `vllm bench serve` so the numbers compare.

Prompts are random words cut to a sampled token count (the V4 tokenizer), outputs are capped
at a sampled max_tokens; requests stream, and each content chunk counts as a token arrival.

    python3 tools/bench_serve.py --base-url http://127.0.0.1:8000 --num-prompts 50 \
        --request-rate 2 --random-input-len 256 --random-output-len 64 --goodput ttft:2000 tpot:50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from ds4.jobs.latency import JobTiming, summary
from ds4.tokenizer import Tokenizer

WORDS = ("river stone lantern harvest copper meadow thunder quiet orchard signal ferry marble "
         "winter cedar violin compass glacier ember saddle harbor the of and whispered north")
ROUTES = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions",
          "anthropic": "/v1/messages"}
ANTHROPIC_INPUT = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
SLO_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2el": "latency"}


@dataclass
class Outcome:
    """One request: whether it succeeded, its token counts and its times."""

    ok: bool
    timing: JobTiming
    error: str = ""


def prompts(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(prompt text, its token count, max_tokens) per request, from the length ranges."""
    rng, tok = random.Random(args.seed), Tokenizer.for_model(args.tokenizer)
    out = []
    for _ in range(args.num_prompts):
        n_in = sampled_length(rng, args.random_input_len, args.random_range_ratio)
        n_out = sampled_length(rng, args.random_output_len, args.random_range_ratio)
        words = " ".join(rng.choice(WORDS.split()) for _ in range(2 * n_in))
        ids = tok.encode(words)[:n_in]
        out.append((tok.decode(ids), len(ids), n_out))
    return out


def sampled_length(rng: random.Random, mean: int, ratio: float) -> int:
    """A length uniform in [mean·(1-ratio), mean·(1+ratio)], at least 1 (vLLM's random set)."""
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


def body(args: argparse.Namespace, prompt: str, max_tokens: int) -> dict:
    """The request body of the chosen route, streamed, with usage in the stream."""
    common = {"model": args.model, "max_tokens": max_tokens, "temperature": args.temperature,
              "stream": True}
    if args.backend == "anthropic":
        return {**common, "messages": [{"role": "user", "content": prompt}]}
    usage = {"stream_options": {"include_usage": True}}
    if args.backend == "openai":
        return {**common, **usage, "prompt": prompt}
    return {**common, **usage, "messages": [{"role": "user", "content": prompt}]}


def chunk_tokens(backend: str, event: dict) -> tuple[bool, int | None, int | None]:
    """(carries generated content, prompt tokens, output tokens) of one stream event."""
    if backend == "anthropic":
        kind = event.get("type")
        usage = (event.get("message") or {}).get("usage") or event.get("usage") or {}
        prompt = sum(usage.get(k) or 0 for k in ANTHROPIC_INPUT) if "input_tokens" in usage \
            else None  # the prompt is all three shares
        return kind == "content_block_delta", prompt, \
            usage.get("output_tokens") if kind == "message_delta" else None
    usage = event.get("usage") or {}
    choice = (event.get("choices") or [{}])[0]
    delta = choice.get("delta") or {}
    content = choice.get("text") or delta.get("content") or delta.get("reasoning_content") \
        or delta.get("tool_calls")
    return bool(content), usage.get("prompt_tokens"), usage.get("completion_tokens")


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, origin: float,
                      prompt: tuple[str, int, int]) -> Outcome:
    """Stream one request; note the arrival of every content chunk and the usage counts."""
    text, n_in, n_out = prompt
    timing = JobTiming(time.perf_counter() - origin, prompt_tokens=n_in)
    try:
        async with client.stream("POST", ROUTES[args.backend],
                                 json=body(args, text, n_out)) as r:
            if r.status_code != 200:
                return Outcome(False, timing, f"HTTP {r.status_code}: {(await r.aread())!r}")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    read_event(args.backend, json.loads(line[6:]), timing, origin)
    except httpx.HTTPError as exc:
        return Outcome(False, timing, f"{type(exc).__name__}: {exc}")
    timing.ended = time.perf_counter() - origin
    return Outcome(bool(timing.token_times), timing, "" if timing.token_times else "no tokens")


def read_event(backend: str, event: dict, timing: JobTiming, origin: float) -> None:
    """Fold one stream event into the request's timing."""
    content, n_in, n_out = chunk_tokens(backend, event)
    if content:
        timing.token_times.append(time.perf_counter() - origin)
    if n_in is not None:
        timing.prompt_tokens = n_in
    if n_out is not None:
        timing.counted = n_out


async def ready(client: httpx.AsyncClient, seconds: float) -> None:
    """Wait until the server serves: ds4's /health answers 200 (a server without /health:
    its /v1/models does); SystemExit when its load failed or `seconds` pass first."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            health = await client.get("/health")
            if health.status_code == 200 or (health.status_code == 404 and
                                             (await client.get("/v1/models")).is_success):
                return
            if health.status_code == 503 and "error" in health.text:  # ds4: the load failed
                raise SystemExit(f"bench_serve: {base_url_of(client)}: {health.text.strip()}")
        except httpx.HTTPError:
            pass  # not listening yet
        if time.monotonic() >= deadline:
            raise SystemExit(f"bench_serve: {base_url_of(client)} not ready after {seconds:.0f} s")
        await asyncio.sleep(0.5)


def base_url_of(client: httpx.AsyncClient) -> str:
    """The server's base URL, for messages."""
    return str(client.base_url).rstrip("/")


async def warm_up(client: httpx.AsyncClient, args: argparse.Namespace,
                  prompt: tuple[str, int, int]) -> None:
    """--num-warmups requests of the first prompt, --max-concurrency at a time, not counted
    (kernel compilation, graph capture and allocator growth stay out of the figures)."""
    limit = asyncio.Semaphore(args.max_concurrency or args.num_warmups or 1)

    async def one() -> Outcome:
        async with limit:
            return await one_request(client, args, time.perf_counter(), prompt)

    done = await asyncio.gather(*(one() for _ in range(args.num_warmups)))
    failed = [o.error for o in done if not o.ok]
    print(f"bench_serve: {args.num_warmups} warm-up request(s), {len(failed)} failed",
          *failed[:1], file=sys.stderr)


async def run(args: argparse.Namespace) -> tuple[list[Outcome], float]:
    """Wait for the server, warm it up, then send every request at Poisson arrivals (bounded
    by --max-concurrency); the outcomes and the wall time."""
    work = prompts(args)
    rng = np.random.default_rng(args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(work) or 1)
    headers = {"Authorization": f"Bearer {args.api_key}", "x-api-key": args.api_key} \
        if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url, timeout=None, headers=headers,
                                 limits=httpx.Limits(max_connections=None)) as client:
        await ready(client, args.ready_check_timeout_sec)
        if args.num_warmups and work:
            await warm_up(client, args, work[0])
        origin = time.perf_counter()

        async def bounded(prompt: tuple[str, int, int]) -> Outcome:
            async with limit:
                return await one_request(client, args, origin, prompt)

        tasks = []
        for prompt in work:
            tasks.append(asyncio.create_task(bounded(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.gamma(args.burstiness,
                                              1.0 / (args.request_rate * args.burstiness)))
        outcomes = await asyncio.gather(*tasks)
    return list(outcomes), time.perf_counter() - origin


def slo(text: list[str]) -> dict[str, float]:
    """--goodput KEY:MS pairs as seconds per JobTiming attribute."""
    out = {}
    for pair in text:
        key, _, value = pair.partition(":")
        if key not in SLO_KEYS or not value:
            raise argparse.ArgumentTypeError(f"--goodput takes ttft|tpot|e2el:MS, got {pair!r}")
        out[SLO_KEYS[key]] = float(value) / 1000.0
    return out


def good(timing: JobTiming, limits: dict[str, float]) -> bool:
    """True when the request met every SLO (a TPOT of a one-token reply meets any)."""
    return all((getattr(timing, attr) or 0.0) <= bound for attr, bound in limits.items())


def line(label: str, value: object) -> str:
    """One result row, aligned as vLLM prints them."""
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}".rstrip()
    return f"{label:<40} {value!s:<10}".rstrip()


def section(title: str, char: str = "-") -> str:
    """A centred section rule."""
    return f"{title:{char}^50}"


Entry = str | tuple[str, object]  # a section title, or a (label, value) row


def result_entries(args: argparse.Namespace, outcomes: list[Outcome], wall: float
                   ) -> list[Entry]:
    """The rows of vLLM's table, in its order, with its section titles."""
    done = [o.timing for o in outcomes if o.ok]
    s = summary(done)
    limits = slo(args.goodput)
    tokens_in, tokens_out = s.get("input_tokens", 0), s.get("output_tokens", 0)
    out: list[Entry] = [("Successful requests:", len(done)),
                        ("Failed requests:", len(outcomes) - len(done))]
    if args.max_concurrency is not None:
        out.append(("Maximum request concurrency:", args.max_concurrency))
    out += [("Request rate configured (RPS):", float(args.request_rate)),
            ("Benchmark duration (s):", wall), ("Total input tokens:", tokens_in),
            ("Total generated tokens:", tokens_out),
            ("Request throughput (req/s):", len(done) / wall)]
    if limits:
        out.append(("Request goodput (req/s):", sum(good(t, limits) for t in done) / wall))
    out += [("Output token throughput (tok/s):", tokens_out / wall),
            ("Total Token throughput (tok/s):", (tokens_out + tokens_in) / wall)]
    for title, short, key in (("Time to First Token", "TTFT", "ttft_s"),
                              ("Time per Output Token (excl. 1st token)", "TPOT", "tpot_s"),
                              ("Inter-token Latency", "ITL", "itl_s"),
                              ("End-to-end Latency", "E2EL", "e2el_s")):
        out += metric_entries(title, short, s.get(key) or {}, args.metric_percentiles)
    return out


def metric_entries(title: str, short: str, stats: dict, percentiles: str) -> list[Entry]:
    """Mean, median and the asked percentiles of one metric, in milliseconds."""
    ms = lambda key: stats.get(key, 0.0) * 1000.0  # noqa: E731
    rows: list[Entry] = [title, (f"Mean {short} (ms):", ms("mean")),
                         (f"Median {short} (ms):", ms("p50"))]
    return rows + [(f"P{p} {short} (ms):", ms(f"p{p}")) for p in percentiles.split(",")]


def result_lines(entries: list[Entry]) -> list[str]:
    """The vLLM-shaped table."""
    body = [section(e) if isinstance(e, str) else line(*e) for e in entries]
    return [section(" Serving Benchmark Result ", "="), *body, "=" * 50]


def table_of(entries: list[Entry]) -> dict[str, object]:
    """The rows as label → value (the --save-result "table"; --compare reads it)."""
    return {e[0].rstrip(":"): e[1] for e in entries if not isinstance(e, str)}


def compare(paths: list[str]) -> list[str]:
    """A markdown table of several --save-result files, one column each (docs/PERF.md)."""
    tables = [json.loads(Path(p).read_text(encoding="utf-8"))["table"] for p in paths]
    labels = [k for k in tables[0] if k not in ("Successful requests", "Failed requests")]
    heads = [Path(p).stem for p in paths]
    out = [f"| {'metric':33} | " + " | ".join(f"{h:>12}" for h in heads) + " |",
           f"|{'-' * 35}|" + "|".join("-" * 13 + ":" for _ in heads) + "|"]
    for label in labels:
        cells = [cell(t.get(label)) for t in tables]
        out.append(f"| {label:33} | " + " | ".join(f"{c:>12}" for c in cells) + " |")
    return out


def cell(value: object) -> str:
    """A markdown cell: floats to two decimals, "-" when a file lacks the row."""
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def parser() -> argparse.ArgumentParser:
    """The benchmark's flags (vLLM's names where it has one)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--backend", choices=sorted(ROUTES), default="openai-chat",
                   help="route: /v1/chat/completions, /v1/completions or /v1/messages")
    p.add_argument("--model", default="deepseek-chat", help="model name sent in requests")
    p.add_argument("--api-key")
    p.add_argument("--tokenizer", help="model directory whose tokenizer sizes the prompts")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps; 1 is Poisson")
    p.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    p.add_argument("--num-warmups", type=int, default=0,
                   help="uncounted requests sent first (the first prompt)")
    p.add_argument("--ready-check-timeout-sec", type=float, default=600,
                   help="wait this long for the server to serve (/health) before starting")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in len·(1±ratio)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="*", default=["ttft:2000", "tpot:50"],
                   metavar="KEY:MS", help="SLOs a good request meets: ttft, tpot, e2el in ms")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--save-result", metavar="FILE.json", help="write the table and the "
                   "per-request figures")
    p.add_argument("--compare", nargs="+", metavar="FILE.json", help="send nothing: print "
                   "these --save-result files as one markdown table, a column each")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the load, print the table; exit 1 when any request failed. With --compare, print
    the saved results side by side instead."""
    args = parser().parse_args(argv)
    if args.compare:
        print("\n".join(compare(args.compare)))
        return 0
    slo(args.goodput)  # a bad --goodput is said before any request
    outcomes, wall = asyncio.run(run(args))
    entries = result_entries(args, outcomes, wall)
    print("\n".join(result_lines(entries)))
    for o in outcomes:
        if not o.ok:
            print(f"failed: {o.error}", file=sys.stderr)
    if args.save_result:
        with open(args.save_result, "w", encoding="utf-8") as f:
            json.dump({"table": table_of(entries),
                       "summary": summary([o.timing for o in outcomes if o.ok]),
                       "requests": [o.timing.per_job() for o in outcomes]}, f, indent=2)
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
