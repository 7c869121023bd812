"""Final parse of a turn: reasoning, content, DSML calls (docs/PROTOCOLS.md, Output parsing)."""

from __future__ import annotations

from ds4.chat import dsml
from ds4.chat.dsml import SEPARATOR, SPACE, Dialect
from ds4.chat.events import ParsedOutput, ToolCall
from ds4.chat.special_tokens import THINK, THINK_END


class Unterminated(Exception):
    """The text ended inside the block."""


class Malformed(Exception):
    """The block broke the grammar; the message says where."""


def split_reasoning(text: str, thinking: bool) -> tuple[str, int | None]:
    """(reasoning, index where the answer starts) — None when reasoning never ended."""
    if thinking:
        start = len(THINK) if text.startswith(THINK) else 0
        end = text.find(THINK_END, start)
        if end < 0:
            return text[start:], None
        return text[start:end], end + len(THINK_END)
    # Chat mode: only a leading repeat of the prompt's </think> is dropped; later ones are
    # content, because streamed content cannot be taken back as reasoning.
    return "", len(THINK_END) if text.startswith(THINK_END) else 0


class BlockReader:
    """Reads one DSML block from `start` (its opening tag) to its closing tag."""

    def __init__(self, text: str, dialect: Dialect, id_prefix: str, id_seed: str):
        self.text, self.d = text, dialect
        self.prefix = id_prefix
        self.hash = dsml.id_hash(id_seed)
        self.hashed = 0
        self.calls: list[ToolCall] = []

    def skip_space(self, p: int) -> int:
        """Index of the next non-whitespace character."""
        while p < len(self.text) and self.text[p] in SPACE:
            p += 1
        return p

    def expect_prefix(self, p: int, tags: tuple[str, ...], error: str) -> None:
        """The text at p matched no tag: unterminated if it may still grow into one."""
        if dsml.is_prefix_of_any(self.text[p:], tags):
            raise Unterminated()
        raise Malformed(error)

    def tag_end(self, p: int) -> int:
        """Index of the `>` closing the tag whose attributes start at p."""
        gt = self.text.find(">", p)
        if gt < 0:
            raise Unterminated()
        return gt

    def read(self, p: int) -> int:
        """Read invokes until the closing tag; returns the index after it."""
        while True:
            p = self.skip_space(p)
            if self.text.startswith(self.d.end, p):
                return p + len(self.d.end)
            if not self.text.startswith(self.d.invoke, p):
                self.expect_prefix(p, (self.d.end, self.d.invoke), dsml.EXPECTED_INVOKE)
            p = self.read_invoke(p + len(self.d.invoke))

    def new_id(self, p: int) -> str:
        """The id of the call whose invoke tag ends at p."""
        self.hash.update(dsml.utf8(self.text[self.hashed:p]))
        self.hashed = p
        return dsml.call_id(self.prefix, self.hash, len(self.calls))

    def read_invoke(self, p: int) -> int:
        """One invoke from its attributes to after `</…invoke>`."""
        gt = self.tag_end(p)
        name = dsml.invoke_name(self.text[p:gt])
        if name is None:
            raise Malformed(dsml.BAD_INVOKE)
        call_id = self.new_id(gt + 1)
        args, p = ["{"], gt + 1
        while True:
            p = self.skip_space(p)
            if self.text.startswith(self.d.invoke_end, p):
                args.append("}")
                self.calls.append(ToolCall(call_id, name, "".join(args)))
                return p + len(self.d.invoke_end)
            if not self.text.startswith(self.d.param, p):
                self.expect_prefix(p, (self.d.invoke_end, self.d.param), dsml.EXPECTED_PARAMETER)
            p = self.read_parameter(p + len(self.d.param), args)

    def read_parameter(self, p: int, args: list[str]) -> int:
        """One parameter; appends its `"key": value` bytes to args."""
        gt = self.tag_end(p)
        attrs = dsml.parameter_attrs(self.text[p:gt])
        if attrs is None:
            raise Malformed(dsml.BAD_PARAMETER)
        key, is_string = attrs
        close = self.text.find(self.d.param_end, gt + 1)
        value = self.text[gt + 1:] if close < 0 else self.text[gt + 1:close]
        if dsml.has_turn_marker(value):
            raise Malformed(dsml.TURN_IN_BLOCK)
        if close < 0:
            raise Unterminated()
        args.append(dsml.key_fragment(key, len(args) == 1, is_string))
        if is_string:
            args.append(dsml.string_fragment(value) + '"')
        else:
            args.append(dsml.json_value_fragment(value))
        return close + len(self.d.param_end)


def parse_output(text: str | bytes, thinking: bool = True, tools_active: bool = True,
                 id_prefix: str = "call_", id_seed: str = "") -> ParsedOutput:
    """Reasoning, content and tool calls of a whole generated turn (EOS excluded).

    Call ids are prefix + 32 hex derived from id_seed and the output before each invoke, so
    the streaming OutputParser announces the same ids; pass a per-job id_seed for unique ids.
    On malformed or unterminated DSML `tool_calls` holds only the calls completed before it.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    out = ParsedOutput()
    out.reasoning, pos = split_reasoning(text, thinking)
    if pos is None:
        return out
    start, dialect = dsml.find_start(text, pos) if tools_active else (-1, None)
    if start < 0:
        out.content = text[pos:]
        return out
    content_end = start - len(SEPARATOR) if text[pos:start].endswith(SEPARATOR) else start
    out.content = text[pos:content_end]
    reader = BlockReader(text, dialect, id_prefix, id_seed)
    try:
        end = reader.read(start + len(dialect.start))
        out.raw_block = text[content_end:end]
    except Unterminated:
        out.unterminated = True
    except Malformed as bad:
        out.malformed = str(bad)
    out.tool_calls = reader.calls
    return out
