"""POST /v1/responses: the OpenAI Responses API (docs/PROTOCOLS.md, Responses)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from ds4.chat import render_responses
from ds4.chat.responses import responses_call_kinds
from ds4.jobs.events import Failed, Finished, Started, TokenEvents, Usage
from ds4.server import request_fields as rf
from ds4.server.errors import OPENAI, ApiError
from ds4.server.generation import generate
from ds4.server.openai_object import cache_written
from ds4.server.responses_items import OutputItems
from ds4.server.runtime import Running, Runtime
from ds4.server.sealed_reasoning import ReasoningSeal
from ds4.server.sse import event_frame
from ds4.server.tools import forced_prefix, responses_result_ids
from ds4.server.turn import Turn
from ds4.server.wire import new_id, now

ENDPOINT = "/v1/responses"
SUMMARY_OPT_IN = ("auto", "concise", "detailed")
ENCRYPTED_REASONING = "reasoning.encrypted_content"


async def handle(request: Request, runtime: Runtime) -> Response:
    """Serve one response."""
    body, raw = await rf.read_json(request, runtime.config.max_body_bytes)
    runtime.require_serving()
    turn, summaries = parse(body, raw, runtime)
    return await generate(request, runtime, turn, lambda r: ResponseShape(r, summaries, body))


def response_usage(u: Usage) -> dict:
    """Responses `usage`."""
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens,
                                     "cache_write_tokens": cache_written(u)},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def refuse_server_state(body: dict) -> None:
    """We keep no stored responses: the client must replay the whole input."""
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise ApiError(400, f"{name} is not supported; replay full input instead", param=name)


def opened(item: object, seal: ReasoningSeal) -> object:
    """A reasoning item whose encrypted_content this server sealed, as one carrying that
    exact text; any other item, or a value that does not open, as it came."""
    if not isinstance(item, dict) or item.get("type") != "reasoning":
        return item
    text = seal.open(item.get("encrypted_content"))
    if text is None:
        return item
    return {**item, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def wants_sealed_reasoning(body: dict) -> bool:
    """Whether reasoning items must carry encrypted_content (Codex always asks)."""
    include = body.get("include")
    return isinstance(include, list) and ENCRYPTED_REASONING in include


def parse(body: dict, raw: str, runtime: Runtime) -> tuple[Turn, bool]:
    """A responses request body as a Turn, and whether reasoning summaries were asked for."""
    cfg = runtime.config
    refuse_server_state(body)
    model, alias = rf.resolve_model(body)
    items = rf.required(body, "input", rf.STRING, rf.ARRAY)
    if isinstance(items, list):
        items = [opened(item, runtime.reasoning_seal) for item in items]
    instructions = rf.field(body, "instructions", rf.STRING)
    tools = rf.field(body, "tools", rf.ARRAY, default=[])
    choice = rf.field(body, "tool_choice", rf.STRING, rf.OBJECT, default="auto")
    reasoning = rf.field(body, "reasoning", rf.OBJECT, default={})
    thinking = rf.thinking_mode(body, alias, cfg.ctx)
    active, forced = forced_prefix(tools, choice)
    memory = runtime.tool_memory
    turn = Turn(
        endpoint=ENDPOINT, protocol=OPENAI, model=model,
        render=lambda: render_responses(items, instructions=instructions, tools=tools or None,
                                        thinking=thinking, tool_choice=choice,
                                        tool_memory=memory),
        thinking=thinking,
        sampling=rf.sampling(body, thinking, with_min_p=False, with_top_k=False,
                             with_seed=False),
        max_tokens=rf.max_tokens(body, ("max_output_tokens", "max_tokens"), cfg.tokens),
        tools_active=active, forced_text=forced, call_ids=responses_result_ids(items),
        stream=rf.field(body, "stream", rf.BOOLEAN, default=False), raw_body=raw,
        prompt_field="input")
    return turn, reasoning.get("summary") in SUMMARY_OPT_IN


class ResponseShape:
    """Response objects and the response.* event sequence of one job."""

    def __init__(self, running: Running, summaries: bool, body: dict | None = None):
        body = body or {}
        self.turn = running.turn
        self.id = new_id("resp_")
        self.created = now()
        seal = running.runtime.reasoning_seal.seal if wants_sealed_reasoning(body) else None
        # which calls come back as custom_tool_call / local_shell_call items
        self.items = OutputItems(summaries, responses_call_kinds(body.get("tools")), seal)
        # the request fields the Responses object must echo (the SDK's Response requires them)
        self.echo = {"tool_choice": body.get("tool_choice", "auto"),
                     "tools": body.get("tools") or [],
                     "parallel_tool_calls": body.get("parallel_tool_calls") is not False}
        self.sequence = 0

    def response(self, status: str, usage: Usage | None = None, **extra: object) -> dict:
        """The response object with the items so far."""
        out = {"id": self.id, "object": "response", "created_at": self.created,
               "status": status, "model": self.turn.model, **self.echo, **extra,
               "output": self.items.snapshot()}
        if usage is not None:
            out["usage"] = response_usage(usage)
        return out

    def final(self, finished: Finished) -> dict:
        """The finished response: completed, or incomplete when the token budget ran out."""
        if finished.finish_reason == "length":
            return self.response("incomplete", finished.usage,
                                 incomplete_details={"reason": "max_output_tokens"})
        return self.response("completed", finished.usage)

    def body(self, finished: Finished) -> dict:
        """The non-streamed response."""
        self.items.settle(finished)
        return self.final(finished)

    def event(self, kind: str, fields: dict) -> bytes:
        """One event, named on its `event:` line as OpenAI's are; sequence_number follows
        `type`."""
        frame = event_frame(kind, {"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return frame

    def frames(self, events: list[tuple[str, dict]]) -> list[bytes]:
        """Frames of (type, fields) pairs."""
        return [self.event(kind, fields) for kind, fields in events]

    def opening(self) -> list[bytes]:
        """response.created."""
        return self.frames([("response.created", {"response": self.response("in_progress")})])

    def started(self, event: Started) -> list[bytes]:
        """Nothing to send when the job gets its slot."""
        return []

    def tokens(self, event: TokenEvents) -> list[bytes]:
        """Events for one sampled token's parser events."""
        return self.frames([pair for e in event.events for pair in self.items.on(e)])

    def closing(self, finished: Finished) -> list[bytes]:
        """Close open items, then the terminal event with the whole response."""
        frames = self.frames(self.items.settle(finished))
        final = self.final(finished)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return frames + self.frames([(kind, {"response": final})])

    def failure(self, failed: Failed) -> list[bytes]:
        """response.failed."""
        error = {"code": "server_error", "message": failed.message or "generation failed"}
        return self.frames([("response.failed",
                             {"response": self.response("failed", error=error)})])

    def ping(self) -> bytes:
        """Keep-alive as a `response.in_progress` event: clients such as Codex time a stream out
        on parsed events only, so an SSE comment would not keep a queued request alive."""
        return self.event("response.in_progress", {"response": self.response("in_progress")})
