"""OpenAI Responses `input` items → renderer items (docs/PROTOCOLS.md, Prompt rendering)."""

from __future__ import annotations

import json
from typing import Any

from ds4.chat.items import Call, ChatError, Item, ItemList
from ds4.chat.normalize import content_text, part_text
from ds4.chat.tools_block import function_object, no_parameters

LOCAL_SHELL = "local_shell"
LOCAL_SHELL_KEYS = ("command", "working_directory", "timeout_ms")
# The hosted local_shell tool as a function the model can call; its keys are the action's own.
LOCAL_SHELL_SCHEMA = {
    "name": LOCAL_SHELL,
    "description": "Runs a command on the user's machine and returns its output.",
    "parameters": {"type": "object", "properties": {
        "command": {"type": "array", "items": {"type": "string"},
                    "description": "The program and its arguments, one string each."},
        "working_directory": {"type": "string"},
        "timeout_ms": {"type": "integer"}}, "required": ["command"]},
}
HOSTED_CALLS = {"local_shell_call": LOCAL_SHELL, "web_search_call": "web_search_call",
                "tool_search_call": "tool_search", "image_generation_call": "image_generation_call"}
CALLS = ("function_call", "custom_tool_call", *HOSTED_CALLS)
OUTPUTS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output",
           "web_search_call_output", "tool_search_output", "tool_search_call_output",
           "image_generation_call_output")
SKIPPED = ("compaction", "context_compaction")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")  # call-output parts with no text


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
            functions += namespace_schemas(tool)
        elif kind == "custom":
            functions.append(custom_schema(tool))
        elif kind == LOCAL_SHELL:
            functions.append(LOCAL_SHELL_SCHEMA)
    return functions


def responses_call_kinds(tools: list[dict] | None) -> dict[str, str]:
    """Rendered function name → "custom" or "local_shell" for tools whose calls are not
    `function_call` items; plain functions are absent."""
    kinds: dict[str, str] = {}
    for tool in tools or []:
        if isinstance(tool, dict) and tool.get("type") == "custom" and tool.get("name"):
            kinds[tool["name"]] = "custom"
        elif isinstance(tool, dict) and tool.get("type") == LOCAL_SHELL:
            kinds[LOCAL_SHELL] = LOCAL_SHELL
    return kinds


def output_part(part: dict) -> str:
    """One part of a call output: its text, or a placeholder for media the model cannot see."""
    if part.get("type") in MEDIA_PARTS:
        return f"[Unsupported {part['type']}]"
    return part_text(part)


def output_text(output: Any) -> str:
    """A call output: a string, content parts joined by blank lines, or any other JSON value
    as JSON text."""
    if output is None:
        return ""
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(
            isinstance(p, dict) and ("text" in p or p.get("type") in MEDIA_PARTS) for p in output):
        return "\n\n".join(output_part(p) for p in output)
    return json.dumps(output, ensure_ascii=False)


def reasoning_text(item: dict) -> str:
    """A reasoning item's summary and content texts, newline-joined."""
    texts = []
    for key in ("summary", "content"):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise ChatError(f"a reasoning item's {key!r} must be a list of parts")
        for part in parts:
            if isinstance(part, dict) and isinstance(part.get("text"), str) and part["text"]:
                texts.append(part["text"])
    return "\n".join(texts)


def response_call(item: dict) -> Call:
    """A function/custom/hosted call item as a call of the assistant turn."""
    kind = item["type"]
    call_id = item.get("call_id") or item.get("id") or ""
    if kind == "local_shell_call":  # the arguments the rendered local_shell function takes
        return Call(call_id, LOCAL_SHELL, local_shell_arguments(item.get("action")))
    if kind in HOSTED_CALLS:
        args = item.get("action") or item.get("arguments") or item.get("input") or {}
        return Call(call_id, HOSTED_CALLS[kind], args)
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise ChatError(f"a {kind} item has no name")
    if kind == "function_call" and item.get("namespace"):
        name = namespace_name(item["namespace"]) + name
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
        if item.get("status") is not None and not isinstance(item["status"], str):
            # any status reads the same: an "incomplete" item (a turn cut at
            # max_output_tokens) is what was generated, and Codex sends it back on resume
            raise ChatError("an input item's status must be a string")
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
                raise ChatError(f"message role {role!r} is not supported")
        elif kind in OUTPUTS:
            call_id = item.get("call_id") or item.get("id")
            self.out.add_tool_result(call_id, output_text(item.get("output")))
        else:
            raise ChatError(f"unsupported input item type {kind!r}")


def namespace_name(name: Any) -> str:
    """A namespace's name, which prefixes the names of its functions."""
    if not isinstance(name, str):
        raise ChatError("a namespace name must be a string")
    return name


def namespace_schemas(tool: dict) -> list[dict]:
    """The function schemas of a namespace tool, their names prefixed with its name."""
    prefix = namespace_name(tool.get("name") or "")
    nested = tool.get("tools") or []
    if not isinstance(nested, list) or not all(isinstance(t, dict) for t in nested):
        raise ChatError("a namespace's tools must be a list of objects")
    return [function_schema(t, prefix) for t in nested if t.get("type", "function") == "function"]


def function_schema(tool: dict, prefix: str) -> dict:
    """{name, description, parameters} of a function tool (nested or flat form)."""
    fn = tool.get("function", tool)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ChatError("a tool has no name")
    return function_object(prefix + fn["name"], fn, fn.get("parameters") or no_parameters())


def custom_schema(tool: dict) -> dict:
    """A free-text custom tool as a function taking one string `input`."""
    if not tool.get("name"):
        raise ChatError("a tool has no name")
    field: dict = {"type": "string"}
    grammar = tool.get("format") if isinstance(tool.get("format"), dict) else {}
    if grammar.get("type") == "grammar" and isinstance(grammar.get("definition"), str):
        # the model cannot be constrained to the grammar, so it reads it instead
        field["description"] = (f"Raw text, not JSON, matching this {grammar.get('syntax', '')}"
                                f" grammar:\n{grammar['definition']}")
    parameters = {"type": "object", "properties": {"input": field}, "required": ["input"]}
    return function_object(tool["name"], tool, parameters)


def local_shell_arguments(action: Any) -> dict:
    """A local_shell_call's exec action as the arguments of the rendered local_shell call."""
    action = action if isinstance(action, dict) else {}
    return {k: action[k] for k in LOCAL_SHELL_KEYS if action.get(k) is not None}


def arguments_json(arguments: str) -> Any:
    """Parsed call arguments, None when they are not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return None


def custom_input(arguments: str) -> str:
    """The free text of a custom tool call: its `input` string, else its one string value,
    else the arguments text as sampled."""
    args = arguments_json(arguments)
    if isinstance(args, dict):
        if isinstance(args.get("input"), str):
            return args["input"]
        if len(args) == 1 and isinstance(next(iter(args.values())), str):
            return next(iter(args.values()))
    return arguments


def local_shell_action(arguments: str) -> dict | None:
    """The exec action of a local_shell call; None when `command` is not a list of strings."""
    args = arguments_json(arguments)
    command = args.get("command") if isinstance(args, dict) else None
    if not (isinstance(command, list) and command and all(isinstance(c, str) for c in command)):
        return None
    action = {"type": "exec", "command": command, "env": {}}
    if isinstance(args.get("working_directory"), str):
        action["working_directory"] = args["working_directory"]
    timeout = args.get("timeout_ms")
    if isinstance(timeout, int) and not isinstance(timeout, bool):
        action["timeout_ms"] = timeout
    return action
