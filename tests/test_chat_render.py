"""Prompt rendering: worked examples byte- and token-exact, and the rules of docs/PROTOCOLS.md."""

import hashlib

import pytest

from ds4.chat import (
    MAX_PREFIX,
    ToolMemory,
    canonical_turn,
    parse_output,
    render_anthropic,
    render_chat,
    render_completion,
)
from ds4.chat.special_tokens import SPECIAL_STRINGS
from ds4.tokenizer import Tokenizer

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
U1 = {"role": "user", "content": "What is the capital of France?"}
A1 = {"role": "assistant", "content": "The capital of France is Paris.",
      "reasoning_content": "Simple geography: it is Paris."}
U2 = {"role": "user", "content": "And of Italy?"}
EX1_IDS = [0, 3476, 477, 260, 11502, 22896, 16, 128803, 3085, 344, 270, 6102, 294, 8760, 33,
           128804, 128822, 671, 6102, 294, 8760, 344, 11111, 16, 1, 128803, 4195, 294, 14251, 33,
           128804, 128822]
MAX_FIRST_30 = [0, 77666, 288, 9504, 482, 28, 65174, 8173, 418, 1119, 102810, 23463, 603, 3476,
                74366, 366, 1855, 15146, 295, 782, 6892, 305, 98919, 107029, 270, 3295, 304,
                19727, 270, 4798]
WEATHER = {"name": "get_weather", "description": "Get the current weather for a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "description": "City name"},
               "days": {"type": "integer", "description": "Number of forecast days"}},
               "required": ["city"]}}
TOOLS = [{"type": "function", "function": WEATHER}]
WEATHER_USER = {"role": "user", "content": "Weather in Paris for 2 days?"}
P1_FIRST_30 = [0, 3476, 477, 260, 11502, 22896, 339, 372, 27193, 271, 3476, 611, 3278, 304, 260,
               1341, 294, 6704, 304, 1694, 3287, 270, 3967, 734, 3417, 16, 2042, 588, 34756, 6704]
