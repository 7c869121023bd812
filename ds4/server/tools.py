"""Tool lists, tool_choice and tool-result ids of the three protocols, in OpenAI chat terms."""

from __future__ import annotations

from ds4.server.errors import ApiError


def chat_tool_choice(choice: object) -> object:
    """OpenAI chat tool_choice as given ("auto" | "none" | "required" | {function})."""
    return choice


def forced_prefix(tools: list, choice: object) -> tuple[bool, str]:
    """(tools active?, DSML text forced after reasoning); a bad forced tool is a 400."""
    from ds4.chat import ChatError, forced_text, tools_active

    try:
        active = tools_active(tools, choice)
        return active, forced_text(tools, choice) if active else ""
    except ChatError as exc:
        raise ApiError(400, str(exc), param="tool_choice") from exc


def tool_result_ids(messages: list) -> list[str]:
    """Call ids answered by role=tool messages (the scheduler routes them to their slot)."""
    return [m["tool_call_id"] for m in messages
            if isinstance(m, dict) and m.get("role") in ("tool", "function")
            and isinstance(m.get("tool_call_id"), str)]


def anthropic_tools_as_openai(tools: list) -> list:
    """Anthropic {name, description, input_schema} tools as OpenAI function tools."""
    out = []
    for tool in tools:
        if isinstance(tool, dict) and "name" in tool:
            out.append({"type": "function", "function": {
                "name": tool["name"], "description": tool.get("description", ""),
                "parameters": tool.get("input_schema", {"type": "object"})}})
    return out


def anthropic_choice(choice: object) -> object:
    """Anthropic tool_choice ({type: auto|any|tool|none}) as OpenAI's."""
    if not isinstance(choice, dict):
        return "auto"
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return {"any": "required", "none": "none"}.get(kind, "auto")


def anthropic_result_ids(messages: list) -> list[str]:
    """tool_use_ids of tool_result blocks."""
    ids = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        for block in content if isinstance(content, list) else []:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                if isinstance(block.get("tool_use_id"), str):
                    ids.append(block["tool_use_id"])
    return ids


def responses_tools_as_openai(tools: list) -> list:
    """Responses function tools ({type, name, parameters}) as OpenAI chat function tools."""
    out = []
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == "function" and "name" in tool:
            fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            out.append({"type": "function", "function": fn})
    return out


def responses_choice(choice: object) -> object:
    """Responses tool_choice ("auto" | "none" | "required" | {type: function, name})."""
    if isinstance(choice, dict):
        if choice.get("type") == "function":
            return {"type": "function", "function": {"name": choice.get("name")}}
        return "auto"
    return choice


def responses_result_ids(items: object) -> list[str]:
    """call_ids of *_output items."""
    if not isinstance(items, list):
        return []
    return [i["call_id"] for i in items if isinstance(i, dict)
            and str(i.get("type", "")).endswith("_output") and isinstance(i.get("call_id"), str)]
