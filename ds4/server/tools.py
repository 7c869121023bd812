"""tool_choice forcing and the tool-result ids of the three protocols (for slot routing)."""

from __future__ import annotations

from ds4.chat import ChatError, forced_text, tools_active
from ds4.server.errors import ApiError


def forced_prefix(tools: list, choice: object) -> tuple[bool, str]:
    """(tools active?, DSML text forced after reasoning); a bad forced tool is a 400."""
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


def anthropic_result_ids(messages: list) -> list[str]:
    """tool_use_ids of tool_result blocks."""
    ids = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        for block in content if isinstance(content, list) else []:
            if (isinstance(block, dict) and block.get("type") == "tool_result"
                    and isinstance(block.get("tool_use_id"), str)):
                ids.append(block["tool_use_id"])
    return ids


def responses_result_ids(items: object) -> list[str]:
    """call_ids of *_output items (a local_shell_call_output may name its call by `id`)."""
    if not isinstance(items, list):
        return []
    outputs = [i for i in items if isinstance(i, dict)
               and str(i.get("type", "")).endswith("_output")]
    ids = [i.get("call_id") or (i.get("id") if i["type"] == "local_shell_call_output" else None)
           for i in outputs]
    return [i for i in ids if isinstance(i, str)]
