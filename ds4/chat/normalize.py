"""OpenAI chat messages → renderer items (docs/PROTOCOLS.md, Prompt rendering)."""

from __future__ import annotations

from typing import Any

from ds4.chat.items import Call, ChatError, Item, ItemList

TEXT_PART_TYPES = (None, "text", "input_text", "output_text")


def openai_items(messages: Any) -> list[Item]:
    """Items of an OpenAI `messages` list; a final `prefix: true` assistant stays open."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list")
    out = ItemList()
    for msg in messages:
        add_openai_message(out, msg)
    last = messages[-1]
    prefill = last.get("role") == "assistant" and bool(last.get("prefix"))
    return out.finish(prefill_last=prefill)


def openai_functions(tools: list[dict] | None) -> list[dict]:
    """The `function` objects of OpenAI tools (a bare function object is taken as is)."""
    functions = []
    for tool in tools or []:
        if not isinstance(tool, dict):
            raise ChatError("tools entries must be objects")
        fn = tool.get("function", tool)
        if not isinstance(fn, dict) or not fn.get("name"):
            raise ChatError("a tool has no function name")
        functions.append(fn)
    return functions


def part_text(part: Any) -> str:
    """Text of one content part; images, audio and files are refused (400)."""
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise ChatError("content parts must be strings or objects")
    kind = part.get("type")
    if kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return part["refusal"]
    raise ChatError(f"unsupported content part type {kind!r} (only text is supported)")


def content_text(content: Any, joiner: str = "") -> str:
    """A message's content as text: string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return joiner.join(part_text(p) for p in content)
    raise ChatError("message content must be a string, null or a list of parts")


def openai_call(raw: Any) -> Call:
    """One entry of an assistant message's `tool_calls`."""
    if not isinstance(raw, dict):
        raise ChatError("tool_calls entries must be objects")
    fn = raw.get("function") or {}
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise ChatError("a tool call has no function name")
    arguments = fn.get("arguments", "{}")
    if arguments is None:
        arguments = "{}"
    return Call(raw.get("id") or "", name, arguments)


def add_openai_message(out: ItemList, msg: Any) -> None:
    """Route one chat message to the item list by its role."""
    if not isinstance(msg, dict):
        raise ChatError("each message must be an object")
    role = msg.get("role")
    content = msg.get("content")
    if role in ("system", "developer"):
        out.add_system(content_text(content))
    elif role == "user":
        out.add_user_text(content_text(content))
    elif role in ("tool", "function"):
        out.add_tool_result(msg.get("tool_call_id"), content_text(content, "\n\n"))
    elif role == "assistant":
        reasoning = msg.get("reasoning_content")
        if reasoning is None:
            reasoning = msg.get("reasoning")
        raw_calls = msg.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            raise ChatError("tool_calls must be a list")
        calls = [openai_call(c) for c in raw_calls]
        if msg.get("function_call"):  # the legacy single-call field
            calls.append(openai_call({"function": msg["function_call"]}))
        out.add_assistant(content_text(reasoning), content_text(content), calls)
    else:
        raise ChatError(f"unknown message role {role!r}")
