"""Anthropic Messages requests → renderer items (docs/PROTOCOLS.md, Prompt rendering)."""

from __future__ import annotations

from typing import Any

from ds4.chat.items import Call, ChatError, Item, ItemList
from ds4.chat.tools_block import function_object, no_parameters


def anthropic_items(messages: Any, system: Any = None) -> list[Item]:
    """Items of an Anthropic request; a final assistant message is left open (prefill)."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list")
    out = ItemList()
    text = system_text(system)
    if text is not None:
        out.add_system(text)
    for msg in messages:
        role = msg.get("role") if isinstance(msg, dict) else None
        if role == "user":
            add_user_blocks(out, msg.get("content"))
        elif role == "assistant":
            add_assistant_blocks(out, msg.get("content"))
        elif role == "system":  # Claude Code's mid-conversation system beta: a system item here
            out.add_system(system_text(msg.get("content")) or "")
        else:
            raise ChatError(f"message role {role!r} is not supported")
    return out.finish(prefill_last=messages[-1].get("role") == "assistant")


def anthropic_functions(tools: list[dict] | None) -> list[dict]:
    """Anthropic tools renamed to function schemas {name, description, parameters}."""
    functions = []
    for tool in tools or []:
        if not isinstance(tool, dict) or not tool.get("name"):
            raise ChatError("a tool has no name")
        parameters = tool.get("input_schema", no_parameters())
        functions.append(function_object(tool["name"], tool, parameters))
    return functions


def system_text(system: Any) -> str | None:
    """`system` as one string: text blocks joined by newlines, x-anthropic- parts dropped."""
    if system is None or isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise ChatError("system must be a string or a list of text blocks")
    texts = []
    for block in system:
        text = block.get("text") if isinstance(block, dict) else block
        if not isinstance(text, str):
            raise ChatError("system blocks must be text")
        if not text.startswith("x-anthropic-"):
            texts.append(text)
    return "\n".join(texts)


def block_text(block: dict, key: str) -> str:
    """A block's text field ("" when absent); ChatError when it is not a string."""
    text = block.get(key)
    if text is None:
        return ""
    if not isinstance(text, str):
        raise ChatError(f"a {block.get('type')} block's {key!r} must be a string")
    return text


def tool_result_text(content: Any) -> str:
    """A tool_result's content: a string, or blocks (text joined by blank lines)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatError("tool_result content must be a string or a list of blocks")
    texts = []
    for block in content:
        if isinstance(block, dict) and block.get("type") == "text":
            texts.append(block_text(block, "text"))
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            texts.append(f"[Unsupported {kind}]")
    return "\n\n".join(texts)


def blocks_of(content: Any) -> list[dict]:
    """A message's content as a block list (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ChatError("message content must be a string or a list of blocks")
    if not all(isinstance(b, dict) for b in content):
        raise ChatError("content blocks must be objects")
    return content


def add_user_blocks(out: ItemList, content: Any) -> None:
    """User text blocks and tool results, in order."""
    for block in blocks_of(content):
        kind = block.get("type")
        if kind == "text":
            out.add_user_text(block_text(block, "text"))
        elif kind == "tool_result":
            out.add_tool_result(block.get("tool_use_id"), tool_result_text(block.get("content")))
        else:
            raise ChatError(f"unsupported user content block {kind!r}")


def add_assistant_blocks(out: ItemList, content: Any) -> None:
    """Thinking → reasoning, text → content, tool_use → calls (one assistant turn)."""
    reasoning, text, calls = [], [], []
    for block in blocks_of(content):
        kind = block.get("type")
        if kind == "thinking":
            reasoning.append(block_text(block, "thinking"))
        elif kind == "text":
            text.append(block_text(block, "text"))
        elif kind == "tool_use":  # the item list refuses a missing name or a non-string id
            calls.append(Call(block.get("id") or "", block.get("name"), block.get("input") or {}))
        elif kind != "redacted_thinking":
            raise ChatError(f"unsupported assistant content block {kind!r}")
    out.add_assistant("".join(reasoning), "".join(text), calls)
