"""`ds4-replay --url`: re-send the jobs of a --trace file to a running server and compare.

Jobs are sent streamed, in arrival order, up to --parallel at a time (at their recorded gaps
with --timing original), so each reply's TTFT, ITL and TPOT are measured as vLLM's benchmarks
measure them: every chunk carrying generated output is a token arrival, and the reply's usage
counts its tokens. Token ids do not cross HTTP, so greedy and seeded jobs are compared
text-exactly: what a client sees of the reply must equal what the trace recorded, read through
the parser the server uses (the visible text, the reasoning where the protocol shows it, the
tool calls' names and arguments; call ids are fresh on every run), and the usage must count
the recorded number of tokens. Other jobs are sent too, since they shape the slots' caches,
and timed, but not compared. A trace is never replayed into the server that is writing it,
nor into a server whose model fingerprint (its /health) is not the trace's.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ds4.chat import parse_output
from ds4.chat.responses import LOCAL_SHELL, custom_input, local_shell_action, responses_call_kinds
from ds4.cli.replay_stream import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    RESPONSES,
    fold_stream,
    streamed_request,
)
from ds4.jobs.latency import JobTiming
from ds4.server.responses import SUMMARY_OPT_IN
from ds4.server.runtime import trace_file_id

Call = tuple[str, str, object]  # (kind: function | custom | local_shell, name, arguments)


@dataclass(frozen=True)
class Visible:
    """What a client sees of one reply; reasoning is None where the protocol hides it."""

    content: str
    reasoning: str | None = None
    tool_calls: tuple[Call, ...] = ()


@dataclass
class Report:
    """The outcome of a replay: jobs compared, jobs sent but not compared, differences."""

    compared: int = 0
    skipped: int = 0
    problems: list[str] = field(default_factory=list)
    not_sent: int = 0  # failed or cancelled jobs, and jobs whose request was not kept
    timings: dict[int, JobTiming] = field(default_factory=dict)
    outcomes: dict[int, str] = field(default_factory=dict)  # failed|differs|text-exact|timed

    def add(self, sent: Sent) -> None:
        """Count one request's outcome."""
        self.compared += sent.compared
        self.skipped += not sent.compared and not sent.problems
        self.problems += sent.problems
        self.timings[sent.seq] = sent.timing
        self.outcomes[sent.seq] = sent.outcome()

    def summary(self) -> str:
        """The closing line of ds4-replay."""
        unsent = f", {self.not_sent} not sent (failed or cancelled)" if self.not_sent else ""
        return (f"ds4-replay: {self.compared} job(s) compared, {self.skipped} skipped (not "
                f"greedy or seeded: timed only){unsent}, {len(self.problems)} problem(s) "
                "(compared text-exactly: token ids do not cross HTTP)")


class OwnTrace(Exception):
    """The server at the URL writes the very trace file being replayed."""


class ForeignModel(Exception):
    """The server at the URL serves another model than the one the trace was recorded with."""


def replayable(record: dict) -> bool:
    """Jobs that ended on their own (not cancelled, not failed) and whose request was kept."""
    return bool(record.get("raw_request") and record.get("endpoint")) and \
        record.get("finish_reason") in ("stop", "length", "tool_calls")


def deterministic(record: dict) -> bool:
    """Greedy jobs, and jobs whose request carried its own seed, must reproduce exactly."""
    if record["sampling"].get("temperature", 1.0) <= 0:
        return True
    return record["sampling"].get("seed") is not None


def arguments_value(text: str) -> object:
    """A call's arguments as a JSON value (the text itself when it is not JSON)."""
    try:
        return json.loads(text or "{}")
    except ValueError:
        return text


def shows_reasoning(endpoint: str, request: dict) -> bool:
    """Chat and Messages replies carry reasoning; Responses only when summaries were asked."""
    if endpoint == RESPONSES:
        reasoning = request.get("reasoning")
        return isinstance(reasoning, dict) and reasoning.get("summary") in SUMMARY_OPT_IN
    return endpoint in (CHAT, MESSAGES)


def recorded_call(endpoint: str, kinds: dict[str, str], name: str, arguments: str) -> Call:
    """A recorded call as the endpoint presents it (Responses: custom and local shell items)."""
    kind = kinds.get(name) if endpoint == RESPONSES else None
    if kind == "custom":
        return ("custom", name, custom_input(arguments))
    if kind == LOCAL_SHELL and (action := local_shell_action(arguments)) is not None:
        return ("local_shell", LOCAL_SHELL, action)
    value = arguments_value(arguments)
    if endpoint == MESSAGES and not isinstance(value, dict):
        value = {}  # a tool_use block's input is always an object
    return ("function", name, value)


