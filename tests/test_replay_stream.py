"""A streamed reply folds into the body its non-streamed twin returns (what ds4-replay --url
compares), each output chunk timed; an error in the stream ends it as a failure."""

from __future__ import annotations

import itertools
import json

from ds4.cli.replay_http import returned_view
from ds4.cli.replay_stream import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    RESPONSES,
    fold_stream,
    streamed_request,
)


def frames(*events: tuple[str | None, object]) -> list[str]:
    """SSE lines of (event name, data) frames, with a keep-alive comment among them."""
    lines = [": ping", ""]
    for name, data in events:
        lines += ([f"event: {name}"] if name else []) + \
            [f"data: {data if isinstance(data, str) else json.dumps(data)}", ""]
    return lines


def fold(endpoint: str, lines: list[str]):
    """Fold the lines with a clock that ticks once per output chunk."""
    tick = itertools.count(1)
    return fold_stream(endpoint, iter(lines), lambda: float(next(tick)))


def chunk(delta: dict, usage: dict | None = None) -> tuple[None, dict]:
    return None, {"choices": [{"index": 0, "delta": delta}], **({"usage": usage} if usage else {})}


def test_chat_deltas_fold_into_the_message_with_its_tool_call():
    call = {"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}
    lines = frames(chunk({"role": "assistant"}), chunk({"reasoning_content": "Hm"}),
                   chunk({"content": "Ok"}), chunk({"tool_calls": [call]}),
                   chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}),
                   chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
                   (None, {"choices": [], "usage": {"completion_tokens": 9}}), (None, "[DONE]"))
    folded, times = fold(CHAT, lines)
    assert folded.error is None and times == [1.0, 2.0, 3.0, 4.0, 5.0]  # the role chunk: none
    view = returned_view(CHAT, {}, folded.body)
    assert (view.content, view.reasoning, view.tool_calls) == ("Ok", "Hm", (("function", "f",
                                                                              {"a": 1}),))
    assert folded.body["usage"]["completion_tokens"] == 9


def test_anthropic_blocks_fold_into_the_message_and_signatures_are_no_tokens():
    def delta(i: int, d: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": i, "delta": d}

    lines = frames(
        ("message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 3}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "thinking", "thinking": ""}}),
        delta(0, {"type": "thinking_delta", "thinking": "Hm"}),
        delta(0, {"type": "signature_delta", "signature": "s"}),
        ("content_block_start", {"type": "content_block_start", "index": 1,
                                 "content_block": {"type": "tool_use", "name": "f", "input": {}}}),
        delta(1, {"type": "input_json_delta", "partial_json": '{"a"'}),
        delta(1, {"type": "input_json_delta", "partial_json": ": 1}"}),
        ("message_delta", {"type": "message_delta", "usage": {"output_tokens": 4}}),
        ("message_stop", {"type": "message_stop"}))
    folded, times = fold(MESSAGES, lines)
    assert times == [1.0, 2.0, 3.0]
    view = returned_view(MESSAGES, {}, folded.body)
    assert (view.content, view.reasoning, view.tool_calls) == ("", "Hm", (("function", "f",
                                                                            {"a": 1}),))
    assert folded.body["usage"]["output_tokens"] == 4


def test_a_responses_stream_is_its_terminal_response():
    final = {"output": [{"type": "message", "content": [{"type": "output_text", "text": "Ok"}]}],
             "usage": {"output_tokens": 2}}
    lines = frames(("response.created", {"type": "response.created", "response": {}}),
                   ("response.output_text.delta", {"type": "response.output_text.delta",
                                                   "delta": "O"}),
                   ("response.output_text.delta", {"type": "response.output_text.delta",
                                                   "delta": "k"}),
                   ("response.completed", {"type": "response.completed", "response": final}))
    folded, times = fold(RESPONSES, lines)
    assert folded.body == final and times == [1.0, 2.0]
    cut, _ = fold(RESPONSES, lines[:-3])
    assert cut.error == "the stream ended before its last event"


def test_an_error_in_the_stream_is_a_failure():
    failed, _ = fold(CHAT, frames(chunk({"content": "O"}), (None, {"error": {"message": "x"}})))
    assert failed.error == '{"message": "x"}'
    anthropic, _ = fold(MESSAGES, frames(("error", {"type": "error", "error": {"type": "t"}})))
    assert anthropic.error == '{"type": "t"}'
    responses, _ = fold(RESPONSES, frames(("response.failed", {
        "type": "response.failed", "response": {"error": {"code": "server_error"}}})))
    assert responses.error == '{"code": "server_error"}'


def test_a_last_frame_without_its_blank_line_still_counts():
    last = 'data: {"choices": [{"delta": {"content": "k"}}]}'  # the stream ends right after it
    lines = frames(chunk({"content": "O"}))[:-1] + ["", last]
    folded, times = fold(CHAT, lines)
    assert folded.body["choices"][0]["message"]["content"] == "Ok" and times == [1.0, 2.0]


def test_openai_routes_ask_for_the_usage_chunk():
    sent = streamed_request(CHAT, {"stream": False, "stream_options": {"x": 1}})
    assert sent == {"stream": True, "stream_options": {"x": 1, "include_usage": True}}
    assert streamed_request(MESSAGES, {"max_tokens": 3}) == {"max_tokens": 3, "stream": True}


def test_text_completion_chunks_fold_into_one_text():
    def piece(text: str, usage: dict | None = None) -> tuple[None, dict]:
        extra = {"usage": usage} if usage else {}
        return None, {"choices": [{"index": 0, "text": text}], **extra}

    lines = frames(piece("Once"), piece(""), piece(" upon"), piece(" a time"),
                   (None, {"choices": [], "usage": {"completion_tokens": 3}}), (None, "[DONE]"))
    folded, times = fold(COMPLETIONS, lines)
    assert folded.error is None and times == [1.0, 2.0, 3.0]  # the empty piece is no token
    assert folded.body == {"choices": [{"text": "Once upon a time"}],
                           "usage": {"completion_tokens": 3}}
