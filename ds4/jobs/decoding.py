"""A decode attempt: per-token work kept out of the job machine (docs/ARCHITECTURE.md)."""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ds4.chat import OutputParser
from ds4.chat.events import ParsedOutput, ParserEvent
from ds4.chat.final_parse import split_reasoning
from ds4.jobs.events import JobRequest, SamplingOptions, TokenEvents
from ds4.jobs.stop import StopText
from ds4.tokenizer import EOS_ID

if TYPE_CHECKING:
    from ds4.jobs.speculative import Speculator
    from ds4.tokenizer import Tokenizer

GREEDY = SamplingOptions(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)


class DecodeTarget(Protocol):
    """What an attempt steps through: a `ds4.engine.Session`, or a lock-step turn's
    `ds4.jobs.decode_batch.DeferredDecode` standing in for one."""

    def sample(self, opts: SamplingOptions, rng: np.random.Generator) -> int: ...
    def decode(self, token_id: int) -> object: ...


class DecodeAttempt:
    """Sample, evaluate and parse tokens until EOS, a stop string, the cap or a tool-call end.

    `finish_reason` stays None while decoding goes on; then it is stop | length | tool_calls,
    or "malformed" when the parser rejected the DSML block (recovery decides what follows).
    """

    def __init__(self, request: JobRequest, tokenizer: Tokenizer,
                 rng: np.random.Generator, cap: int,
                 greedy: bool = False, id_seed: str = "",
                 speculator: Speculator | None = None):
        self.request = request
        self.tokenizer = tokenizer
        self.rng = rng
        self.cap = cap
        self.greedy = greedy  # a redecode samples the rest of the block greedily
        self.speculator = speculator  # a jobs.speculative.Speculator for a greedy job, or None
        self.parser = OutputParser(thinking=request.thinking, tools_active=request.tools_active,
                                   id_prefix=request.id_prefix, id_seed=id_seed)
        self.stop = StopText(request.stop)
        self.tokens: list[int] = []
        self.ends: list[int] = []  # byte offset after each token, for recovery truncation
        self.raw = bytearray()
        self.forced: deque[int] = deque()
        self.forced_at: int | None = None  # token index where forced text began
        self.reasoning_tokens = 0  # tokens taken while the turn was still reasoning
        self.finish_reason: str | None = None
        self.eos = False
        self._forced_ids = tokenizer.encode(request.forced_text) if request.forced_text else []

    @property
    def over(self) -> bool:
        """True once this attempt decodes no more."""
        return self.finish_reason is not None

    def replay(self, tokens: list[int]) -> None:
        """Take `tokens` as already generated (redecode): parser state only, nothing emitted."""
        self._force_if_due()
        for tok in tokens:
            self._take(tok)
            self._force_if_due()
        if self.forced_at is not None:
            self.forced = deque(self._forced_ids[len(tokens) - self.forced_at:])

    def start(self) -> list[TokenEvents]:
        """Check the cap before any token; a 0-token budget ends at once with `length`."""
        self._force_if_due()
        if len(self.tokens) >= self.cap:
            return self._end("length", [])
        return []

    def step(self, session: DecodeTarget, room: int = 1) -> list[TokenEvents]:
        """One token (a speculating job: up to `room` verified ones): choose, evaluate, parse;
        returns what the sink should get."""
        forced = bool(self.forced)
        tok = self.forced.popleft() if forced else self._sample(session)
        if tok == EOS_ID:
            self.eos = True
            return self._end("stop", [], carrier=EOS_ID)
        took = self._evaluate(session, tok, forced, room)
        out: list[TokenEvents] = []
        for i, tok in enumerate(took):
            events = self.stop.filter(self._take(tok))
            self._force_if_due()
            reason = self._reason_after_token()
            cut = i + 1 < len(took) and (reason is not None or bool(self.forced))
            if cut:
                session.keep_speculated(i + 1)  # the rest would follow a stop or forced text
            if reason is not None:
                return out + self._end(reason, events, carrier=tok)
            out.append(TokenEvents(tok, tuple(events)))
            if cut:
                break
        return out

    def _evaluate(self, session: DecodeTarget, tok: int, forced: bool, room: int) -> list[int]:
        """Decode `tok` (a speculating job: verify drafts after it); the tokens the session
        took."""
        if self.speculator is None or forced:
            session.decode(tok)
            return [tok]
        return self.speculator.round(session, tok, max(1, min(room, self.cap - len(self.tokens))))

    def recovery_tokens(self) -> int:
        """Tokens to keep for a redecode: the last token boundary at or before valid_offset."""
        limit = self.parser.valid_offset
        kept = 0
        for n, end in enumerate(self.ends, start=1):
            if end > limit:
                break
            kept = n
        return kept

    def recoverable(self) -> bool:
        """True when a redecode may repair the DSML block (docs/PROTOCOLS.md, Malformed DSML)."""
        if not self.request.tools_active or self.finish_reason == "length":
            return False
        return self.finish_reason == "malformed" or self.result().unterminated

    def result(self) -> ParsedOutput:
        """The parsed turn, with the answer cut before a stop string; a rejected DSML block
        makes the whole answer plain text (docs/PROTOCOLS.md, Malformed DSML)."""
        out = self.parser.result()
        if self.finish_reason == "malformed":
            return self._as_text(out)
        if self.stop.hit is not None:
            out = replace(out, content=self.stop.emitted)
        return out

    def _as_text(self, out: ParsedOutput) -> ParsedOutput:
        """No calls; the content is every byte after the reasoning, DSML included.

        The reasoning keeps its own field: a stream has already sent it as reasoning, and the
        answer text it sent is a prefix of this content, so stream and body still agree.
        """
        text = self.raw.decode("utf-8", errors="replace")
        _, start = split_reasoning(text, self.request.thinking)
        return ParsedOutput(reasoning=out.reasoning, content=text[start or 0:],
                            malformed=out.malformed)

    def text(self) -> str:
        """The whole generated text (raw, cut before a stop string)."""
        text = self.raw.decode("utf-8", errors="replace")
        if self.stop.hit is not None:
            # the filter scans the answer only, so the cut is its first match after reasoning
            _, start = split_reasoning(text, self.request.thinking)
            at = text.find(self.stop.hit, start or 0)
            text = text[:at] if at >= 0 else text
        return text

    def _sample(self, session: DecodeTarget) -> int:
        greedy = self.greedy or self.parser.in_dsml_structure
        opts = GREEDY if greedy else self.request.sampling
        return int(session.sample(opts, self.rng))  # where its logits live (host or device)

    def _take(self, tok: int) -> list[ParserEvent]:
        piece = self.tokenizer.token_bytes(tok)
        self.reasoning_tokens += not self.parser.reasoning_done  # the closing </think> counts
        self.tokens.append(tok)
        self.raw += piece
        self.ends.append(len(self.raw))
        return self.parser.feed(piece)

    def _force_if_due(self) -> None:
        """Queue the forced DSML once reasoning ends (docs/PROTOCOLS.md, Tools and tool_choice)."""
        if self._forced_ids and self.forced_at is None and self.parser.reasoning_done:
            self.forced_at = len(self.tokens)
            self.forced = deque(self._forced_ids)

    def _reason_after_token(self) -> str | None:
        if self.stop.hit is not None:
            return "stop"
        if self.parser.done:
            return "tool_calls"
        if self.parser.error is not None:
            return "malformed"
        if len(self.tokens) >= self.cap:
            return "length"
        return None

    def _end(self, reason: str, events: list[ParserEvent],
             carrier: int | None = None) -> list[TokenEvents]:
        """Close the attempt; the parser's and stop filter's held text rides on the last token."""
        tail = self.parser.finish()
        if self.stop.hit is None:
            events = events + self.stop.filter(tail) + self.stop.flush()
        # a stop string completed by the parser's flushed tail still ends the answer as "stop"
        self.finish_reason = "stop" if self.stop.hit is not None else reason
        if carrier is None or (carrier == EOS_ID and not events):
            return []
        return [TokenEvents(carrier, tuple(events))]
