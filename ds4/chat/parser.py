"""Incremental output parser: bytes in, reasoning/text/call events out (docs/PROTOCOLS.md).

Its final result always equals parse_output() of the whole text: it holds back only what a
later byte could still reinterpret (partial UTF-8, `<think>`/`</think>`, a DSML start marker,
whitespace before it, a partial closing tag) and emits everything else at once.
"""

from __future__ import annotations

import codecs
from dataclasses import replace

from ds4.chat import dsml
from ds4.chat import events as ev
from ds4.chat.dsml import SEPARATOR, SPACE, START_MARKERS
from ds4.chat.special_tokens import DSML, THINK, THINK_END

TOOL_STATES = ("invokes", "params", "string_value", "json_value")


class OutputParser:
    """Streaming parser of one generated turn; feed() token bytes, then finish()."""

    def __init__(self, thinking: bool = True, tools_active: bool = True,
                 id_prefix: str = "call_", id_seed: str = ""):
        self.thinking, self.tools = thinking, tools_active
        self.id_prefix = id_prefix
        self.state = "think_open" if thinking else "chat_open"
        self.buf = ""  # decoded text not consumed yet
        self.final = False
        self.done = False
        self.error: str | None = None
        self.out = ev.ParsedOutput()
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._hash = dsml.id_hash(id_seed)
        self._offset = 0  # bytes consumed
        self._raw: list[str] | None = None  # consumed block text, once a block opened
        self._reasoning_parts: list[str] = []  # pieces, joined on result(): no quadratic copying
        self._content_parts: list[str] = []
        self._events: list[ev.ParserEvent] = []
        self._dialect = dsml.DIALECTS[0]
        self._call: ev.ToolCall | None = None
        self._args: list[str] = []
        self._json = JsonScan()

    # ---- public surface ------------------------------------------------------------------

    def feed(self, data: bytes | str) -> list[ev.ParserEvent]:
        """Events made complete by the bytes of one more sampled token."""
        if self.done or self.error or self.final:
            return []
        self.buf += data if isinstance(data, str) else self._decoder.decode(data)
        return self._run()

    def finish(self) -> list[ev.ParserEvent]:
        """Flush at the end of generation; an open block becomes `unterminated`."""
        if self.final:
            return []
        self.buf += self._decoder.decode(b"", final=True)
        self.final = True
        events = self._run() if not (self.done or self.error) else []
        if self.state in TOOL_STATES and not self.done and not self.error:
            self.error = dsml.UNTERMINATED
            self.out.unterminated = True
        return events

    def result(self) -> ev.ParsedOutput:
        """The parse so far (final after finish()); equals parse_output(whole text)."""
        return replace(self.out, reasoning="".join(self._reasoning_parts),
                       content="".join(self._content_parts), tool_calls=list(self.out.tool_calls))

    @property
    def reasoning_done(self) -> bool:
        """Past </think> (always in chat mode): where forced tool-call text goes in."""
        return self.state not in ("think_open", "reasoning")

    @property
    def valid_offset(self) -> int:
        """Bytes of output accepted so far; a redecode resumes at or before this offset."""
        return self._offset

    @property
    def in_dsml_structure(self) -> bool:
        """True while the next token is DSML syntax, which the decoder samples greedily."""
        if self.done or self.error:
            return False
        if self.state in ("invokes", "params"):
            return True
        if self.state == "string_value":
            # a held tail of 2+ characters that may close the value: finish the tag greedily
            end_tag = self._dialect.param_end
            return len(self.buf) >= 2 and end_tag.startswith(self.buf)
        if self.state == "json_value":
            return not self._json.inside
        return self.state == "content" and self.tools and DSML in self.buf

    # ---- machinery -----------------------------------------------------------------------

    def _run(self) -> list[ev.ParserEvent]:
        self._events = []
        while not self.done and self.error is None and getattr(self, "_" + self.state)():
            pass
        return self._events

    def _take(self, n: int) -> str:
        """Consume n characters of the buffer."""
        text, self.buf = self.buf[:n], self.buf[n:]
        raw = dsml.utf8(text)
        self._hash.update(raw)
        self._offset += len(raw)
        if self._raw is not None:
            self._raw.append(text)
        return text

    def _emit_reasoning(self, n: int) -> None:
        text = self._take(n)
        if text:
            self._reasoning_parts.append(text)
            self._events.append(ev.ReasoningDelta(text))

    def _emit_text(self, n: int) -> None:
        text = self._take(n)
        if text:
            self._content_parts.append(text)
            self._events.append(ev.TextDelta(text))

    def _emit_args(self, text: str) -> None:
        if text:
            self._args.append(text)
            self._events.append(ev.ToolArgsDelta(len(self.out.tool_calls), text))

    def _fail(self, message: str) -> bool:
        self.error = self.out.malformed = message
        return False

    def _wait_or_fail(self, tags: tuple[str, ...], message: str) -> bool:
        """Nothing matched: wait if the buffer may still become a tag, else it is malformed."""
        if dsml.is_prefix_of_any(self.buf, tags):
            return False
        return self._fail(message)

    def _skip_space(self) -> None:
        n = len(self.buf) - len(self.buf.lstrip(SPACE))
        if n:
            self._take(n)

    # ---- states: each returns True when it made progress and should run again ------------

    def _think_open(self) -> bool:
        if self.buf.startswith(THINK):
            self._take(len(THINK))
        elif THINK.startswith(self.buf) and not self.final:
            return False
        self.state = "reasoning"
        return True

    def _reasoning(self) -> bool:
        end = self.buf.find(THINK_END)
        if end >= 0:
            self._emit_reasoning(end)
            self._take(len(THINK_END))
            self.state = "content"
            return True
        keep = len(self.buf) if self.final else dsml.held_tail(self.buf, (THINK_END,))
        self._emit_reasoning(keep)
        return False

    def _chat_open(self) -> bool:
        if self.buf.startswith(THINK_END):
            self._take(len(THINK_END))
        elif THINK_END.startswith(self.buf) and not self.final:
            return False
        self.state = "content"
        return True

    def _content(self) -> bool:
        if not self.tools or self.final and dsml.find_start(self.buf)[0] < 0:
            self._emit_text(len(self.buf))
            return False
        start, dialect = dsml.find_start(self.buf)
        if start < 0:
            keep = dsml.held_tail(self.buf, START_MARKERS)
            self._emit_text(len(self.buf[:keep].rstrip(SPACE)))
            return False
        cut = start - len(SEPARATOR) if self.buf[:start].endswith(SEPARATOR) else start
        self._emit_text(cut)
        self._raw = []
        self._take(start - cut + len(dialect.start))
        self._dialect, self.state = dialect, "invokes"
        return True

    def _invokes(self) -> bool:
        self._skip_space()
        d = self._dialect
        if self.buf.startswith(d.end):
            self._take(len(d.end))
            self.out.raw_block = "".join(self._raw)
            self.done = True
            self._events.append(ev.Done())
            return False
        if not self.buf.startswith(d.invoke):
            return self._wait_or_fail((d.end, d.invoke), dsml.EXPECTED_INVOKE)
        gt = self.buf.find(">", len(d.invoke))
        if gt < 0:
            return False
        name = dsml.invoke_name(self.buf[len(d.invoke):gt])
        if name is None:
            return self._fail(dsml.BAD_INVOKE)
        self._take(gt + 1)
        index = len(self.out.tool_calls)
        self._call = ev.ToolCall(dsml.call_id(self.id_prefix, self._hash, index), name, "")
        self._args = []
        self._events.append(ev.ToolCallStart(index, self._call.id, name))
        self._emit_args("{")
        self.state = "params"
        return True

    def _params(self) -> bool:
        self._skip_space()
        d = self._dialect
        if self.buf.startswith(d.invoke_end):
            self._take(len(d.invoke_end))
            self._emit_args("}")
            arguments = "".join(self._args)
            index = len(self.out.tool_calls)
            self._events.append(ev.ToolCallEnd(index, arguments))
            self.out.tool_calls.append(replace(self._call, arguments=arguments))
            self.state = "invokes"
            return True
        if not self.buf.startswith(d.param):
            return self._wait_or_fail((d.invoke_end, d.param), dsml.EXPECTED_PARAMETER)
        gt = self.buf.find(">", len(d.param))
        if gt < 0:
            return False
        attrs = dsml.parameter_attrs(self.buf[len(d.param):gt])
        if attrs is None:
            return self._fail(dsml.BAD_PARAMETER)
        self._take(gt + 1)
        key, is_string = attrs
        self._emit_args(dsml.key_fragment(key, len(self._args) == 1, is_string))
        self.state = "string_value" if is_string else "json_value"
        self._json = JsonScan()
        return True

    def _string_value(self) -> bool:
        end_tag = self._dialect.param_end
        close = self.buf.find(end_tag)
        if dsml.has_turn_marker(self.buf if close < 0 else self.buf[:close]):
            return self._fail(dsml.TURN_IN_BLOCK)
        if close < 0:
            keep = dsml.held_tail(self.buf, (end_tag, *dsml.TURN_MARKERS))
            self._emit_args(dsml.string_fragment(self._take(keep)))
            return False
        self._emit_args(dsml.string_fragment(self._take(close)) + '"')
        self._take(len(end_tag))
        self.state = "params"
        return True

    def _json_value(self) -> bool:
        end_tag = self._dialect.param_end
        close = self.buf.find(end_tag, max(0, self._json.scanned - len(end_tag)))
        if dsml.has_turn_marker(self.buf if close < 0 else self.buf[:close]):
            return self._fail(dsml.TURN_IN_BLOCK)
        if close < 0:
            self._json.scan(self.buf)
            return False
        self._emit_args(dsml.json_value_fragment(self._take(close)))
        self._take(len(end_tag))
        self.state = "params"
        return True


class JsonScan:
    """Whether a growing string=false value currently ends inside a JSON string literal."""

    def __init__(self) -> None:
        self.scanned = 0
        self.inside = False
        self.escaped = False

    def scan(self, text: str) -> None:
        """Advance over the characters added since the last call."""
        for ch in text[self.scanned:]:
            if self.escaped:
                self.escaped = False
            elif ch == "\\" and self.inside:
                self.escaped = True
            elif ch == '"':
                self.inside = not self.inside
        self.scanned = len(text)
