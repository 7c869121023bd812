"""`tool_choice`: whether tools are active, which DSML prefix to force.

See docs/PROTOCOLS.md, Tools and tool_choice.
"""

from __future__ import annotations

from typing import Any

from ds4.chat.items import ChatError
from ds4.chat.special_tokens import DSML

FORCE_BLOCK = f"\n\n<{DSML}tool_calls>\n"


def tool_name(tool: Any) -> str | None:
    """Name of a tool in OpenAI (`function.name`), Anthropic or Responses (`name`) form."""
    if not isinstance(tool, dict):
        return None
    fn = tool.get("function")
    if isinstance(fn, dict) and "name" in fn:
        return fn["name"]
    return tool.get("name")


def choice_kind(tool_choice: Any) -> tuple[str, str | None]:
    """("auto"|"none"|"required"|"named", name) for every client spelling of tool_choice."""
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        kind = {"auto": "auto", "none": "none", "required": "required", "any": "required"}
        if tool_choice not in kind:
            raise ChatError(f"unknown tool_choice {tool_choice!r}")
        return kind[tool_choice], None
    if not isinstance(tool_choice, dict):
        raise ChatError("tool_choice must be a string or an object")
    kind = tool_choice.get("type")
    if kind in ("auto", "none"):
        return kind, None
    if kind in ("any", "required"):
        return "required", None
    if kind in ("function", "tool", "custom"):  # custom: a Responses free-text tool
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else tool_choice.get("name")
        if not isinstance(name, str) or not name:
            raise ChatError("tool_choice names no tool")
        return "named", name
    raise ChatError(f"unknown tool_choice type {kind!r}")


def tools_active(tools: list[dict] | None, tool_choice: Any) -> bool:
    """True when the tools block is rendered and the output is parsed for DSML calls."""
    return bool(tools) and choice_kind(tool_choice)[0] != "none"


def forced_text(tools: list[dict] | None, tool_choice: Any) -> str:
    """"" or the DSML prefix the decoder appends once reasoning is done."""
    kind, name = choice_kind(tool_choice)
    if kind in ("auto", "none"):
        return ""
    if not tools:
        raise ChatError("tool_choice forces a tool call but no tools were given")
    if kind == "required":
        return FORCE_BLOCK
    if name not in [tool_name(t) for t in tools]:
        raise ChatError(f"tool_choice names {name!r}, which is not among the tools")
    return FORCE_BLOCK + f'<{DSML}invoke name="{name}">\n'
