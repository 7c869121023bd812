"""The tools block and canonical DSML of past calls (docs/PROTOCOLS.md, Tools and tool_choice)."""

from __future__ import annotations

import json
from typing import Any

from ds4.chat.items import Call
from ds4.chat.special_tokens import DSML

TOOLS_INTRO = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools"
    f' by writing a "<{DSML}tool_calls>" block like the following:\n\n'
    f"<{DSML}tool_calls>\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">'
    f"$PARAMETER_VALUE</{DSML}parameter>\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types'
    ' (numbers, booleans, arrays, objects), pass the value in JSON format and set'
    ' `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning"
    " inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_OUTRO = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke"
    " tool calls.\n"
)
RESPONSE_FORMAT_INTRO = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)


def to_json(value: Any) -> str:
    """`json.dumps` as the official encoder spells it (`, ` and `: `, raw non-ASCII)."""
    return json.dumps(value, ensure_ascii=False)


def function_object(name: str, tool: dict, parameters: Any) -> dict:
    """A schema line's object: name, the tool's description when it has one, parameters."""
    out = {"name": name}
    if "description" in tool:
        out["description"] = tool["description"]
    out["parameters"] = parameters
    return out


def no_parameters() -> dict:
    """The parameters schema of a tool that declares none."""
    return {"type": "object", "properties": {}}


def tools_block(functions: list[dict]) -> str:
    """TOOLS_BLOCK: the fixed instructions plus one JSON line per function schema."""
    return TOOLS_INTRO + "\n".join(to_json(f) for f in functions) + TOOLS_OUTRO


def response_format_block(response_format: Any) -> str:
    """The response-format section appended to the system text."""
    return RESPONSE_FORMAT_INTRO + to_json(response_format)


def arguments_object(arguments: Any) -> dict | None:
    """The call's arguments as an object, or None when they are not a JSON object."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return None
        return parsed if isinstance(parsed, dict) else None
    return None


def parameter_line(key: str, value: Any) -> str:
    """One `<｜DSML｜parameter …>` line: raw strings, JSON for every other value."""
    if isinstance(value, str):
        return f'<{DSML}parameter name="{key}" string="true">{value}</{DSML}parameter>'
    return f'<{DSML}parameter name="{key}" string="false">{to_json(value)}</{DSML}parameter>'


def invoke_text(call: Call) -> str:
    """One `<｜DSML｜invoke>` element of a call."""
    args = arguments_object(call.arguments)
    if args is None:
        raw = call.arguments if isinstance(call.arguments, str) else to_json(call.arguments)
        lines = [parameter_line("arguments", raw)]
    else:
        lines = [parameter_line(k, v) for k, v in args.items()]
    return f'<{DSML}invoke name="{call.name}">\n' + "\n".join(lines) + f"\n</{DSML}invoke>"


def dsml_calls(calls: list[Call]) -> str:
    """Canonical DSML block of calls, separator included; "" without calls."""
    if not calls:
        return ""
    body = "\n".join(invoke_text(c) for c in calls)
    return f"\n\n<{DSML}tool_calls>\n{body}\n</{DSML}tool_calls>"
