"""OpenAI Responses `input` items → renderer items (spec encoding §2, server §2.4)."""

from __future__ import annotations

import json
from typing import Any

from ds4.chat.items import Call, ChatError, Item, ItemList
from ds4.chat.normalize import content_text

HOSTED_CALLS = {"local_shell_call": "local_shell", "web_search_call": "web_search_call",
                "tool_search_call": "tool_search", "image_generation_call": "image_generation_call"}
CALLS = ("function_call", "custom_tool_call", *HOSTED_CALLS)
OUTPUTS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output",
           "web_search_call_output", "tool_search_output", "tool_search_call_output",
           "image_generation_call_output")
SKIPPED = ("compaction", "context_compaction")


def output_text(output: Any) -> str:
    """A call output: a string, text parts, or any other JSON value as JSON text."""
    if output is None:
        return ""
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and "text" in p for p in output):
        return content_text(output, "\n\n")
    return json.dumps(output, ensure_ascii=False)


def reasoning_text(item: dict) -> str:
    """A reasoning item's summary and content texts, newline-joined."""
    texts = []
    for key in ("summary", "content"):
        for part in item.get(key) or []:
            if isinstance(part, dict) and isinstance(part.get("text"), str) and part["text"]:
                texts.append(part["text"])
    return "\n".join(texts)


def response_call(item: dict) -> Call:
    """A function/custom/hosted call item as a call of the assistant turn."""
    kind = item["type"]
    call_id = item.get("call_id") or item.get("id") or ""
    if kind in HOSTED_CALLS:
        args = item.get("action") or item.get("arguments") or item.get("input") or {}
        return Call(call_id, HOSTED_CALLS[kind], args)
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise ChatError(f"a {kind} item has no name")
    if kind == "function_call" and item.get("namespace"):
        name = item["namespace"] + name
    if kind == "custom_tool_call":  # free text, matching the one-string schema we render
        return Call(call_id, name, {"input": item.get("input") or ""})
    args = item.get("arguments")
    return Call(call_id, name, "{}" if args is None else args)


class ResponsesReader:
    """Walks Responses items; reasoning waits for the assistant output that follows it."""

    def __init__(self) -> None:
        self.out = ItemList()
        self.pending_reasoning = ""

    def flush_reasoning(self) -> None:
        """Reasoning with no assistant output after it becomes an empty assistant turn."""
        if self.pending_reasoning:
            self.out.add_assistant(self.pending_reasoning, "", [])
            self.pending_reasoning = ""

    def take_reasoning(self) -> str:
        """The reasoning to attach to the assistant output being read."""
        text, self.pending_reasoning = self.pending_reasoning, ""
        return text

    def read(self, item: Any) -> None:
        """Route one input item."""
        if not isinstance(item, dict):
            raise ChatError("input items must be objects")
        kind = item.get("type") or ("message" if "role" in item else None)
        if item.get("status") not in (None, "completed"):
            raise ChatError(f"input item with status {item.get('status')!r}")
        if kind in SKIPPED:
            return
        if kind == "reasoning":
            text = reasoning_text(item)
            self.pending_reasoning += ("\n" if self.pending_reasoning and text else "") + text
        elif kind == "message" and item.get("role") == "assistant":
            self.out.extend_assistant(self.take_reasoning(), content_text(item.get("content")))
        elif kind in CALLS:
            self.out.extend_assistant(self.take_reasoning(), "", [response_call(item)])
        else:
            self.flush_reasoning()
            self.read_other(kind, item)

    def read_other(self, kind: str | None, item: dict) -> None:
        """User/system messages and call outputs."""
        if kind == "message":
            role = item.get("role")
            if role in ("system", "developer"):
                self.out.add_system(content_text(item.get("content")))
            elif role == "user":
                self.out.add_user_text(content_text(item.get("content")))
            else:
                raise ChatError(f"unknown message role {role!r}")
        elif kind in OUTPUTS:
            call_id = item.get("call_id") or item.get("id")
            self.out.add_tool_result(call_id, output_text(item.get("output")))
        else:
            raise ChatError(f"unsupported input item type {kind!r}")


def responses_items(input: Any, instructions: str | None = None) -> list[Item]:
    """Items of a Responses request: instructions first, then the input items."""
    reader = ResponsesReader()
    if instructions:
        reader.out.add_system(instructions)
    if isinstance(input, str):
        reader.out.add_user_text(input)
    elif isinstance(input, list) and input:
        for item in input:
            reader.read(item)
        reader.flush_reasoning()
    else:
        raise ChatError("input must be a string or a non-empty list of items")
    return reader.out.finish()


def responses_functions(tools: list[dict] | None) -> list[dict]:
    """Function schemas of Responses tools; namespaces flattened, hosted tools skipped."""
    functions: list[dict] = []
    for tool in tools or []:
        if not isinstance(tool, dict):
            raise ChatError("tools entries must be objects")
        kind = tool.get("type", "function")
        if kind == "function":
            functions.append(function_schema(tool, ""))
        elif kind == "namespace":
            prefix = tool.get("name") or ""
            functions += [function_schema(t, prefix) for t in tool.get("tools") or []
                          if t.get("type", "function") == "function"]
        elif kind == "custom":
            functions.append(custom_schema(tool))
    return functions


def function_schema(tool: dict, prefix: str) -> dict:
    """{name, description, parameters} of a function tool (nested or flat form)."""
    fn = tool.get("function", tool)
    if not fn.get("name"):
        raise ChatError("a tool has no name")
    out = {"name": prefix + fn["name"]}
    if "description" in fn:
        out["description"] = fn["description"]
    out["parameters"] = fn.get("parameters") or {"type": "object", "properties": {}}
    return out


def custom_schema(tool: dict) -> dict:
    """A free-text custom tool as a function taking one string `input`."""
    if not tool.get("name"):
        raise ChatError("a tool has no name")
    out = {"name": tool["name"]}
    if "description" in tool:
        out["description"] = tool["description"]
    out["parameters"] = {"type": "object", "properties": {"input": {"type": "string"}},
                         "required": ["input"]}
    return out
