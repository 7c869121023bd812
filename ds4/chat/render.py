"""Items → prompt text as the official encoder writes it (docs/PROTOCOLS.md, Prompt rendering)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ds4.chat.anthropic import anthropic_functions, anthropic_items
from ds4.chat.events import ParsedOutput
from ds4.chat.forcing import forced_text, tools_active
from ds4.chat.items import (
    Assistant,
    Call,
    ChatError,
    Item,
    System,
    TextPart,
    ToolResult,
    User,
)
from ds4.chat.normalize import openai_functions, openai_items
from ds4.chat.replay import ToolMemory
from ds4.chat.responses import responses_functions, responses_items
from ds4.chat.special_tokens import ASSISTANT, BOS, EOS, THINK, THINK_END, USER
from ds4.chat.tools_block import dsml_calls, response_format_block, tools_block

MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to"
    " resolve the root cause, rigorously stress-testing your logic against all potential paths,"
    " edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step,"
    " considered alternative, and rejected hypothesis to ensure absolutely no assumption is left"
    " unchecked.\n\n"
)
THINKING_LEVELS = ("none", "high", "max")


def render_chat(messages: list[dict], tools: list[dict] | None = None, thinking: str = "high",
                tool_choice: Any = "auto", tool_memory: ToolMemory | None = None,
                response_format: Any = None) -> str:
    """Prompt text of an OpenAI chat request; ChatError for input the server rejects (400)."""
    functions = active_functions(tools, tool_choice, openai_functions)
    if isinstance(response_format, dict) and response_format.get("type") == "text":
        response_format = None  # the default format: nothing for the model to adhere to
    items = attach_system(openai_items(messages), functions, response_format)
    return render_items(items, thinking, tool_memory)


def render_anthropic(messages: list[dict], system: Any = None, tools: list[dict] | None = None,
                     thinking: str = "high", tool_choice: Any = None,
                     tool_memory: ToolMemory | None = None) -> str:
    """Prompt text of an Anthropic Messages request (a final assistant message is continued)."""
    functions = active_functions(tools, tool_choice, anthropic_functions)
    items = attach_system(anthropic_items(messages, system), functions, None)
    return render_items(items, thinking, tool_memory)


def render_responses(input: Any, instructions: str | None = None,
                     tools: list[dict] | None = None, thinking: str = "high",
                     tool_choice: Any = "auto", tool_memory: ToolMemory | None = None) -> str:
    """Prompt text of an OpenAI Responses request (`instructions` lead as system text)."""
    functions = active_functions(tools, tool_choice, responses_functions)
    items = attach_system(responses_items(input, instructions), functions, None)
    return render_items(items, thinking, tool_memory)


def render_completion(prompt: str) -> str:
    """Prompt text of /v1/completions: BOS and the prompt as written, which the model
    continues (no chat template, no system text, no thinking), as legacy completions do."""
    return BOS + prompt


def check_thinking(thinking: str) -> bool:
    """True for thinking mode; refuses levels other than none/high/max."""
    if thinking not in THINKING_LEVELS:
        raise ChatError(f"thinking must be one of {THINKING_LEVELS}, not {thinking!r}")
    return thinking != "none"


def attach_system(items: list[Item], functions: list[dict], response_format: Any) -> list[Item]:
    """Put tools/response format on the first system item, inserting an empty one if needed."""
    if not functions and response_format is None:
        return items
    if not items or not isinstance(items[0], System):
        items = [System("")] + items
    items[0].tools = functions or None
    items[0].response_format = response_format
    return items


def prompt_part(part: TextPart | ToolResult) -> str:
    """One part of a user turn as prompt text."""
    if isinstance(part, ToolResult):
        return f"<tool_result>{part.text}</tool_result>"
    return part.text


def assistant_body(item: Assistant, memory: ToolMemory | None) -> str:
    """Content + DSML (exact replay when every call id maps to one stored block)."""
    block = memory.block_for([c.id for c in item.calls]) if memory and item.calls else None
    calls = block if block is not None else dsml_calls(item.calls)
    return item.content + calls + ("" if item.open_end else EOS)


def turn_reasoning(item: Assistant, memory: ToolMemory | None) -> str:
    """The reasoning to render; a calls turn sent back without it may take the stored one."""
    if item.reasoning or not item.calls or memory is None:
        return item.reasoning
    return memory.reasoning_for([c.id for c in item.calls]) or ""


def canonical_turn(parsed: ParsedOutput, thinking: bool) -> str:
    """What the next request renders after this turn's prompt when the client echoes the
    parsed turn back as JSON: [reasoning + </think>] + content + DSML(calls) + EOS."""
    calls = [Call(c.id, c.name, c.arguments) for c in parsed.tool_calls]
    head = parsed.reasoning + THINK_END if thinking else ""
    return head + parsed.content + dsml_calls(calls) + EOS


def render_items(items: list[Item], thinking: str = "high",
                 tool_memory: ToolMemory | None = None) -> str:
    """The prompt text of normalised items (docs/PROTOCOLS.md, Prompt rendering)."""
    think = check_thinking(thinking)
    out = [BOS, MAX_PREFIX if thinking == "max" else ""]
    keep_reasoning = any(isinstance(i, System) and i.tools for i in items)
    users = [n for n, i in enumerate(items) if isinstance(i, User)]
    last_user = users[-1] if users else -1
    for n, item in enumerate(items):
        if isinstance(item, System):
            out.append(item.content)
            if item.tools:
                out.append("\n\n" + tools_block(item.tools))
            if item.response_format is not None:
                out.append("\n\n" + response_format_block(item.response_format))
        elif isinstance(item, User):
            out.append(USER + "\n\n".join(prompt_part(p) for p in item.parts))
            following = items[n + 1] if n + 1 < len(items) else None
            if following is None or isinstance(following, Assistant):
                opens = think and (keep_reasoning or n >= last_user)
                out.append(ASSISTANT + (THINK if opens else THINK_END))
        else:
            reasoning = think and (keep_reasoning or n > last_user)
            if isinstance(items[n - 1], System) and users and users[0] < n:
                # A system message between a user turn and this reply (Claude Code's
                # in-conversation system text): the official encoder opens a reply only right
                # after a user item, which would run the reply into the system text. Open it as
                # a request that ended at that system message did (below), so the reply is a
                # turn and the next prompt extends the previous one token for token.
                out.append(ASSISTANT + (THINK if reasoning else THINK_END))
            if reasoning:
                out.append(turn_reasoning(item, tool_memory) + THINK_END)
            out.append(assistant_body(item, tool_memory))
    last = items[-1] if items else None
    if isinstance(last, System) or (isinstance(last, Assistant) and not last.open_end):
        # The official encoder opens the assistant turn only after a user item; a request
        # ending in a system or finished assistant message still asks for a new reply (ds4
        # and add_generation_prompt servers do the same), so open one here.
        out.append(ASSISTANT + (THINK if think else THINK_END))
    return "".join(out)


def active_functions(tools: list[dict] | None, tool_choice: Any,
                     schemas: Callable[[list[dict] | None], list[dict]]) -> list[dict]:
    """The function schemas to render under tool_choice (none for `none`); ChatError when
    the choice forces a tool the request does not offer."""
    active = tools_active(tools, tool_choice)
    functions = schemas(tools) if active else []
    forced_text(functions if active else tools, tool_choice)
    return functions


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether generation after this prompt starts inside <think> (the parser's `thinking`).

    False in chat mode and for a continued (prefilled) assistant message, whose output goes
    on with the answer even when thinking is enabled.
    """
    return prompt.endswith(ASSISTANT + THINK)