P1_LAST_12 = [603, 128803, 58565, 295, 11111, 362, 223, 20, 3137, 33, 128804, 128821]
C1 = ('I need the get_weather tool.</think>\n\n<｜DSML｜tool_calls>\n'
      '<｜DSML｜invoke name="get_weather">\n'
      '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
      '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
      '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
C1_IDS = [43, 1309, 270, 1178, 65, 50219, 4105, 16, 128822, 271, 30, 128825, 72461, 4941, 12548,
          1018, 30, 128825, 40148, 5406, 2329, 1281, 1133, 65, 50219, 3816, 30, 128825, 41523,
          2329, 1281, 37399, 4, 3418, 1281, 11476, 3320, 51119, 1718, 128825, 41523, 1018, 30,
          128825, 41523, 2329, 1281, 28026, 4, 3418, 1281, 19836, 3320, 20, 1718, 128825, 41523,
          1018, 1718, 128825, 40148, 5406, 1018, 1718, 128825, 72461, 4941, 12548, 32]
TAIL_IDS = [1, 128803, 30, 72461, 46148, 32, 24313, 26343, 4941, 3362, 223, 864, 14, 582, 21307,
            3362, 582, 33163, 91, 4, 24568, 72461, 46148, 32, 128804, 128821]
RESULT = '{"temp_c": 18, "sky": "cloudy"}'


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.for_model()


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def weather_history():
    """EX3 turn 2 messages: the call echoed back as JSON plus its result."""
    call = {"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
    return [SYSTEM, WEATHER_USER,
            {"role": "assistant", "content": "",
             "reasoning_content": "I need the get_weather tool.",
             "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": RESULT}]


def test_ex1_chat_mode_bytes_and_ids(tok):
    text = render_chat([SYSTEM, U1, A1, U2], thinking="none")
    assert len(text.encode()) == 232
    assert sha(text) == "5447a94043791fa9cd641787c46ce2b061d80a698b41cd0cba5bae622915b357"
    assert tok.encode(text) == EX1_IDS


def test_ex2_thinking_drops_old_reasoning(tok):
    text = render_chat([SYSTEM, U1, A1, U2], thinking="high")
    assert sha(text) == "2d632a633adddb2dca5f2beea2b7b51347571b66a28c193ffd210676374a15ef"
    assert "Simple geography" not in text
    assert tok.encode(text) == EX1_IDS[:-1] + [128821]
    out = parse_output("The user now asks about Italy.</think>The capital of Italy is Rome.")
    assert (out.reasoning, out.content) == ("The user now asks about Italy.",
                                            "The capital of Italy is Rome.")


def test_ex2_think_max_prefix(tok):
    text = render_chat([SYSTEM, U1, A1, U2], thinking="max")
    assert len(text.encode()) == 707
    assert sha(text) == "3d8be148deda681492769fa02501d6ceec2520190c9bbb25d9b119930f3b0d14"
    ids = tok.encode(text)
    assert len(ids) == 111 and ids[:30] == MAX_FIRST_30
    assert ids[78:80] == [114867, 339] and ids[80:] == EX1_IDS[1:-1] + [128821]
    assert len(tok.encode(MAX_PREFIX)) == 79


def test_ex3_first_prompt(tok):
    p1 = render_chat([SYSTEM, WEATHER_USER], tools=TOOLS)
    assert len(p1.encode()) == 1388
    assert sha(p1) == "43f8137c6c2e8b1b89499014a2cfb1ee4afbe6e090b760118723d342c94f372a"
    ids = tok.encode(p1)
    assert len(ids) == 313 and ids[:30] == P1_FIRST_30 and ids[-12:] == P1_LAST_12


def test_ex3_second_prompt_extends_the_first_token_exactly(tok):
    p1 = render_chat([SYSTEM, WEATHER_USER], tools=TOOLS)
    out = parse_output(C1)
    assert out.reasoning == "I need the get_weather tool." and out.content == ""
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_weather", '{"city": "Paris", "days": 2}')]
    p2 = render_chat(weather_history(), tools=TOOLS)
    assert len(p2.encode()) == 1798
    assert sha(p2) == "4717f64a5f819b4b0a34b15e6e98c67cb67c88a2ed7c330c23c1b5278fe99ed3"
    assert tok.encode(C1) == C1_IDS
    assert tok.encode(p2) == tok.encode(p1) + C1_IDS + TAIL_IDS


def test_ex3_chat_mode():
    p2 = render_chat(weather_history(), tools=TOOLS, thinking="none")
    assert "<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n" in p2
    assert p2.endswith("</tool_result><｜Assistant｜></think>")
    assert "I need the get_weather tool." not in p2


def test_chat_mode_prefix_property(tok):
    """Turn N+1's prompt starts with turn N's prompt + sampled answer + EOS."""
    turn1 = render_chat([SYSTEM, U1], thinking="none")
    turn2 = render_chat([SYSTEM, U1, A1, U2], thinking="none")
    assert turn2.startswith(turn1 + A1["content"] + "<｜end▁of▁sentence｜>")


def test_tools_without_system_start_right_after_bos():
    text = render_chat([WEATHER_USER], tools=TOOLS, thinking="none")
    assert text.startswith("<｜begin▁of▁sentence｜>\n\n## Tools\n\nYou have access")
    assert "tool calls.\n<｜User｜>Weather in Paris" in text


def test_zero_argument_call_and_non_string_values():
    calls = [{"id": "a", "function": {"name": "ping", "arguments": "{}"}},
             {"id": "b", "function": {"name": "f", "arguments": '{"a":[1,2],"b":{"c":true}}'}}]
    text = render_chat([U1, {"role": "assistant", "content": "x", "tool_calls": calls}],
                       thinking="none")
    assert '<｜DSML｜invoke name="ping">\n\n</｜DSML｜invoke>' in text
    assert 'name="a" string="false">[1, 2]</' in text
    assert 'name="b" string="false">{"c": true}</' in text
    assert 'x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="ping">' in text


def test_unparsable_arguments_render_as_one_raw_parameter():
    calls = [{"id": "a", "function": {"name": "f", "arguments": "not json"}}]
    text = render_chat([U1, {"role": "assistant", "content": "", "tool_calls": calls}])
    assert '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>' in text


def test_arguments_given_as_object_render_per_key():
    calls = [{"id": "a", "function": {"name": "f", "arguments": {"k": "v", "n": 1}}}]
    text = render_chat([U1, {"role": "assistant", "content": "", "tool_calls": calls}])
    assert 'name="k" string="true">v</' in text and 'name="n" string="false">1</' in text


def test_results_sorted_into_call_order_and_merged_with_user_text():
    calls = [{"id": i, "function": {"name": "f", "arguments": "{}"}} for i in ("c1", "c2")]
    msgs = [U1, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c2", "content": "B"},
            {"role": "tool", "tool_call_id": "c1", "content": "A"},
            {"role": "user", "content": "thanks"}]
    text = render_chat(msgs, thinking="none")
    assert text.endswith("<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result>"
                         "\n\nthanks<｜Assistant｜></think>")


def test_system_and_developer_merge_and_text_parts_join():
    msgs = [SYSTEM, {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}]
    text = render_chat(msgs, thinking="none")
    assert text == ("<｜begin▁of▁sentence｜>You are a helpful assistant.\n\nBe brief."
                    "<｜User｜>ab<｜Assistant｜></think>")


def test_thinking_with_tools_keeps_every_turns_reasoning():
    msgs = [SYSTEM, U1, A1, U2]
    text = render_chat(msgs, tools=TOOLS)
    assert "<｜Assistant｜><think>Simple geography: it is Paris.</think>The capital" in text
    no_reasoning = [SYSTEM, U1, {"role": "assistant", "content": "Paris."}, U2]
    assert "<｜Assistant｜><think></think>Paris." in render_chat(no_reasoning, tools=TOOLS)


def test_tool_choice_none_renders_no_tools_block_but_keeps_history():
    text = render_chat(weather_history(), tools=TOOLS, tool_choice="none")
    assert "## Tools" not in text
    assert '<｜DSML｜invoke name="get_weather">' in text and "<tool_result>" in text


def test_replay_memory_preferred_over_canonical_bytes():
    sampled = C1.replace('"false">2<', '"false"> 2 <').split("</think>")[1]
    memory = ToolMemory()
    memory.remember(["call_0"], sampled)
    text = render_chat(weather_history(), tools=TOOLS, tool_memory=memory)
    assert "</think>" + sampled + "<｜end▁of▁sentence｜>" in text
    canonical = render_chat(weather_history(), tools=TOOLS)
    assert '"false">2<' in canonical and sampled not in canonical


def test_replay_needs_exactly_the_turns_ids():
    memory = ToolMemory(max_ids=2)
    memory.remember(["a", "b"], "BLOCK")
    assert memory.block_for(["a", "b"]) == "BLOCK"
    assert memory.block_for(["a"]) is None
    memory.remember(["c"], "OTHER")  # evicts "b", the least recently used id
    assert memory.lookup("b") is None and memory.block_for(["a", "b"]) is None
    assert memory.lookup("a") == "BLOCK" and memory.lookup("c") == "OTHER"


def test_completion_is_bos_and_the_prompt_as_written():
    assert render_completion("2+2=") == "<｜begin▁of▁sentence｜>2+2="
    assert render_completion("") == "<｜begin▁of▁sentence｜>"


def test_response_format_follows_tools():
    text = render_chat([SYSTEM, U1], tools=TOOLS, response_format={"type": "json_object"})
    assert ("tool calls.\n\n\n## Response Format:\n\nYou MUST strictly adhere to the following "
            'schema to reply:\n{"type": "json_object"}<｜User｜>') in text


def test_canonical_turn_continues_the_prompt_exactly():
    """prompt + canonical_turn(parse(C1)) is what the next request renders.

    See docs/PROTOCOLS.md, Canonical turns.
    """
    p1 = render_chat([SYSTEM, WEATHER_USER], tools=TOOLS)
    p2 = render_chat(weather_history(), tools=TOOLS)
    assert p2.startswith(p1 + canonical_turn(parse_output(C1), thinking=True))
    chat = render_chat(weather_history(), tools=TOOLS, thinking="none")
    chat_p1 = render_chat([SYSTEM, WEATHER_USER], tools=TOOLS, thinking="none")
    after = parse_output(C1.split("</think>")[1], thinking=False)
    assert chat.startswith(chat_p1 + canonical_turn(after, thinking=False))


def test_reasoning_replay_fills_a_turn_sent_back_without_reasoning():
    history = weather_history()
    del history[2]["reasoning_content"]
    memory = ToolMemory(replay_reasoning=True)
    memory.remember(["call_0"], parse_output(C1).raw_block, "I need the get_weather tool.")
    assert render_chat(history, tools=TOOLS, tool_memory=memory) == render_chat(
        weather_history(), tools=TOOLS)
    plain = ToolMemory()
    plain.remember(["call_0"], parse_output(C1).raw_block, "I need the get_weather tool.")
    assert "<think></think>\n\n<｜DSML｜tool_calls>" in render_chat(history, tools=TOOLS,
                                                                    tool_memory=plain)


def test_legacy_function_call_field():
    msgs = [U1, {"role": "assistant", "content": None,
                 "function_call": {"name": "f", "arguments": '{"x": 1}'}},
            {"role": "function", "name": "f", "content": "done"}]
    text = render_chat(msgs, thinking="none")
    assert ('<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x" string="false">1'
            '</｜DSML｜parameter>') in text
    assert text.endswith("<｜User｜><tool_result>done</tool_result><｜Assistant｜></think>")


def test_special_strings_are_the_spec_tokens(tok):
    """Each marker the renderer writes and the parser reads is one token (docs/PROTOCOLS.md)."""
    assert [tok.encode(s) for s in SPECIAL_STRINGS] == [
        [0], [1], [128803], [128804], [128821], [128822], [128825], [128828]]


def test_replay_memory_is_bounded_in_bytes_too():
    """LRU-bounded by ids and by bytes; a block shared by a turn's ids
    counts once and is freed with its last id."""
    memory = ToolMemory(max_bytes=10)
    memory.remember(["a", "b"], "123456")
    memory.remember(["c"], "1234")
    assert memory.held_bytes == 10 and memory.block_for(["a", "b"]) == "123456"
    memory.remember(["d"], "é")  # 2 bytes: "c" is now the oldest id
    assert memory.lookup("c") is None and memory.held_bytes == 8
    memory.remember(["e"], "xyz")  # frees "a" and "b" together
    assert memory.lookup("a") is None and memory.lookup("b") is None
    assert memory.held_bytes == 5 and memory.lookup("e") == "xyz"
    memory.remember(["f"], "x" * 11)  # larger than the whole budget: not kept
    memory.remember([], "no ids")  # nothing could ever free it
    assert memory.lookup("f") is None and memory.lookup("d") == "é"
    assert memory.held_bytes == 5 and len(memory) == 2


def test_text_response_format_adds_nothing():
    """OpenAI's {"type": "text"} is the default answer format, not a schema to adhere to."""
    plain = render_chat([SYSTEM, U1], thinking="none")
    assert render_chat([SYSTEM, U1], thinking="none", response_format={"type": "text"}) == plain


def test_a_request_not_ending_in_a_user_turn_still_opens_the_reply():
    """System-only and finished-assistant endings get the assistant prefix; a prefill does not."""
    system_only = render_chat([{"role": "system", "content": "S"}], thinking="none")
    assert system_only == "<｜begin▁of▁sentence｜>S<｜Assistant｜></think>"
    after_reply = render_chat([{"role": "user", "content": "u"},
                               {"role": "assistant", "content": "a"}],
                              thinking="high")
    assert after_reply.endswith("a<｜end▁of▁sentence｜><｜Assistant｜><think>")
    prefill = render_anthropic([{"role": "user", "content": "u"},
                                {"role": "assistant", "content": "a"}],
                               thinking="none")
    assert prefill.endswith("<｜Assistant｜></think>a")


def test_a_reply_after_an_in_conversation_system_message_is_still_a_turn(tok):
    """Claude Code sends [user, system, ...]: the reply that follows the system text opens
    with the assistant prefix, so the next prompt extends the one that asked for it."""
    mid = {"role": "system", "content": "Available agent types: claude, Explore."}
    for thinking, tools in (("high", TOOLS), ("high", None), ("none", TOOLS)):
        asked = render_chat([SYSTEM, U1, mid], tools=tools, thinking=thinking)
        nxt = render_chat([SYSTEM, U1, mid, A1, U2], tools=tools, thinking=thinking)
        opener = "<｜Assistant｜>" + ("<think>" if thinking == "high" else "</think>")
        assert asked.endswith(mid["content"] + opener)
        turn = (A1["reasoning_content"] + "</think>" if thinking == "high" and tools else "")
        if thinking == "high" and not tools:  # reasoning before the last user turn is dropped
            assert nxt.startswith(asked[:-len("<think>")] + "</think>" + A1["content"])
        else:
            assert nxt.startswith(asked + turn + A1["content"] + "<｜end▁of▁sentence｜>")
            assert tok.encode(nxt)[:len(tok.encode(asked))] == tok.encode(asked)
    # a conversation that opens with the assistant (no user turn before it) is unchanged
    assert render_chat([SYSTEM, A1], thinking="none") == (
        "<｜begin▁of▁sentence｜>" + SYSTEM["content"] + A1["content"]
        + "<｜end▁of▁sentence｜><｜Assistant｜></think>")
