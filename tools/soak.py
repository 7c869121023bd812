"""Soak a running ds4-server with well-formed, malformed, vanishing and slow clients, then check
that it came out whole: no 5xx for any request, slow clients released, every slot idle and the
queue empty, and the server's resident memory within a stated bound.

    ds4-server --parallel 4 --client-timeout 2 &
    PYTHONPATH=. python3 tools/soak.py --url http://127.0.0.1:8000 --clients 8 --requests 50

Prints the figures (requests by kind and status, latency, slow-client hold times, RSS before,
peak and after) and exits 1 when a check fails. Loopback servers only.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from urllib.parse import urlparse

import httpx

MODEL = "deepseek-chat"  # thinking off: short answers
LONE = "hi \ud800"  # json.dumps writes the lone surrogate as its escape
GOOD_KINDS = ("chat", "completions", "responses", "messages")
BAD_BODIES = [
    ("/v1/chat/completions", "{not json"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": LONE}]})),
    ("/v1/chat/completions", json.dumps({"model": LONE, "messages": []})),
    ("/v1/chat/completions", json.dumps({"messages": "hi"})),
    ("/v1/chat/completions", '{"messages": [], "temperature": NaN}'),
    ("/v1/completions", json.dumps({"prompt": LONE, "stop": [LONE]})),
    ("/v1/responses", json.dumps({"input": [{"role": "user", "content": LONE}]})),
    ("/v1/responses", json.dumps({"input": 5})),
    ("/v1/messages", json.dumps({"max_tokens": 4, "system": LONE, "messages": []})),
    ("/v1/messages", json.dumps({"max_tokens": 4, "messages": [{"role": "robot"}]})),
    ("/v1/messages/count_tokens", json.dumps({"messages": [{"role": "user", "content": LONE}]})),
    ("/v1/models/" + "x" * 300, None),
]


def good_request(kind: str, text: str, max_tokens: int, stream: bool) -> tuple[str, dict]:
    """(path, body) of a well-formed request of one protocol."""
    messages = [{"role": "user", "content": text}]
    if kind == "chat":
        return "/v1/chat/completions", {"model": MODEL, "messages": messages,
                                        "max_tokens": max_tokens, "stream": stream}
    if kind == "completions":
        return "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": max_tokens,
                                   "stream": stream}
    if kind == "responses":
        return "/v1/responses", {"model": MODEL, "input": text,
                                 "max_output_tokens": max_tokens, "stream": stream}
    return "/v1/messages", {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                            "stream": stream}


class Tally:
    """Outcomes of all clients (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.latency: list[float] = []
        self.failures: list[str] = []

    def add(self, kind: str, status: int, seconds: float, expect_2xx: bool) -> None:
        """Count one request; a 5xx, or a non-2xx where one was due, is a failure."""
        with self.lock:
            self.counts[(kind, f"{status // 100}xx")] += 1
            if kind == "good":
                self.latency.append(seconds)
            if status >= 500 or (expect_2xx and not 200 <= status < 300):
                self.failures.append(f"{kind} request answered {status}")

    def fail(self, what: str) -> None:
        """Record a failure that has no status (a transport error)."""
        with self.lock:
            self.failures.append(what)


class SoakClient:
    """One keep-alive client sending `requests` requests of a random mix."""

    def __init__(self, args: argparse.Namespace, tally: Tally, seed: int):
        self.args = args
        self.tally = tally
        self.rng = random.Random(seed)
        self.http = httpx.Client(base_url=args.url, timeout=args.request_timeout)

    def run(self) -> None:
        """All this client's requests; a transport error is a failure, never fatal."""
        with self.http:
            for _ in range(self.args.requests):
                kind = self.pick()
                try:
                    getattr(self, kind)()
                except httpx.HTTPError as exc:
                    self.tally.fail(f"{kind} request: {type(exc).__name__}: {exc}")

    def pick(self) -> str:
        """The next request's kind, by the shares on the command line."""
        a, r = self.args, self.rng.random()
        for kind, share in (("bad", a.bad_share), ("cut", a.cut_share), ("large", a.large_share)):
            if r < share:
                return kind
            r -= share
        return "good"

    def good(self) -> None:
        """A well-formed request, streamed or not, read to its end: must be a 2xx."""
        kind = self.rng.choice(GOOD_KINDS)
        text = f"Say hi to client {self.rng.randrange(1000)}"
        path, body = good_request(kind, text, self.args.max_tokens, self.rng.random() < 0.5)
        start = time.monotonic()
        with self.http.stream("POST", path, json=body) as r:
            r.read()
        self.tally.add("good", r.status_code, time.monotonic() - start, expect_2xx=True)

    def cut(self) -> None:
        """A stream the client abandons after its first bytes."""
        kind = self.rng.choice(GOOD_KINDS)
        path, body = good_request(kind, "Tell a long story", 64, stream=True)
        start = time.monotonic()
        with httpx.Client(base_url=self.args.url, timeout=self.args.request_timeout) as once:
            with once.stream("POST", path, json=body) as r:
                next(r.iter_bytes(), None)
        self.tally.add("cut", r.status_code, time.monotonic() - start, expect_2xx=True)

    def bad(self) -> None:
        """A malformed body (or path): any 4xx will do, a 5xx is a failure."""
        path, content = self.rng.choice(BAD_BODIES)
        start = time.monotonic()
        if content is None:
            r = self.http.get(path)
        else:
            r = self.http.post(path, content=content, headers={"content-type": "application/json"})
        self.tally.add("bad", r.status_code, time.monotonic() - start, expect_2xx=False)

    def large(self) -> None:
        """A prompt far past the context: tokenized, then refused with a 4xx."""
        words = [f"w{self.rng.randrange(100000)}" for _ in range(self.args.large_bytes // 7)]
        body = {"model": MODEL, "messages": [{"role": "user", "content": " ".join(words)}],
                "max_tokens": 4}
        start = time.monotonic()
        r = self.http.post("/v1/chat/completions", json=body)
        self.tally.add("large", r.status_code, time.monotonic() - start, expect_2xx=False)


def slow_client(host: str, port: int, gap_s: float, limit_s: float, held: list[float]) -> None:
    """Trickle a request one byte per `gap_s` until the server closes (or `limit_s` passed);
    record how long that took."""
    start = time.monotonic()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\ncontent-length: 4096\r\n\r\n"
    try:
        with socket.create_connection((host, port), timeout=gap_s) as sock:
            for byte in head + b"x" * 4096:
                sock.sendall(bytes([byte]))
                if closed_within(sock, gap_s) or time.monotonic() - start > limit_s:
                    break
    except OSError:
        pass  # the server reset the connection: it let go of it
    held.append(time.monotonic() - start)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True once the server answered or closed (data or EOF) within `seconds`."""
    sock.settimeout(seconds)
    try:
        sock.recv(65536)
        return True
    except TimeoutError:
        return False


def metric(url: str, name: str) -> float:
    """One sample of the server's /metrics (0 when absent)."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.split()[-1])
    return 0.0


def rss(url: str) -> float:
    """The server process's resident memory in MiB."""
    return metric(url, "process_resident_memory_bytes") / 2**20


class RssWatch:
    """Samples the server's RSS every half second while the soak runs."""

    def __init__(self, url: str):
        self.url = url
        self.peak = rss(url)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        """Sample until stopped."""
        while not self.done.wait(0.5):
            self.peak = max(self.peak, rss(self.url))

    def stop(self) -> float:
        """Stop sampling; the peak seen (MiB)."""
        self.done.set()
        self.thread.join()
        return self.peak


def settled(url: str, seconds: float) -> tuple[bool, str]:
    """Whether every slot went idle and the queue emptied within `seconds`; what was seen."""
    deadline = time.monotonic() + seconds
    while True:
        busy = [s["id"] for s in httpx.get(url + "/slots", timeout=10).json()["slots"]
                if s["busy"]]
        queue, busy_gauge = metric(url, "ds4_queue_depth"), metric(url, "ds4_busy_slots")
        seen = f"busy slots {busy}, ds4_queue_depth {queue:g}, ds4_busy_slots {busy_gauge:g}"
        if not busy and queue == 0 and busy_gauge == 0:
            return True, seen
        if time.monotonic() > deadline:
            return False, seen
        time.sleep(0.2)


def warm_up(args: argparse.Namespace) -> None:
    """One request per protocol first, so RSS "before" counts the engine's buffers in use."""
    for kind in GOOD_KINDS:
        path, body = good_request(kind, "warm up", args.max_tokens, stream=False)
        httpx.post(args.url + path, json=body, timeout=args.request_timeout).raise_for_status()


def slow_bound(args: argparse.Namespace) -> float:
    """Seconds within which the server must let a slow client go."""
    return 3 * args.client_timeout + 2


def run_clients(args: argparse.Namespace, tally: Tally) -> list[float]:
    """Every soak client and slow client to its end; the slow clients' hold times."""
    url = urlparse(args.url)
    held: list[float] = []
    threads = [threading.Thread(target=SoakClient(args, tally, args.seed + i).run)
               for i in range(args.clients)]
    limit = 2 * slow_bound(args)
    threads += [threading.Thread(target=slow_client,
                                 args=(url.hostname, url.port, args.slow_gap, limit, held))
                for _ in range(args.slow_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return held


def report(tally: Tally, held: list[float], rss_mib: tuple[float, float, float],
           seconds: float) -> None:
    """The soak's figures."""
    total = sum(tally.counts.values())
    print(f"soak: {total} requests in {seconds:.1f} s")
    for (kind, status), n in sorted(tally.counts.items()):
        print(f"  {kind:6s} {status}: {n}")
    if tally.latency:
        lat = sorted(tally.latency)
        p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))]
        print(f"  good latency: median {statistics.median(lat):.2f} s, p95 {p95:.2f} s")
    if held:
        print(f"  slow clients: {len(held)}, held at most {max(held):.1f} s")
    before, peak, after = rss_mib
    print(f"  rss: before {before:.0f} MiB, peak {peak:.0f} MiB, after {after:.0f} MiB "
          f"({(after / before - 1) * 100:+.0f}%)")


def checks(args: argparse.Namespace, tally: Tally, held: list[float],
           rss_mib: tuple[float, float, float]) -> list[str]:
    """What went wrong (empty when the server came out whole)."""
    problems = list(tally.failures)
    bound = slow_bound(args)
    problems += [f"a slow client was held {h:.1f} s (bound {bound:.1f} s)"
                 for h in held if h > bound]
    ok, seen = settled(args.url, args.settle)
    if not ok:
        problems.append(f"not idle {args.settle:g} s after the soak: {seen}")
    before, _, after = rss_mib
    if after > before * (1 + args.rss_growth):
        problems.append(f"rss grew {(after / before - 1) * 100:.0f}% "
                        f"(bound {args.rss_growth * 100:.0f}%)")
    return problems


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--url", default="http://127.0.0.1:8000", help="a loopback ds4-server")
    add("--clients", type=int, default=8, help="concurrent keep-alive clients (default 8)")
    add("--requests", type=int, default=50, help="requests per client (default 50)")
    add("--bad-share", type=float, default=0.3, help="malformed bodies (default 0.3)")
    add("--cut-share", type=float, default=0.15, help="streams cut short (default 0.15)")
    add("--large-share", type=float, default=0.05,
        help="prompts past the context, tokenized then refused (default 0.05)")
    add("--large-bytes", type=int, default=1_000_000, help="size of those (default 1e6)")
    add("--max-tokens", type=int, default=8, help="tokens per good request (default 8)")
    add("--slow-clients", type=int, default=4, help="clients trickling a request (default 4)")
    add("--slow-gap", type=float, default=2.0, help="seconds per trickled byte (default 2)")
    add("--client-timeout", type=float, default=10.0,
        help="the server's --client-timeout; slow clients must go within 3x + 2 s (default 10)")
    add("--rss-growth", type=float, default=0.5,
        help="allowed RSS growth after the soak, as a fraction of before (default 0.5)")
    add("--settle", type=float, default=30.0, help="seconds to wait for idle (default 30)")
    add("--request-timeout", type=float, default=300.0, help="per request (default 300)")
    add("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the soak; 0 when every check passed."""
    args = parser().parse_args(argv)
    if urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        print("soak: only loopback servers", file=sys.stderr)
        return 2
    warm_up(args)
    tally, start = Tally(), time.monotonic()
    before, watch = rss(args.url), RssWatch(args.url)
    held = run_clients(args, tally)
    settled(args.url, args.settle)  # RSS after: once the last jobs are gone
    rss_mib = (before, watch.stop(), rss(args.url))
    report(tally, held, rss_mib, time.monotonic() - start)
    problems = checks(args, tally, held, rss_mib)
    for problem in problems:
        print(f"soak: FAIL: {problem}")
    print("soak: PASS" if not problems else f"soak: {len(problems)} check(s) failed")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
