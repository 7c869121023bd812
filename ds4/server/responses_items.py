"""The output items of one Responses turn (reasoning, message, function, custom tool and
local shell calls) and their events."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

from ds4.chat import events as ev
from ds4.chat.responses import LOCAL_SHELL, custom_input, local_shell_action
from ds4.jobs.events import Finished
from ds4.server.sse import Channel
from ds4.server.wire import new_id

Pairs = list[tuple[str, dict]]
INPUT_HEAD = '{"input": "'  # how the parser's arguments of a string=true `input` begin


class CustomInput:
    """The raw text of a custom call's `input`, decoded as its JSON argument pieces arrive;
    arguments of any other form give nothing here and come whole at the call's end."""

    def __init__(self) -> None:
        self.json = ""
        self.pos = len(INPUT_HEAD)  # first character of the value not decoded yet
        self.closed = False

    def push(self, text: str) -> str:
        """The input text that `text` completes."""
        self.json += text
        if self.closed or not self.json.startswith(INPUT_HEAD):
            return ""
        s, end = self.json, self.pos
        while end < len(s) and s[end] != '"':
            step = 1 if s[end] != "\\" else 6 if s[end + 1:end + 2] == "u" else 2
            if end + step > len(s):
                break  # an escape cut in two: wait for its rest
            end += step
        self.closed = s[end:end + 1] == '"'
        piece, self.pos = s[self.pos:end], end
        return json.loads(f'"{piece}"') if piece else ""


