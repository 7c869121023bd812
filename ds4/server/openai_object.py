"""What OpenAI's chat and text completions share: the object envelope, usage, finish reasons
and the frames that end a stream (docs/PROTOCOLS.md, Chat completions)."""

from __future__ import annotations

from ds4.jobs.events import Failed, Finished, Started, Usage
from ds4.server.errors import OPENAI, error_body
from ds4.server.generation import failure_error
from ds4.server.runtime import Running
from ds4.server.sse import COMMENT_PING, DONE, data_frame
from ds4.server.wire import new_id, now

FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "cancelled": "stop"}


def cache_written(usage: Usage) -> int:
    """Prompt tokens computed and kept by the slot for the next turn (the cache's written
    share): every prompt token that was not reused. Each protocol reports this same split."""
    return usage.prompt_tokens - usage.cached_tokens


def openai_usage(usage: Usage) -> dict:
    """OpenAI `usage`: the cache split in prompt_tokens_details, reasoning tokens in
    completion_tokens_details."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens,
                                  "cache_write_tokens": cache_written(usage)},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def finish_reason(finished: Finished) -> str:
    """The OpenAI finish_reason of a finished job."""
    return FINISH.get(finished.finish_reason, finished.finish_reason)


class OpenAIObject:
    """What chat and text completions share: the object envelope, the usage chunk and [DONE]
    that end a stream, the in-stream error and comment pings."""

    def __init__(self, running: Running, id_prefix: str):
        self.turn = running.turn
        self.id = new_id(id_prefix)
        self.created = now()

    def envelope(self, kind: str, choices: list, **extra: object) -> dict:
        """Fields every object of this job shares; `kind` is its `object`."""
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.turn.model, "choices": choices, **extra}

    def ending(self, kind: str, finished: Finished) -> list[bytes]:
        """The usage chunk when the client asked for it, then [DONE]."""
        if not self.turn.include_usage:
            return [DONE]
        return [data_frame(self.envelope(kind, [], usage=openai_usage(finished.usage))), DONE]

    def started(self, event: Started) -> list[bytes]:
        """Nothing to send when the job gets its slot."""
        return []

    def failure(self, failed: Failed) -> list[bytes]:
        """An OpenAI error object in a data frame, then [DONE] (as OpenAI ends a failed
        stream; a chunk's finish_reason has no "error" value)."""
        return [data_frame(error_body(failure_error(failed), OPENAI)), DONE]

    def ping(self) -> bytes:
        """SSE comment keep-alive."""
        return COMMENT_PING