def recorded_view(record: dict) -> Visible:
    """What a client saw of the recorded generation: raw text for completions, else the parse."""
    if record["endpoint"] == COMPLETIONS:
        return Visible(record["text"])
    endpoint, request = record["endpoint"], json.loads(record["raw_request"])
    out = parse_output(record["text"], thinking=record["thinking"],
                       tools_active=record["tools_active"])
    kinds = responses_call_kinds(request.get("tools")) if endpoint == RESPONSES else {}
    calls = tuple(recorded_call(endpoint, kinds, c.name, c.arguments) for c in out.tool_calls)
    reasoning = out.reasoning if shows_reasoning(endpoint, request) else None
    return Visible(out.content, reasoning, calls)


def chat_view(body: dict) -> Visible:
    """A chat completion's message."""
    msg = body["choices"][0]["message"]
    calls = tuple(("function", c["function"]["name"], arguments_value(c["function"]["arguments"]))
                  for c in msg.get("tool_calls") or [])
    return Visible(msg.get("content") or "", msg.get("reasoning_content") or "", calls)


def messages_view(body: dict) -> Visible:
    """An Anthropic message's text, thinking and tool_use blocks."""
    blocks = body["content"]
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    thinking = "".join(b["thinking"] for b in blocks if b["type"] == "thinking")
    calls = tuple(("function", b["name"], b["input"]) for b in blocks if b["type"] == "tool_use")
    return Visible(text, thinking, calls)


def response_call(item: dict) -> Call | None:
    """A Responses call item as a Call; None for other items."""
    if item["type"] == "function_call":
        return ("function", item["name"], arguments_value(item["arguments"]))
    if item["type"] == "custom_tool_call":
        return ("custom", item["name"], item["input"])
    if item["type"] == "local_shell_call":
        return ("local_shell", LOCAL_SHELL, item["action"])
    return None


def responses_view(body: dict, summaries: bool) -> Visible:
    """A response's message text, reasoning summaries (when shown) and call items."""
    items = body["output"]
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    summary = "".join(p["text"] for i in items if i["type"] == "reasoning"
                      for p in i.get("summary") or [])
    calls = tuple(c for c in map(response_call, items) if c is not None)
    return Visible(text, summary if summaries else None, calls)


def returned_view(endpoint: str, request: dict, body: dict) -> Visible:
    """The same view of a server response."""
    if endpoint == COMPLETIONS:
        return Visible(body["choices"][0]["text"])
    if endpoint == CHAT:
        return chat_view(body)
    if endpoint == MESSAGES:
        return messages_view(body)
    return responses_view(body, shows_reasoning(endpoint, request))


def differences(seq: int, got: Visible, want: Visible) -> list[str]:
    """One line per part of the reply that differs from the trace."""
    return [f"job {seq}: the {part}: {g!r} != {w!r}"
            for part, g, w in (("text differs", got.content, want.content),
                               ("reasoning differs", got.reasoning, want.reasoning),
                               ("tool calls differ", got.tool_calls, want.tool_calls)) if g != w]


def server_health(client: httpx.Client) -> dict:
    """The server's /health body ({} from an old, foreign or unreachable server: the
    requests will say more)."""
    try:
        health = client.get("/health").json()
    except (httpx.HTTPError, ValueError):
        return {}
    return health if isinstance(health, dict) else {}


def refuse_own_trace(health: dict, url: object, trace: str | Path) -> None:
    """Raise OwnTrace when the server reports that it writes `trace` (its /health names the
    file's identity): replaying into it would append to the file being read."""
    server_file = (health.get("trace") or {}).get("file_id")
    if server_file and server_file == trace_file_id(trace):
        raise OwnTrace(f"the server at {url} writes its --trace to {trace}, the "
                       "file being replayed; replay a copy of it, or a server with another "
                       "--trace file (or none)")


def check_server_model(health: dict, url: object, trace: str | Path | None,
                       fingerprint: str | None, force: bool = False) -> None:
    """Raise ForeignModel when the server's model fingerprint is not the trace's (a note
    instead with `force`, or when either side does not say)."""
    have = health.get("model_fingerprint")
    if fingerprint is None or have is None:
        side = f"{trace} has no header line" if fingerprint is None else \
            f"the server at {url} does not report its model fingerprint"
        print(f"ds4-replay: {side}: the model is not checked", file=sys.stderr)
    elif have != fingerprint:
        message = (f"{trace} was recorded with another model (fingerprint {fingerprint}); "
                   f"the server at {url} serves {have}")
        if not force:
            raise ForeignModel(f"{message} (--force replays it anyway)")
        print(f"ds4-replay: {message}: replaying it anyway (--force)", file=sys.stderr)


