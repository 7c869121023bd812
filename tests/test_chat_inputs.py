"""Request normalisation (Anthropic, Responses), tool_choice forcing and 400-worthy input."""

import pytest

from ds4.chat import (
    ChatError,
    forced_text,
    parse_output,
    prompt_opens_reasoning,
    render_anthropic,
    render_chat,
    render_responses,
    tools_active,
)
from ds4.chat.responses import custom_input, local_shell_action, responses_call_kinds

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


PATCH = '*** Begin Patch\n*** Add File: a.txt\n+say "hi" \\ bye\n*** End Patch'
CODEX_TOOLS = [
    {"type": "function", "name": "shell", "parameters": {
        "type": "object", "properties": {"command": {"type": "array"}}}},
    {"type": "custom", "name": "apply_patch", "description": "Edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'}},
    {"type": "local_shell"},
    {"type": "web_search"},
]
SHELL_ACTION = {"type": "exec", "command": ["ls", "-la"], "working_directory": "/repo",
                "env": {}}
CODEX_HISTORY = [
    {"type": "message", "role": "user", "content": "Add a.txt"},
    {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": PATCH,
     "status": "completed"},
    {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done!"},
    {"type": "local_shell_call", "id": "lsh_1", "call_id": "c2", "status": "completed",
     "action": {**SHELL_ACTION, "timeout_ms": None}},
    {"type": "local_shell_call_output", "id": "c2", "output": "a.txt"},
]


def assistant_turns(prompt: str) -> list[str]:
    """The generated text of each past assistant turn of a chat-mode prompt."""
    turns = prompt.split("<｜Assistant｜></think>")[1:]
    return [t.split("<｜end▁of▁sentence｜>")[0] for t in turns if "<｜end▁of▁sentence｜>" in t]


def test_codex_custom_and_local_shell_calls_survive_render_then_parse():
    prompt = render_responses(CODEX_HISTORY, tools=CODEX_TOOLS, thinking="none")
    grammar = 'Raw text, not JSON, matching this lark grammar:\\nstart: \\"*** Begin Patch'
    assert grammar in prompt
    assert '{"name": "local_shell", "description": "Runs a command' in prompt
    assert "web_search" not in prompt  # a hosted tool we cannot run is not offered
    assert "<tool_result>Done!</tool_result>" in prompt
    assert "<tool_result>a.txt</tool_result>" in prompt
    patch_turn, shell_turn = [parse_output(t, thinking=False) for t in assistant_turns(prompt)]
    [patch], [shell] = patch_turn.tool_calls, shell_turn.tool_calls
    assert patch.name == "apply_patch" and custom_input(patch.arguments) == PATCH
    assert shell.name == "local_shell" and local_shell_action(shell.arguments) == SHELL_ACTION
    assert responses_call_kinds(CODEX_TOOLS) == {"apply_patch": "custom",
                                                  "local_shell": "local_shell"}


def test_custom_input_and_shell_action_of_off_schema_arguments():
    assert custom_input('{"patch": "raw"}') == "raw"
    assert custom_input('{"input": 3, "x": 1}') == '{"input": 3, "x": 1}'
    assert local_shell_action('{"command": "ls -la"}') is None
    assert local_shell_action('{"command": ["ls"], "timeout_ms": 500}') == {
        "type": "exec", "command": ["ls"], "env": {}, "timeout_ms": 500}


def test_responses_rejects_unknown_items_and_images():
    with pytest.raises(ChatError):
        render_responses([{"type": "mystery"}])
    with pytest.raises(ChatError):
        render_responses([{"type": "message", "role": "user",
                           "content": [{"type": "input_image", "image_url": "x"}]}])
    with pytest.raises(ChatError):
        render_responses([{"type": "message", "role": "user", "status": ["x"],
                           "content": "x"}])


def test_responses_items_read_the_same_whatever_their_status():
    """A turn cut at max_output_tokens comes back "incomplete" (Codex's resume)."""
    items = [{"type": "message", "role": "user", "content": "hi"},
             {"type": "message", "role": "assistant", "content": "cut he"},
             {"type": "message", "role": "user", "content": "go on"}]
    plain = render_responses(items)
    for status in ("completed", "incomplete", "in_progress", None):
        assert render_responses([{**i, "status": status} for i in items]) == plain


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
    with pytest.raises(ChatError, match="message role 'tool' is not supported"):
        render_anthropic([{"role": "tool", "content": "x"}])
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


USER = {"role": "user", "content": "x"}
F_CALL = {"role": "assistant", "content": "",
          "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{}"}}]}


