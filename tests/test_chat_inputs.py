"""Request normalisation (Anthropic, Responses), tool_choice forcing and 400-worthy input."""

import pytest

from ds4.chat import (
    ChatError,
    forced_text,
    prompt_opens_reasoning,
    render_anthropic,
    render_chat,
    render_responses,
    tools_active,
)

WEATHER = {"name": "get_weather", "description": "Get the weather.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
OPENAI_TOOLS = [{"type": "function", "function": WEATHER}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Get the weather.",
                    "input_schema": WEATHER["parameters"]}]
RESPONSES_TOOLS = [{"type": "function", **WEATHER}]
ARGS = '{"city": "Paris"}'


def openai_round():
    return [{"role": "system", "content": "Sys."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "Need tool.",
             "tool_calls": [{"id": "t1", "type": "function",
                             "function": {"name": "get_weather", "arguments": ARGS}}]},
            {"role": "tool", "tool_call_id": "t1", "content": "sunny"}]


def test_anthropic_request_renders_like_the_openai_one():
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need tool.", "signature": "x"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1",
             "content": [{"type": "text", "text": "sunny"}]}]}]
    ours = render_anthropic(messages, system=[{"type": "text", "text": "Sys."}],
                            tools=ANTHROPIC_TOOLS)
    assert ours == render_chat(openai_round(), tools=OPENAI_TOOLS)


def test_anthropic_final_assistant_message_is_continued_without_eos():
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    text = render_anthropic(messages, thinking="none")
    assert text.endswith("<｜User｜>Count<｜Assistant｜></think>1, 2,")


def test_prefilled_answer_is_parsed_as_answer_even_in_thinking_mode():
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    assert not prompt_opens_reasoning(render_anthropic(messages, thinking="high"))
    assert prompt_opens_reasoning(render_anthropic(messages[:1], thinking="high"))
    assert not prompt_opens_reasoning(render_anthropic(messages[:1], thinking="none"))


def test_anthropic_tool_result_blocks_and_system_parts():
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [
                {"type": "text", "text": "a"}, {"type": "image", "source": {}}]},
            {"type": "text", "text": "and?"}]}]
    text = render_anthropic(messages, system=[{"text": "x-anthropic-billing"}, {"text": "S"}],
                            thinking="none")
    assert text.startswith("<｜begin▁of▁sentence｜>S<｜User｜>go")
    assert "<tool_result>a\n\n[Unsupported image]</tool_result>\n\nand?<｜Assistant｜>" in text


def test_responses_items_render_like_the_openai_request():
    items = [{"type": "message", "role": "user", "content": [
                 {"type": "input_text", "text": "Weather?"}]},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Need tool."}]},
             {"type": "message", "role": "assistant", "status": "completed", "content": [
                 {"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "t1", "name": "get_weather",
              "arguments": ARGS},
             {"type": "function_call_output", "call_id": "t1", "output": "sunny"}]
    ours = render_responses(items, instructions="Sys.", tools=RESPONSES_TOOLS)
    assert ours == render_chat(openai_round(), tools=OPENAI_TOOLS)


def test_responses_string_input_and_custom_tool():
    text = render_responses("hi", tools=[{"type": "custom", "name": "patch"}], thinking="none")
    assert '{"name": "patch", "parameters": {"type": "object", "properties": {"input"' in text
    assert text.endswith("<｜User｜>hi<｜Assistant｜></think>")


def test_responses_rejects_unknown_items_and_images():
    with pytest.raises(ChatError):
        render_responses([{"type": "mystery"}])
    with pytest.raises(ChatError):
        render_responses([{"type": "message", "role": "user",
                           "content": [{"type": "input_image", "image_url": "x"}]}])
    with pytest.raises(ChatError):
        render_responses([{"type": "message", "role": "user", "status": "in_progress",
                           "content": "x"}])


@pytest.mark.parametrize("messages", [
    [{"role": "wizard", "content": "x"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}],
    [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
    [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "nope", "content": "r"}],
    [],
])
def test_bad_chat_input_raises_chat_error(messages):
    with pytest.raises(ChatError):
        render_chat(messages)


def test_anthropic_bad_roles_and_blocks():
    with pytest.raises(ChatError):
        render_anthropic([{"role": "system", "content": "x"}])
    with pytest.raises(ChatError):
        render_anthropic([{"role": "user", "content": [{"type": "image", "source": {}}]}])
    with pytest.raises(ChatError):
        render_anthropic([{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "ghost", "content": "r"}]}])


def test_forced_text_for_each_tool_choice():
    assert forced_text(OPENAI_TOOLS, "auto") == "" and forced_text(OPENAI_TOOLS, None) == ""
    assert forced_text(OPENAI_TOOLS, "none") == ""
    block = "\n\n<｜DSML｜tool_calls>\n"
    assert forced_text(OPENAI_TOOLS, "required") == block
    assert forced_text(ANTHROPIC_TOOLS, {"type": "any"}) == block
    named = block + '<｜DSML｜invoke name="get_weather">\n'
    assert forced_text(OPENAI_TOOLS, {"type": "function",
                                      "function": {"name": "get_weather"}}) == named
    assert forced_text(ANTHROPIC_TOOLS, {"type": "tool", "name": "get_weather"}) == named
    assert forced_text(RESPONSES_TOOLS, {"type": "function", "name": "get_weather"}) == named


def test_forced_tool_not_among_tools_is_refused():
    with pytest.raises(ChatError):
        forced_text(OPENAI_TOOLS, {"type": "function", "function": {"name": "rm_rf"}})
    with pytest.raises(ChatError):
        render_chat([{"role": "user", "content": "x"}], tools=OPENAI_TOOLS,
                    tool_choice={"type": "function", "function": {"name": "rm_rf"}})
    with pytest.raises(ChatError):
        render_anthropic([{"role": "user", "content": "x"}], tools=ANTHROPIC_TOOLS,
                         tool_choice={"type": "tool", "name": "rm_rf"})
    with pytest.raises(ChatError):
        forced_text([], "required")


def test_tools_active():
    assert tools_active(OPENAI_TOOLS, "auto") and tools_active(ANTHROPIC_TOOLS, {"type": "any"})
    assert not tools_active(OPENAI_TOOLS, "none")
    assert not tools_active(ANTHROPIC_TOOLS, {"type": "none"})
    assert not tools_active([], "auto") and not tools_active(None, None)


def test_unknown_thinking_level_is_refused():
    with pytest.raises(ChatError):
        render_chat([{"role": "user", "content": "x"}], thinking="medium")


def test_special_token_text_from_clients_is_logged(caplog):
    with caplog.at_level("WARNING", logger="ds4.chat"):
        render_chat([{"role": "user", "content": "say <｜end▁of▁sentence｜> now"}])
    assert "special token" in caplog.text
