"""`ds4-replay --url`: re-POST the jobs of a --trace file to a running server and compare.

Jobs are sent non-streamed, in arrival order, up to --parallel at a time (at their recorded
gaps with --timing original). For greedy or seeded jobs what a client sees of the reply must
equal what the trace recorded, read through the parser the server uses: the visible text, the
reasoning (where the protocol shows it) and the tool calls (names and arguments; call ids are
fresh on every run). Other jobs are sent too, since they shape the slots' caches, and timed,
but not compared. A trace is never replayed into the server that is writing it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ds4.chat import parse_output
from ds4.chat.responses import LOCAL_SHELL, custom_input, local_shell_action, responses_call_kinds
from ds4.jobs.latency import JobTiming
from ds4.server.responses import SUMMARY_OPT_IN
from ds4.server.runtime import trace_file_id

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"
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
    outcomes: dict[int, str] = field(default_factory=dict)  # failed | differs | compared | timed

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
        return (f"ds4-replay: {self.compared} job(s) compared, {self.skipped} skipped "
                f"(not greedy or seeded){unsent}, {len(self.problems)} problem(s)")


class OwnTrace(Exception):
    """The server at the URL writes the very trace file being replayed."""


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


def refuse_own_trace(client: httpx.Client, trace: str | Path) -> None:
    """Raise OwnTrace when the server reports that it writes `trace` (its /health names the
    file's identity): replaying into it would append to the file being read."""
    try:
        health = client.get("/health").json()
    except (httpx.HTTPError, ValueError):
        return  # an old or unreachable server: the POSTs will say more
    server_file = (health.get("trace") or {}).get("file_id") if isinstance(health, dict) else None
    if server_file and server_file == trace_file_id(trace):
        raise OwnTrace(f"the server at {client.base_url} writes its --trace to {trace}, the "
                       "file being replayed; replay a copy of it, or a server with another "
                       "--trace file (or none)")


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
        """failed (not a 200), differs, compared (and equal) or timed (not comparable)."""
        if self.failed:
            return "failed"
        if self.compared:
            return "differs" if self.problems else "compared"
        return "timed"


def replay_one(client: httpx.Client, record: dict, origin: float) -> Sent:
    """POST one record's request; compare the reply when the job is deterministic."""
    request = json.loads(record["raw_request"])
    request["stream"] = False
    sent = time.monotonic() - origin
    response = client.post(record["endpoint"], json=request)
    timing = JobTiming(sent, ended=time.monotonic() - origin)
    if response.status_code != 200:
        return Sent(record["seq"], [f"job {record['seq']}: HTTP {response.status_code} "
                                    f"{response.text.strip()}"], False, timing, failed=True)
    body = response.json()
    timing.counted = output_tokens(body)
    if not deterministic(record):
        return Sent(record["seq"], [], False, timing)
    got = returned_view(record["endpoint"], request, body)
    return Sent(record["seq"], differences(record["seq"], got, recorded_view(record)), True,
                timing)


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
           on_done: Callable[[Sent], None] | None = None) -> Report:
    """POST every record's request, `parallel` at a time in arrival order; with `trace`,
    first refuse the trace's writer."""
    headers = {"Authorization": f"Bearer {api_key}", "x-api-key": api_key} if api_key else {}
    order = sorted(records, key=lambda r: r["seq"])
    report, lock = Report(), threading.Lock()
    with httpx.Client(base_url=base_url, timeout=None, headers=headers,
                      limits=httpx.Limits(max_connections=parallel + 1)) as client:
        if trace is not None:
            refuse_own_trace(client, trace)
        pacer = Pacer(order, timing)

        def one(record: dict) -> Sent:
            pacer.wait(record)
            sent = replay_one(client, record, pacer.origin)
            with lock:
                report.add(sent)
            (on_done or (lambda _s: None))(sent)
            return sent

        with ThreadPoolExecutor(max_workers=parallel if timing == "asap" else
                                max(1, len(order))) as pool:
            list(pool.map(one, order))
    return report