def output_tokens(body: dict) -> int | None:
    """Generated tokens as the reply's usage counts them (any of the four protocols)."""
    usage = body.get("usage") or {}
    count = usage.get("completion_tokens", usage.get("output_tokens"))
    return count if isinstance(count, int) else None


@dataclass
class Sent:
    """One request's outcome over HTTP: its problems, whether it was compared, its times."""

    seq: int
    problems: list[str]
    compared: bool
    timing: JobTiming
    failed: bool = False

    def outcome(self) -> str:
        """failed (not a 200, or an error in the stream), differs, text-exact or timed (not
        comparable)."""
        if self.failed:
            return "failed"
        if self.compared:
            return "differs" if self.problems else "text-exact"
        return "timed"


def count_differs(seq: int, counted: int | None, record: dict) -> list[str]:
    """A line when the reply's usage counts other than the recorded number of tokens."""
    want = len(record["generated_tokens"])
    if counted is None or counted == want:
        return []
    return [f"job {seq}: the token count differs: {counted} != {want}"]


def replay_one(client: httpx.Client, record: dict, origin: float) -> Sent:
    """Stream one record's request, timing its output chunks; compare the reply when the job
    is deterministic."""
    request, endpoint, seq = json.loads(record["raw_request"]), record["endpoint"], record["seq"]
    now = lambda: time.monotonic() - origin  # noqa: E731
    timing = JobTiming(now(), prompt_tokens=len(record.get("prompt_token_ids") or []))
    with client.stream("POST", endpoint, json=streamed_request(endpoint, request)) as response:
        if response.status_code != 200:
            text = response.read().decode("utf-8", "replace").strip()
            timing.ended = now()
            return Sent(seq, [f"job {seq}: HTTP {response.status_code} {text}"], False, timing,
                        failed=True)
        folded, timing.token_times = fold_stream(endpoint, response.iter_lines(), now)
    timing.ended = now()
    if folded.error is not None:
        return Sent(seq, [f"job {seq}: the stream failed: {folded.error}"], False, timing,
                    failed=True)
    timing.counted = output_tokens(folded.body)
    if not deterministic(record):
        return Sent(seq, [], False, timing)
    got = returned_view(endpoint, request, folded.body)
    problems = differences(seq, got, recorded_view(record))
    return Sent(seq, problems + count_differs(seq, timing.counted, record), True, timing)


class Pacer:
    """Holds each request until its turn: its recorded gap (original) or at once (asap)."""

    def __init__(self, records: list[dict], timing: str):
        self.first = min((r.get("arrived_at", 0.0) for r in records), default=0.0)
        self.timing = timing
        self.origin = time.monotonic()

    def wait(self, record: dict) -> None:
        """Sleep until the record's arrival, relative to the first one's."""
        if self.timing == "original":
            due = self.origin + record.get("arrived_at", self.first) - self.first
            time.sleep(max(0.0, due - time.monotonic()))


def replay(records: list[dict], base_url: str, api_key: str | None = None,
           trace: str | Path | None = None, parallel: int = 1, timing: str = "asap",
           on_done: Callable[[Sent], None] | None = None, fingerprint: str | None = None,
           force: bool = False) -> Report:
    """Stream every record's request, `parallel` at a time in arrival order; with `trace`,
    first refuse the trace's writer and a server of another model than `fingerprint`."""
    headers = {"Authorization": f"Bearer {api_key}", "x-api-key": api_key} if api_key else {}
    order = sorted(records, key=lambda r: r["seq"])
    report, lock = Report(), threading.Lock()
    # original: every request leaves at its recorded time, none waits for a free connection
    flight = parallel if timing == "asap" else max(1, len(order))
    with httpx.Client(base_url=base_url, timeout=None, headers=headers,
                      limits=httpx.Limits(max_connections=flight + 1)) as client:
        if trace is not None:
            health = server_health(client)
            refuse_own_trace(health, client.base_url, trace)
            check_server_model(health, client.base_url, trace, fingerprint, force)
        pacer = Pacer(order, timing)

        def one(record: dict) -> Sent:
            pacer.wait(record)
            sent = replay_one(client, record, pacer.origin)
            with lock:
                report.add(sent)
            (on_done or (lambda _s: None))(sent)
            return sent

        with ThreadPoolExecutor(max_workers=flight) as pool:
            list(pool.map(one, order))
    return report
