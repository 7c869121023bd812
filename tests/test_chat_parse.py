"""Output parsing (docs/PROTOCOLS.md): the final parse, and the stream agreeing with it for every
split of the text, including token by token with the real tokenizer."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4.chat import (
    Done,
    OutputParser,
    ReasoningDelta,
    TextDelta,
    ToolArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    parse_output,
)
from ds4.chat.items import Call
from ds4.chat.tools_block import dsml_calls
from ds4.tokenizer import Tokenizer

C1 = ('I need the get_weather tool.</think>\n\n<｜DSML｜tool_calls>\n'
      '<｜DSML｜invoke name="get_weather">\n'
      '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
      '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
      '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
RICH = ('<think>Plan: call </｜DSML｜ two tools; é 😀 </thin k.</think>Sure — doing it \n\n'
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="write">\n'
        '<｜DSML｜parameter name="path" string="true">/tmp/ä "x"\\n'
        '</｜DSML｜param</｜DSML｜parameter>'
        '\n<｜DSML｜parameter name="opts" string="false">{"a": [1, 2], "b": null}'
        '</｜DSML｜parameter>\n<｜DSML｜parameter name="bad" string="false">not json'
        '</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="ping">\n\n</｜DSML｜invoke>\n'
        '</｜DSML｜tool_calls>ignored after the block')
PLAIN = ('ok</think>Text<tool_calls>\n<invoke name="f">\n<parameter name="k">v</parameter>\n'
         '</invoke>\n</tool_calls>')
NO_TOOLS = 'why</think>Answer with <｜DSML｜tool_calls> shown literally \n\n'


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.for_model()


def stream(chunks, **kw):
    """Feed byte chunks; return (events, parser)."""
    parser = OutputParser(**kw)
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    return events, parser


def collate(events):
    """What a client rebuilds from the events: reasoning, content, finished calls."""
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    starts = {e.index: e for e in events if isinstance(e, ToolCallStart)}
    calls = []
    for end in (e for e in events if isinstance(e, ToolCallEnd)):
        streamed = "".join(e.text for e in events
                           if isinstance(e, ToolArgsDelta) and e.index == end.index)
        assert streamed == end.arguments
        calls.append((starts[end.index].id, starts[end.index].name, end.arguments))
    return reasoning, content, calls


def assert_stream_matches(text: str, chunks, **kw):
    events, parser = stream(chunks, **kw)
    final = parse_output(text, **kw)
    assert collate(events) == (final.reasoning, final.content,
                               [(c.id, c.name, c.arguments) for c in final.tool_calls])
    assert parser.result() == final
    assert (Done() in events) == parser.done
    return final, parser


def byte_cuts(data: bytes):
    for i in range(len(data) + 1):
        yield [data[:i], data[i:]]


@pytest.mark.parametrize("text,kw", [
    (C1, {}), (RICH, {}), (PLAIN, {}), (NO_TOOLS, {"tools_active": False}),
    ("</think>chat " + C1.split("</think>")[1], {"thinking": False}),
    ("never closed <thi", {}), ("<thin", {}), ("a</think>b  \n", {}),
])
def test_stream_equals_final_parse_for_every_cut(text, kw):
    data = text.encode()
    for chunks in byte_cuts(data):
        assert_stream_matches(text, chunks, **kw)
    assert_stream_matches(text, [bytes([b]) for b in data], **kw)


def test_stream_token_by_token_with_the_real_tokenizer(tok):
    for text in (C1, RICH, PLAIN):
        ids = tok.encode(text)
        final, _ = assert_stream_matches(text, [tok.token_bytes(i) for i in ids])
        assert final.malformed is None and not final.unterminated


def test_ex3_stream_fragments(tok):
    events, parser = stream([tok.token_bytes(i) for i in tok.encode(C1)])
    assert [e.text for e in events if isinstance(e, ToolArgsDelta)] == [
        "{", '"city": "', "Paris", '"', ', "days": ', "2", "}"]
    start = next(e for e in events if isinstance(e, ToolCallStart))
    assert start.name == "get_weather" and start.index == 0
    assert start.id.startswith("call_") and len(start.id) == 5 + 32
    assert int(start.id[5:], 16) >= 0 and start.id[5:] == start.id[5:].lower()
    assert parser.result().tool_calls[0].id == start.id and parser.done


def test_rich_parse():
    out = parse_output(RICH, id_prefix="toolu_")
    assert out.reasoning == "Plan: call </｜DSML｜ two tools; é 😀 </thin k."
    assert out.content == "Sure — doing it "
    write, ping = out.tool_calls
    assert json.loads(write.arguments) == {"path": '/tmp/ä "x"\\n</｜DSML｜param',
                                           "opts": {"a": [1, 2], "b": None}, "bad": "not json"}
    assert ping.name == "ping" and ping.arguments == "{}" and ping.id.startswith("toolu_")
    assert write.id != ping.id
    assert out.raw_block.startswith("\n\n<｜DSML｜tool_calls>")
    assert out.raw_block.endswith("</｜DSML｜tool_calls>")
    assert RICH.split("</think>", 1)[1].startswith(out.content + out.raw_block)


def test_ids_follow_the_seed_and_the_text():
    a = parse_output(C1).tool_calls[0].id
    assert parse_output(C1).tool_calls[0].id == a
    assert parse_output(C1, id_seed="job-7").tool_calls[0].id != a
    assert parse_output("x" + C1).tool_calls[0].id != a


def test_tolerated_plain_tags_and_missing_string_attribute():
    out = parse_output(PLAIN)
    assert out.content == "Text" and out.tool_calls[0].arguments == '{"k": "v"}'


def test_tolerated_start_marker_without_first_bar():
    short = C1.replace("｜DSML｜", "DSML｜")
    out = parse_output(short)
    assert out.tool_calls[0].arguments == '{"city": "Paris", "days": 2}'
    assert out.raw_block == short.split("</think>")[1]


def test_chat_mode_and_inactive_tools():
    out = parse_output("</think>Hi</think>there", thinking=False)
    assert (out.reasoning, out.content) == ("", "Hi</think>there")
    out = parse_output(NO_TOOLS, tools_active=False)
    assert out.content == NO_TOOLS.split("</think>")[1] and out.tool_calls == []


def test_thinking_without_end_is_all_reasoning():
    out = parse_output("<think>still thinking <｜DSML｜tool_calls>")
    assert out.reasoning == "still thinking <｜DSML｜tool_calls>" and out.content == ""


BAD_INVOKE = "malformed DSML: invalid invoke tag"
TURN_IN_BLOCK = "malformed DSML: a turn marker inside the tool calls"


@pytest.mark.parametrize("good,bad,message", [
    ('<｜DSML｜invoke name="f">\n', 'hello</｜DSML｜invoke>',
     "malformed DSML: expected a parameter or the end of the invoke"),
    ('<｜DSML｜invoke name="f">\n', 'X </｜DSML｜invoke>',  # X is no whitespace
     "malformed DSML: expected a parameter or the end of the invoke"),
    ('', 'junk', "malformed DSML: expected an invoke or the end of the tool calls"),
    ('', '<｜DSML｜invoke nam="f">\n</｜DSML｜invoke>', BAD_INVOKE),
    ('', '<｜DSML｜invoke name="">\n</｜DSML｜invoke>', BAD_INVOKE),
    ('', '<｜DSML｜invoke name="f" junk>\n</｜DSML｜invoke>', BAD_INVOKE),
    ('<｜DSML｜invoke name="f">\n',
     ('<｜DSML｜parameter name="k" string="maybe">v</｜DSML｜parameter>'),
     "malformed DSML: invalid parameter tag"),
    ('<｜DSML｜invoke name="f">\n', '<｜DSML｜parameter string="true">v</｜DSML｜parameter>',
     "malformed DSML: invalid parameter tag"),
    ('<｜DSML｜invoke name="f">\n', '<｜DSML｜parameter name="k" "x">v</｜DSML｜parameter>',
     "malformed DSML: invalid parameter tag"),
    ('<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="k" string="true">', 'v<｜User｜>hi',
     TURN_IN_BLOCK),
    ('<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="k" string="false">',
     '[1, <｜Assistant｜>', TURN_IN_BLOCK),
])
def test_malformed_dsml_is_reported_with_the_valid_offset(good, bad, message):
    head = 'r</think>C\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="ok">\n</｜DSML｜invoke>\n'
    head += good
    text = head + bad
    final, parser = assert_stream_matches(text, [text.encode()])
    assert final.malformed == parser.error == message
    assert not final.unterminated and len(final.tool_calls) == 1
    assert parser.valid_offset == len(head.encode())
    for chunks in byte_cuts(text.encode()):
        assert_stream_matches(text, chunks)


def test_every_unfinished_block_is_unterminated():
    opened = C1.index("<｜DSML｜tool_calls>") + 1
    for cut in range(opened + len("<｜DSML｜tool_calls>"), len(C1)):
        final, parser = assert_stream_matches(C1[:cut], [C1[:cut].encode()])
        assert final.unterminated and final.malformed is None, C1[:cut]
        assert parser.error == "unterminated tool call" and not parser.done


def test_structure_flag_follows_the_syntax(tok):
    parser = OutputParser()
    seen = []
    for i in tok.encode(C1):
        parser.feed(tok.token_bytes(i))
        seen.append((tok.token_bytes(i).decode(errors="replace"), parser.in_dsml_structure,
                     parser.reasoning_done))
    assert not any(flag for text, flag, _ in seen[:8])  # reasoning
    assert seen[8] == ("</think>", False, True)
    paris = next(n for n, s in enumerate(seen) if s[0] == "Paris")
    # the flag governs the NEXT token: the tag is greedy up to its `">`, the body is not,
    # and a partial closing tag is greedy again
    assert [s[1] for s in seen[paris - 2:paris + 2]] == [True, False, False, True]
    assert seen[-1][1] is False and parser.done


def test_forced_prefix_is_parsed_like_sampled_text():
    parser = OutputParser(thinking=False)
    assert parser.reasoning_done
    parser.feed('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'.encode())
    assert parser.in_dsml_structure
    events = parser.feed('</｜DSML｜invoke>\n</｜DSML｜tool_calls>'.encode())
    assert ToolCallEnd(0, "{}") in events and parser.done


# ---- round trip over generated assistant turns (hypothesis) ---------------------------------

# Pieces that build partial DSML/think markers (which the filter keeps from completing),
# mixed with arbitrary characters.
TRICKY = ["<", ">", "/", "｜", "DSML", "\n\n", "\n", "\t", " ", '"', "\\", "{", "}", "é", "😀",
          "\x00", "\r", "</thin", "<thin", "<｜DSML｜tool_call", "</｜DSML｜paramet", "<tool_call",
          "<DSML｜", "</｜DSML｜invok", "<｜DSML｜", "</｜DSML｜tool_calls"]
MARKERS = ("</think>", "<think>", "tool_calls>", "<｜DSML｜invoke", "</｜DSML｜parameter>",
           "<invoke", "<parameter", "</parameter>")
free_text = st.lists(st.one_of(st.sampled_from(TRICKY), st.characters(exclude_categories=("Cs",))),
                     max_size=12).map("".join).filter(lambda s: not any(m in s for m in MARKERS))
names = st.text("abcdefghijklmnopqrstuvwxyz_.-0123456789", min_size=1, max_size=12)
keys = free_text.filter(lambda s: '"' not in s and ">" not in s)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | free_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=6)
calls = st.lists(st.builds(lambda n, a: Call("", n, a), names,
                           st.dictionaries(keys, json_values, max_size=4)), max_size=3)


@given(reasoning=free_text, content=free_text, turn_calls=calls, thinking=st.booleans(),
       cuts=st.lists(st.integers(0, 4000), max_size=6))
@settings(max_examples=200, deadline=None)
def test_round_trip_of_generated_turns(reasoning, content, turn_calls, thinking, cuts):
    answer = content + dsml_calls(turn_calls)
    text = (reasoning + "</think>" if thinking else "") + answer
    out = parse_output(text, thinking=thinking)
    assert out.reasoning == (reasoning if thinking else "") and out.content == content
    got = [(c.name, json.dumps(json.loads(c.arguments))) for c in out.tool_calls]
    assert got == [(c.name, json.dumps(c.arguments)) for c in turn_calls]
    rendered = dsml_calls([Call(c.id, c.name, c.arguments) for c in out.tool_calls])
    assert out.content + rendered == answer  # render(parse(C)) == C
    assert out.raw_block == rendered and out.malformed is None and not out.unterminated
    data = text.encode()
    points = sorted({c % (len(data) + 1) for c in cuts})
    chunks = [data[a:b] for a, b in zip([0] + points, points + [len(data)])]
    assert_stream_matches(text, chunks, thinking=thinking)


def test_structure_flag_inside_json_values():
    parser = OutputParser(thinking=False)
    parser.feed('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
                '<｜DSML｜parameter name="o" string="false">{"a": '.encode())
    assert parser.in_dsml_structure  # punctuation: greedy
    parser.feed(b'"free \\" text')
    assert not parser.in_dsml_structure  # inside a JSON string literal: normal sampling
    parser.feed(b'"}')
    assert parser.in_dsml_structure


DSML_PIECES = ["<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", "<｜DSML｜invoke",
               "</｜DSML｜invoke>",
               "<｜DSML｜parameter", "</｜DSML｜parameter>", ' name="f"', ' name="k"',
               ' string="true"', ' string="false"', ">", "\n", "</think>", "<think>",
               "<tool_calls>",
               "<invoke", "</invoke>", "</parameter>", "1", "[2]", '"s"', "<｜User｜>",
               "<｜Assistant｜>"]
fuzz_text = st.lists(st.sampled_from(DSML_PIECES + TRICKY), max_size=40).map("".join)


@given(text=fuzz_text, thinking=st.booleans(), tools=st.booleans(),
       cuts=st.lists(st.integers(0, 4000), max_size=6))
@settings(max_examples=300, deadline=None)
def test_stream_equals_final_parse_on_arbitrary_text(text, thinking, tools, cuts):
    """Whatever the model writes (well-formed, malformed, cut short) the two parsers agree."""
    data = text.encode()
    points = sorted({c % (len(data) + 1) for c in cuts})
    chunks = [data[a:b] for a, b in zip([0] + points, points + [len(data)])]
    final, parser = assert_stream_matches(text, chunks, thinking=thinking, tools_active=tools)
    assert (parser.error is not None) == bool(final.malformed or final.unterminated)


def test_a_whole_call_block_in_one_piece_is_parsed_in_that_feed():
    # nothing waits for a later byte once the block is complete: both calls end, and the turn
    # is done, before finish() (a round that stopped at a string value's close would hold the
    # rest of the block until the next token)
    calls = [Call("", "get", '{"city": "Paris", "n": 2}'), Call("", "put", '{"k": "v"}')]
    block = dsml_calls(calls)
    parser = OutputParser(thinking=False)
    kinds = [type(e).__name__ for e in parser.feed(("Sure." + block).encode())]
    assert kinds.count("ToolCallEnd") == 2 and kinds[-1] == "Done"
    assert [c.name for c in parser.result().tool_calls] == ["get", "put"]


def test_reasoning_done_and_dsml_structure_follow_the_parsers_state():
    # reasoning_done: where forced tool-call text may go in; in_dsml_structure: when the
    # decoder samples greedily (a held start marker in the answer, not plain text)
    parser = OutputParser(thinking=True)
    parser.feed(b"<think>hmm")
    assert not parser.reasoning_done and not parser.in_dsml_structure
    parser.feed(b"</think>Hello ")
    assert parser.reasoning_done and not parser.in_dsml_structure
    parser.feed("<｜DSML｜to".encode())
    assert parser.state == "content" and parser.in_dsml_structure


def test_an_empty_non_string_parameter_keeps_its_call():
    # the end tag right at the value's first byte: the call still ends (its value read as an
    # empty string), in the stream as in the whole-text parse
    text = dsml_calls([Call("", "get", '{"n": 2}')]).replace(">2<", "><")
    events, parser = stream([text.encode()], thinking=False)
    assert [(c.name, c.arguments) for c in parser.result().tool_calls] == [("get", '{"n": ""}')]
    assert parse_output(text, thinking=False).tool_calls == parser.result().tool_calls
    assert parser.result().malformed is None
