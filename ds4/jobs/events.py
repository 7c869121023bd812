"""Plain data that crosses the thread boundary between the scheduler and the server.

The server builds a `JobRequest`, the scheduler pushes `JobEvent`s into the job's sink (a
thread-safe callable). Nothing here knows HTTP or JSON wire shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ds4.chat.events import ParsedOutput, ParserEvent

# Defined by the sampler it configures; re-exported since every JobRequest carries one.
from ds4.sampling import SamplingOptions as SamplingOptions


@dataclass
class JobRequest:
    """Everything the scheduler needs to run one generation."""

    prompt_tokens: list[int]
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)  # stop sequences (text)
    thinking: bool = False  # prompt ends with <think>: output starts in reasoning
    tools_active: bool = False  # parse DSML tool calls, stop after </｜DSML｜tool_calls>
    forced_text: str = ""  # tool_choice required / named: DSML forced after reasoning
    id_prefix: str = "call_"  # tool-call id prefix: call_ (OpenAI) or toolu_ (Anthropic)
    call_ids: list[str] = field(default_factory=list)  # ids this request continues (slot routing)
    streamed: bool = False  # the client sees events live: a call it saw begin cannot be undone
    endpoint: str = ""  # for traces only, e.g. "/v1/chat/completions"
    raw_body: str = ""  # for traces only


@dataclass(frozen=True)
class Queued:
    """The job waits for a slot; `position` jobs are ahead of it."""

    position: int


@dataclass(frozen=True)
class Started:
    """The job got a slot; `cached_tokens` of its prompt were reused, not recomputed."""

    slot: int
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Progress:
    """A prefill slice finished; the server may send a keep-alive."""

    done_tokens: int
    prompt_tokens: int


@dataclass(frozen=True)
class TokenEvents:
    """One sampled token (raw bytes kept for traces) and what the parser made of it."""

    token_id: int
    events: tuple[ParserEvent, ...]


@dataclass(frozen=True)
class Usage:
    """Token counts of a finished job."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0  # of completion_tokens: those sampled inside <think>…</think>


@dataclass(frozen=True)
class Finished:
    """The job ended normally; finish_reason is stop | length | tool_calls | cancelled."""

    finish_reason: str
    output: ParsedOutput
    text: str  # the whole generated text (raw, for /v1/completions and traces)
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended the answer, if one did


@dataclass(frozen=True)
class Failed:
    """The job ended with an error; status is the HTTP status the server should use."""

    message: str
    status: int = 500
    kind: str = "server_error"  # "context_overflow" | "invalid_request" | "server_error"


JobEvent = Queued | Started | Progress | TokenEvents | Finished | Failed
JobSink = Callable[[JobEvent], None]
