"""One parsed generation request, independent of its protocol's wire shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ds4.jobs.events import SamplingOptions


@dataclass
class Turn:
    """What a protocol module extracted from a request body, ready to render and queue."""

    endpoint: str
    protocol: str  # errors.OPENAI | errors.ANTHROPIC
    model: str
    render: Callable[[], str]  # the prompt text; runs off the event loop
    thinking: str  # "none" | "high" | "max"
    sampling: SamplingOptions
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    tools_active: bool = False
    forced_text: str = ""
    id_prefix: str = "call_"
    call_ids: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    raw_body: str = ""
    prompt_field: str = "messages"  # named by context-overflow errors
    # the client gets the raw generated text (/v1/completions): the job splits off no
    # reasoning, so its stop strings scan all of that text
    raw_text: bool = False
    prompt_ids: list[int] | None = None  # a prompt given as token ids: used as they are


@dataclass
class Prompt:
    """A rendered and tokenized turn."""

    text: str
    tokens: list[int]
