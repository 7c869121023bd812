"""POST /v1/completions: the prompt continued as written, non-streamed and SSE."""

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
from ds4.server.openai_object import OpenAIObject, finish_reason, openai_usage
from ds4.server.runtime import Running, Runtime
from ds4.server.sse import Channel, data_frame
from ds4.server.turn import Turn
from ds4.tokenizer import BOS_ID, EOS_ID

ENDPOINT = "/v1/completions"
TEXT_COMPLETION = "text_completion"


async def handle(request: Request, runtime: Runtime) -> Response:
    """Serve one text completion."""
    body, raw = await rf.read_json(request, runtime.config.max_body_bytes)
    runtime.require_serving()
    return await generate(request, runtime, parse(body, raw, runtime), CompletionShape)


def bad_prompt(why: str) -> ApiError:
    """A 400 naming the `prompt` field."""
    return ApiError(400, f"invalid JSON request: 'prompt' {why}", param="prompt")


def token_ids(ids: list, vocab: int) -> list[int]:
    """A prompt given as token ids, each checked against the model's vocabulary."""
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise bad_prompt(f"token ids must be integers in 0..{vocab - 1}, not {t!r}")
    return ids


def prompt_of(body: dict, vocab: int) -> str | list[int]:
    """`prompt` as text or token ids: a string, a list of ids, or a list holding one of those
    (as vLLM accepts); several prompts in one request are refused."""
    prompt = rf.required(body, "prompt", rf.STRING, rf.ARRAY)
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(t, int) for t in prompt):
        return token_ids(prompt, vocab)
    if len(prompt) != 1:
        raise bad_prompt("must be a string, a list of token ids, or a list holding one of "
                         "those; several prompts in one request are not supported")
    if isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt[0], list) and prompt[0]:
        return token_ids(prompt[0], vocab)
    raise bad_prompt("must be a string or a non-empty list of token ids")


def with_bos(ids: list[int]) -> list[int]:
    """Token ids as the model continues them: after BOS, as a text prompt is."""
    return ids if ids[:1] == [BOS_ID] else [BOS_ID, *ids]


def parse(body: dict, raw: str, runtime: Runtime) -> Turn:
    """A completions request body as a Turn: the prompt is continued as written, so thinking
    controls have nothing to open (the model is not in a chat turn)."""
    cfg = runtime.config
    model, _ = rf.resolve_model(body)
    prompt = prompt_of(body, runtime.engine.config.vocab_size)
    stream, include_usage = rf.stream_flags(body)
    ids = with_bos(prompt) if isinstance(prompt, list) else None
    tokenizer = runtime.engine.tokenizer
    render = (lambda: tokenizer.decode(ids)) if ids else (lambda: render_completion(prompt))
    return Turn(
        endpoint=ENDPOINT, protocol=OPENAI, model=model, render=render, prompt_ids=ids,
        thinking="none", sampling=rf.sampling(body, "none"),
        max_tokens=rf.max_tokens(body, ("max_tokens",), cfg.tokens),
        stop=rf.stop_sequences(body), stream=stream, include_usage=include_usage,
        raw_body=raw, prompt_field="prompt", raw_text=True)


class CompletionShape(OpenAIObject):
    """text_completion bodies and chunks: the generated text as sampled."""

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