BAD_FIELDS = {
    "tool_call_id object": lambda: render_chat([USER, F_CALL, {
        "role": "tool", "tool_call_id": {"a": 1}, "content": "r"}]),
    "call id list": lambda: render_chat([USER, {"role": "assistant", "tool_calls": [
        {"id": ["a"], "function": {"name": "f", "arguments": "{}"}}]}]),
    "tool_calls number": lambda: render_chat([USER, {"role": "assistant", "tool_calls": 5}]),
    "named choice, tool not an object": lambda: render_chat(
        [USER], tools=[1], tool_choice={"type": "function", "function": {"name": "f"}}),
    "forced_text, tool not an object": lambda: forced_text(
        [1], {"type": "function", "function": {"name": "f"}}),
    "anthropic text number": lambda: render_anthropic(
        [{"role": "user", "content": [{"type": "text", "text": 5}]}]),
    "anthropic thinking number": lambda: render_anthropic([USER, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": 5}]}]),
    "anthropic tool_use_id list": lambda: render_anthropic([{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": ["t"], "content": "r"}]}]),
    "anthropic result text list": lambda: render_anthropic([USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": [{"type": "text", "text": [5]}]}]}]),
    "anthropic tool_use name number": lambda: render_anthropic([USER, {
        "role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": 5}]}]),
    "anthropic named choice, tool a string": lambda: render_anthropic(
        [USER], tools=["x"], tool_choice={"type": "tool", "name": "f"}),
    "responses summary number": lambda: render_responses([{"type": "reasoning", "summary": 5}]),
    "responses namespace number": lambda: render_responses([{
        "type": "function_call", "name": "f", "namespace": 5, "call_id": "c"}]),
    "responses call_id list": lambda: render_responses([{
        "type": "function_call_output", "call_id": [1], "output": "x"}]),
    "responses function number": lambda: render_responses(
        "x", tools=[{"type": "function", "function": 5}]),
    "responses namespace tool number": lambda: render_responses(
        "x", tools=[{"type": "namespace", "name": "n", "tools": [1]}]),
    "responses namespace name number": lambda: render_responses("x", tools=[{
        "type": "namespace", "name": 5, "tools": [{"type": "function", "name": "a"}]}]),
    "responses namespace tools number": lambda: render_responses(
        "x", tools=[{"type": "namespace", "name": "n", "tools": 5}]),
}


@pytest.mark.parametrize("render", BAD_FIELDS.values(), ids=BAD_FIELDS.keys())
def test_wrongly_typed_fields_are_chat_errors_not_crashes(render):
    """Every malformed request the server passes through is a 400, never a 500."""
    with pytest.raises(ChatError):
        render()


def test_null_texts_render_as_empty_text():
    messages = [{"role": "user", "content": [{"type": "text", "text": None}]},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": None}]}]
    assert render_anthropic(messages, thinking="none").endswith(
        "<｜User｜><｜Assistant｜></think>")


def test_namespace_tools_render_as_prefixed_functions():
    """A namespace's functions are offered as prefix+name, and a call item naming its
    namespace renders like the flat name the server returned."""
    tools = [{"type": "namespace", "name": "mcp__fs__", "tools": [
        {"type": "function", "name": "read", "parameters": {"type": "object"}}]}]
    head = [{"type": "message", "role": "user", "content": "hi"}]
    result = [{"type": "function_call_output", "call_id": "c", "output": "ok"}]
    nested = {"type": "function_call", "call_id": "c", "name": "read", "namespace": "mcp__fs__",
              "arguments": "{}"}
    flat = {"type": "function_call", "call_id": "c", "name": "mcp__fs__read", "arguments": "{}"}
    prompt = render_responses(head + [nested] + result, tools=tools, thinking="none")
    assert '{"name": "mcp__fs__read", "parameters": {"type": "object"}}' in prompt
    assert '<｜DSML｜invoke name="mcp__fs__read">' in prompt
    assert prompt == render_responses(head + [flat] + result, tools=tools, thinking="none")


def test_image_in_a_call_output_is_named_not_dumped():
    """Codex's view_image answers with an input_image part: like an Anthropic tool_result
    image it becomes a placeholder, never the base64 data as JSON text."""
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    items = [{"type": "message", "role": "user", "content": "look"},
             {"type": "function_call", "call_id": "c", "name": "view_image", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c",
              "output": [{"type": "input_text", "text": "a"}, image]}]
    prompt = render_responses(items, thinking="none")
    assert "<tool_result>a\n\n[Unsupported input_image]</tool_result>" in prompt
    assert "base64" not in prompt