class OutputItems(ev.ParserEvents[Pairs]):
    """Builds output items from parser events, as (event type, fields) pairs to stream."""

    def __init__(self, summaries: bool, kinds: dict[str, str] | None = None,
                 seal: Callable[[str], str] | None = None):
        self.summaries = summaries
        self.seal = seal  # reasoning text -> encrypted_content, when the client asked for it
        self.kinds = kinds or {}  # tool name -> "custom" | "local_shell" (see responses_call_kinds)
        self.items: list[dict] = []
        self.open: dict | None = None
        self.text_of: dict[str, str] = {}  # item id -> its reasoning summary or output text
        self.reasoning = Channel()
        self.text = Channel()
        self.calls: dict[int, dict] = {}  # call index -> its item, once announced
        self.inputs: dict[int, CustomInput] = {}
        self.shells: dict[int, tuple[str, str]] = {}  # local shell calls started, not yet known

    def snapshot(self) -> list[dict]:
        """The items as they stand."""
        return copy.deepcopy(self.items)

    def ignored(self) -> Pairs:
        """No event for it."""
        return []

    def on_reasoning(self, e: ev.ReasoningDelta) -> Pairs:
        """Reasoning text, once the channel lets it go."""
        return self.reasoning_delta(self.reasoning.push(e.text))

    def on_text(self, e: ev.TextDelta) -> Pairs:
        """Output text, once the channel lets it go."""
        return self.text_delta(self.text.push(e.text))

    def on_call_start(self, e: ev.ToolCallStart) -> Pairs:
        """A call item (or a shell call held until its arguments are known)."""
        return self.start_call(e.index, e.id, e.name)

    def on_call_args(self, e: ev.ToolArgsDelta) -> Pairs:
        """More arguments of a call item already announced."""
        if not (e.text and e.index in self.calls):
            return []
        return self.call_delta(e.index, e.text)

    def on_call_end(self, e: ev.ToolCallEnd) -> Pairs:
        """A call that was started is complete."""
        if not (e.index in self.calls or e.index in self.shells):
            return []
        return self.end_call(e.index, e.arguments)

    def add(self, item: dict) -> Pairs:
        """Close the open item and add a new one."""
        pairs = self.close_open()
        self.items.append(item)
        self.open = item
        return pairs + [("response.output_item.added",
                         {"output_index": len(self.items) - 1, "item": copy.deepcopy(item)})]

    def place(self, item: dict) -> dict:
        """item_id and output_index of an item."""
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def reasoning_delta(self, text: str) -> Pairs:
        """Reasoning: a reasoning item when the client asked for summaries (then its text
        streams as the summary) or for encrypted_content (sealed when the item is done)."""
        if not ((self.summaries or self.seal) and text):
            return []
        pairs: Pairs = []
        if self.open is None or self.open["type"] != "reasoning":
            item = {"id": new_id("rs_"), "type": "reasoning", "status": "in_progress",
                    "summary": []}
            pairs += self.add(item)
            if self.summaries:
                pairs.append(("response.reasoning_summary_part.added", {
                    **self.place(item), "summary_index": 0,
                    "part": {"type": "summary_text", "text": ""}}))
        item = self.open
        self.text_of[item["id"]] = self.text_of.get(item["id"], "") + text
        if not self.summaries:
            return pairs
        return pairs + [("response.reasoning_summary_text.delta",
                         {**self.place(item), "summary_index": 0, "delta": text})]

    def text_delta(self, text: str, force: bool = False) -> Pairs:
        """Visible text; opens the message item (also empty, when `force`)."""
        if not (text or force):
            return []
        pairs: Pairs = []
        if self.open is None or self.open["type"] != "message":
            item = {"id": new_id("msg_"), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
            pairs += self.add(item)
            pairs.append(("response.content_part.added", {
                **self.place(item), "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}))
        item = self.open
        self.text_of[item["id"]] = self.text_of.get(item["id"], "") + text
        if text:
            pairs.append(("response.output_text.delta",
                          {**self.place(item), "content_index": 0, "delta": text,
                           "logprobs": []}))
        return pairs

    def start_call(self, index: int, call_id: str, name: str, kind: str | None = None) -> Pairs:
        """A function_call or custom_tool_call item, arguments/input still empty."""
        kind = kind or self.kinds.get(name)
        if kind == LOCAL_SHELL:  # its action is known only whole: the item comes at the end
            self.shells[index] = (call_id, name)
            return []
        if kind == "custom":
            item = {"id": new_id("ctc_"), "type": "custom_tool_call", "status": "in_progress",
                    "call_id": call_id, "name": name, "input": ""}
            self.inputs[index] = CustomInput()
        else:
            item = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress",
                    "name": name, "call_id": call_id, "arguments": ""}
        self.calls[index] = item
        return self.add(item)

    def call_delta(self, index: int, text: str) -> Pairs:
        """More argument bytes of call `index`."""
        item = self.calls[index]
        if item["type"] == "custom_tool_call":
            return self.input_delta(item, self.inputs[index].push(text))
        return self.arguments_delta(item, text)

    def arguments_delta(self, item: dict, text: str) -> Pairs:
        """More argument bytes of a function call."""
        if not text:
            return []
        item["arguments"] += text
        return [("response.function_call_arguments.delta", {**self.place(item), "delta": text})]

    def input_delta(self, item: dict, text: str) -> Pairs:
        """More input text of a custom tool call."""
        if not text:
            return []
        item["input"] += text
        return [("response.custom_tool_call_input.delta", {**self.place(item), "delta": text})]

    def end_call(self, index: int, arguments: str) -> Pairs:
        """Call `index` is whole: send what the deltas did not carry, then close its item."""
        if index in self.shells:
            return self.shell_call(index, arguments)
        item = self.calls[index]
        if item["type"] == "custom_tool_call":
            whole = custom_input(arguments)
            pairs = self.input_delta(item, remainder(item["input"], whole))
            item["input"] = whole
        else:
            pairs = self.arguments_delta(item, remainder(item["arguments"], arguments))
            item["arguments"] = arguments
        return pairs + self.close_open()

    def shell_call(self, index: int, arguments: str) -> Pairs:
        """A local_shell_call item, added and done at once; arguments that are no exec
        action stay a function_call, so the client sees what the model asked for."""
        call_id, name = self.shells.pop(index)
        action = local_shell_action(arguments)
        if action is None:
            pairs = self.start_call(index, call_id, name, "function")
            return pairs + self.end_call(index, arguments)
        item = {"id": new_id("lsh_"), "type": "local_shell_call", "status": "in_progress",
                "call_id": call_id, "action": action}
        self.calls[index] = item
        return self.add(item) + self.close_open()

    def close_open(self, status: str = "completed") -> Pairs:
        """The *.done events of the open item."""
        item, self.open = self.open, None
        if item is None:
            return []
        pairs = getattr(self, "_done_" + item["type"])(item)
        item["status"] = status
        return pairs + [("response.output_item.done",
                         {"output_index": self.items.index(item), "item": copy.deepcopy(item)})]

    def _done_reasoning(self, item: dict) -> Pairs:
        text = self.text_of.get(item["id"], "")
        if self.seal:
            item["encrypted_content"] = self.seal(text)
        if not self.summaries:
            return []
        part = {"type": "summary_text", "text": text}
        item["summary"] = [part]
        return [("response.reasoning_summary_text.done",
                 {**self.place(item), "summary_index": 0, "text": part["text"]}),
                ("response.reasoning_summary_part.done",
                 {**self.place(item), "summary_index": 0, "part": part})]

    def _done_message(self, item: dict) -> Pairs:
        part = {"type": "output_text", "text": self.text_of.get(item["id"], ""), "annotations": []}
        item["content"] = [part]
        return [("response.output_text.done",
                 {**self.place(item), "content_index": 0, "text": part["text"],
                  "logprobs": []}),
                ("response.content_part.done", {**self.place(item), "content_index": 0,
                                                "part": part})]

    def _done_function_call(self, item: dict) -> Pairs:
        return [("response.function_call_arguments.done",
                 {**self.place(item), "arguments": item["arguments"]})]

    def _done_custom_tool_call(self, item: dict) -> Pairs:
        return [("response.custom_tool_call_input.done",
                 {**self.place(item), "input": item["input"]})]

    def _done_local_shell_call(self, item: dict) -> Pairs:
        return []

    def settle(self, finished: Finished) -> Pairs:
        """Flush held-back text, add calls not streamed live, close the open item."""
        out = finished.output
        pairs = self.reasoning_delta(self.reasoning.finish(out.reasoning))
        has_message = any(i["type"] == "message" for i in self.items)
        rest = self.text.finish(out.content)
        pairs += self.text_delta(rest, force=not out.tool_calls and not has_message)
        for index, call in enumerate(out.tool_calls):
            if index not in self.calls:
                pairs += self.start_call(index, call.id, call.name)
                pairs += self.end_call(index, call.arguments)
        status = "incomplete" if finished.finish_reason == "length" else "completed"
        return pairs + self.close_open(status)


def remainder(sent: str, whole: str) -> str:
    """What `whole` adds to the `sent` deltas (nothing when they went another way)."""
    return whole[len(sent):] if whole.startswith(sent) else ""
