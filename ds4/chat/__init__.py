"""DeepSeek-V4 chat encoding: requests → prompt text, generated text → reasoning/content/calls.

Render (docs/PROTOCOLS.md, Prompt rendering): render_chat, render_anthropic, render_responses,
render_completion return prompt TEXT; tokenize it whole with ds4.tokenizer.Tokenizer.encode.
Bad input raises ChatError (a ValueError the server answers with 400).
tool_choice (docs/PROTOCOLS.md, Tools and tool_choice): tools_active() says whether to parse
DSML; forced_text() is the DSML prefix the decoder appends as if sampled once
OutputParser.reasoning_done turns True.
Parse (docs/PROTOCOLS.md, Output parsing): OutputParser streams events; parse_output() is the
final word, and the stream's result() always equals it, call ids included. ToolMemory keeps
sampled DSML for replay (docs/PROTOCOLS.md, Exact replay).
"""

from ds4.chat.events import (
    Done,
    ParsedOutput,
    ParserEvent,
    ReasoningDelta,
    TextDelta,
    ToolArgsDelta,
    ToolCall,
    ToolCallEnd,
    ToolCallStart,
)
from ds4.chat.final_parse import parse_output
from ds4.chat.forcing import forced_text, tools_active
from ds4.chat.items import ChatError
from ds4.chat.parser import OutputParser
from ds4.chat.render import (
    MAX_PREFIX,
    canonical_turn,
    prompt_opens_reasoning,
    render_anthropic,
    render_chat,
    render_completion,
    render_responses,
)
from ds4.chat.replay import ToolMemory

__all__ = [
    "MAX_PREFIX", "ChatError", "Done", "OutputParser", "ParsedOutput", "ParserEvent",
    "ReasoningDelta", "TextDelta", "ToolArgsDelta", "ToolCall", "ToolCallEnd", "ToolCallStart",
    "ToolMemory", "canonical_turn", "forced_text", "parse_output",
    "prompt_opens_reasoning", "render_anthropic",
    "render_chat", "render_completion", "render_responses", "tools_active",
]
