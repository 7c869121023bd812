"""The output items of one Responses turn (reasoning, message, function calls) and their events."""

from __future__ import annotations

import copy

from ds4.chat import events as ev
from ds4.jobs.events import Finished
from ds4.server.sse import Channel
from ds4.server.wire import new_id

Pairs = list[tuple[str, dict]]


class OutputItems:
    """Builds output items from parser events, as (event type, fields) pairs to stream."""

    def __init__(self, summaries: bool):
        self.summaries = summaries
        self.items: list[dict] = []
        self.open: dict | None = None
        self.text_of: dict[str, str] = {}  # item id -> its reasoning summary or output text
        self.reasoning = Channel()
        self.text = Channel()
        self.calls: dict[int, dict] = {}

    def snapshot(self) -> list[dict]:
        """The items as they stand."""
        return copy.deepcopy(self.items)

    def on(self, e: object) -> Pairs:
        """Pairs for one parser event."""
        if isinstance(e, ev.ReasoningDelta):
            return self.reasoning_delta(self.reasoning.push(e.text))
        if isinstance(e, ev.TextDelta):
            return self.text_delta(self.text.push(e.text))
        if isinstance(e, ev.ToolCallStart):
            return self.add_call(e.index, e.id, e.name)
        if isinstance(e, ev.ToolArgsDelta) and e.text and e.index in self.calls:
            return self.arguments_delta(self.calls[e.index], e.text)
        if isinstance(e, ev.ToolCallEnd) and e.index in self.calls:
            self.calls[e.index]["arguments"] = e.arguments
            return self.close_open()
        return []

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
        """Reasoning summary text (only when the client opted in)."""
        if not (self.summaries and text):
            return []
        pairs: Pairs = []
        if self.open is None or self.open["type"] != "reasoning":
            item = {"id": new_id("rs_"), "type": "reasoning", "status": "in_progress",
                    "summary": []}
            pairs += self.add(item)
            pairs.append(("response.reasoning_summary_part.added", {
                **self.place(item), "summary_index": 0,
                "part": {"type": "summary_text", "text": ""}}))
        item = self.open
        self.text_of[item["id"]] = self.text_of.get(item["id"], "") + text
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
                          {**self.place(item), "content_index": 0, "delta": text}))
        return pairs

    def add_call(self, index: int, call_id: str, name: str) -> Pairs:
        """A function_call item, arguments still empty."""
        item = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress",
                "name": name, "call_id": call_id, "arguments": ""}
        self.calls[index] = item
        return self.add(item)

    def arguments_delta(self, item: dict, text: str) -> Pairs:
        """More argument bytes of a function call."""
        item["arguments"] += text
        return [("response.function_call_arguments.delta", {**self.place(item), "delta": text})]

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
        part = {"type": "summary_text", "text": self.text_of.get(item["id"], "")}
        item["summary"] = [part]
        return [("response.reasoning_summary_text.done",
                 {**self.place(item), "summary_index": 0, "text": part["text"]}),
                ("response.reasoning_summary_part.done",
                 {**self.place(item), "summary_index": 0, "part": part})]

    def _done_message(self, item: dict) -> Pairs:
        part = {"type": "output_text", "text": self.text_of.get(item["id"], ""), "annotations": []}
        item["content"] = [part]
        return [("response.output_text.done",
                 {**self.place(item), "content_index": 0, "text": part["text"]}),
                ("response.content_part.done", {**self.place(item), "content_index": 0,
                                                "part": part})]

    def _done_function_call(self, item: dict) -> Pairs:
        return [("response.function_call_arguments.done",
                 {**self.place(item), "arguments": item["arguments"]})]

    def settle(self, finished: Finished) -> Pairs:
        """Flush held-back text, add calls not streamed live, close the open item."""
        out = finished.output
        pairs = self.reasoning_delta(self.reasoning.finish(out.reasoning))
        has_message = any(i["type"] == "message" for i in self.items)
        rest = self.text.finish(out.content)
        pairs += self.text_delta(rest, force=not out.tool_calls and not has_message)
        for index, call in enumerate(out.tool_calls):
            if index not in self.calls:
                pairs += self.add_call(index, call.id, call.name)
                pairs += self.arguments_delta(self.calls[index], call.arguments)
        status = "incomplete" if finished.finish_reason == "length" else "completed"
        return pairs + self.close_open(status)
