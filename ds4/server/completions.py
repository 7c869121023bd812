"""POST /v1/completions: raw text completion, non-streamed and SSE (spec server §3, §4.2)."""

from __future__ import annotations

import codecs

from starlette.requests import Request
from starlette.responses import Response

from ds4.chat import render_completion
from ds4.chat.events import TextDelta
from ds4.jobs.events import Finished, TokenEvents
from ds4.jobs.stop import StopText
from ds4.server import request_fields as rf
from ds4.server.errors import OPENAI, ApiError
from ds4.server.generation import generate
from ds4.server.openai_chat import OpenAIObject, finish_reason, openai_usage
from ds4.server.runtime import Running, Runtime
from ds4.server.sse import Channel, data_frame
from ds4.server.turn import Turn
from ds4.tokenizer import EOS_ID

ENDPOINT = "/v1/completions"
TEXT_COMPLETION = "text_completion"


def prompt_text(body: dict) -> str:
    """`prompt` as a string (an array gives its first string element)."""
    prompt = rf.required(body, "prompt", rf.STRING, rf.ARRAY)
    if isinstance(prompt, list):
        prompt = next((p for p in prompt if isinstance(p, str)), None)
        if prompt is None:
            raise ApiError(400, "invalid JSON request: 'prompt' must be a string or an array "
                           "holding a string", param="prompt")
    return prompt


def parse(body: dict, raw: str, runtime: Runtime) -> Turn:
    """A completions request body as a Turn."""
    cfg = runtime.config
    model, alias = rf.resolve_model(body)
    prompt = prompt_text(body)
    thinking = rf.thinking_mode(body, alias, cfg.ctx)
    stream, include_usage = rf.stream_flags(body)
    return Turn(
        endpoint=ENDPOINT, protocol=OPENAI, model=model,
        render=lambda: render_completion(prompt, thinking=thinking),
        thinking=thinking, sampling=rf.sampling(body, thinking),
        max_tokens=rf.max_tokens(body, ("max_tokens",), cfg.tokens),
        stop=rf.stop_sequences(body), stream=stream, include_usage=include_usage,
        raw_body=raw, prompt_field="prompt", raw_text=True)


class CompletionShape(OpenAIObject):
    """text_completion bodies and chunks: the raw generated text, reasoning included."""

    def __init__(self, running: Running):
        super().__init__(running, "cmpl-")
        self.tokenizer = running.runtime.engine.tokenizer
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = StopText(self.turn.stop)  # raw bytes bypass the job's own answer filter
        self.text = Channel()

    def body(self, finished: Finished) -> dict:
        """The non-streamed text_completion."""
        choice = {"text": finished.text, "index": 0, "logprobs": None,
                  "finish_reason": finish_reason(finished)}
        return self.envelope(TEXT_COMPLETION, [choice], usage=openai_usage(finished.usage))

    def chunk(self, text: str, finish: str | None = None) -> bytes:
        """One streamed choice."""
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
        return data_frame(self.envelope(TEXT_COMPLETION, [choice]))

    def opening(self) -> list[bytes]:
        """Completions streams have no role chunk."""
        return []

    def tokens(self, event: TokenEvents) -> list[bytes]:
        """The token's own text, held back while it may still become a stop sequence."""
        if event.token_id == EOS_ID:  # EOS only carries the parser's held tail; it is no text
            return []
        piece = self.utf8.decode(self.tokenizer.token_bytes(event.token_id))
        text = "".join(e.text for e in self.stop.filter([TextDelta(piece)]))
        return [self.chunk(self.text.push(text))] if text else []

    def closing(self, finished: Finished) -> list[bytes]:
        """Held-back text, the finish chunk, the usage chunk on request, [DONE]."""
        frames = []
        if rest := self.text.finish(finished.text):
            frames.append(self.chunk(rest))
        frames.append(self.chunk("", finish_reason(finished)))
        return frames + self.ending(TEXT_COMPLETION, finished)


async def handle(request: Request, runtime: Runtime) -> Response:
    """Serve one text completion."""
    body, raw = await rf.read_json(request, runtime.config.max_body_bytes)
    runtime.require_serving()
    return await generate(request, runtime, parse(body, raw, runtime), CompletionShape)
