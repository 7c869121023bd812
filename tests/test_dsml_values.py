"""Tool-call argument values as a client receives them: a parameter without `string` is a string,
and a `string="false"` value that is not strict JSON (NaN, Infinity) reaches the client as its
JSON string, so the arguments are always valid JSON. Checked on the final parse and on the
stream (the bytes the client concatenates), and on a scripted job's finished tool call."""

from __future__ import annotations

import json

import pytest
from test_jobs_support import Recorder, ScriptedEngine

from ds4.chat import OutputParser, ToolArgsDelta, ToolCallEnd, parse_output
from ds4.jobs.events import JobRequest
from ds4.jobs.scheduler import Scheduler, SchedulerConfig
from ds4.tokenizer import Tokenizer

TOK = Tokenizer.for_model()


def block(*params: str) -> str:
    """An answer holding one call of `f` with the given parameter tags."""
    return ("Calling.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n" + "".join(params)
            + "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")


def param(name: str, value: str, flag: str | None) -> str:
    attr = "" if flag is None else f' string="{flag}"'
    return f'<｜DSML｜parameter name="{name}"{attr}>{value}</｜DSML｜parameter>\n'


def strict(text: str) -> object:
    """json.loads as a strict JSON client reads it: NaN and Infinity are errors."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def arguments(text: str) -> tuple[str, str]:
    """(final-parse arguments, streamed arguments) of the one call in `text`, byte by byte."""
    final = parse_output(text, thinking=False, tools_active=True).tool_calls
    parser = OutputParser(thinking=False, tools_active=True)
    events = [e for b in text.encode() for e in parser.feed(bytes([b]))] + parser.finish()
    streamed = "".join(e.text for e in events if isinstance(e, ToolArgsDelta))
    ends = [e.arguments for e in events if isinstance(e, ToolCallEnd)]
    assert len(final) == 1 and ends == [final[0].arguments]
    return final[0].arguments, streamed


@pytest.mark.parametrize("flag", [None, "true"])
def test_a_parameter_without_string_attribute_is_a_string(flag):
    final, streamed = arguments(block(param("n", "5", flag), param("b", "true", flag)))
    assert final == streamed
    assert strict(final) == {"n": "5", "b": "true"}


def test_string_false_values_are_json():
    final, streamed = arguments(block(param("n", "5", "false"), param("o", '{"a": [1]}', "false"),
                                      param("z", "null", "false")))
    assert final == streamed and strict(final) == {"n": 5, "o": {"a": [1]}, "z": None}


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", '{"x": NaN}', "[1, Infinity]"])
def test_a_non_json_number_is_sent_as_its_string(value):
    final, streamed = arguments(block(param("v", value, "false"), param("k", "1", "false")))
    assert final == streamed
    assert strict(final) == {"v": value, "k": 1}


def test_a_non_json_value_is_sent_as_its_string():
    final, streamed = arguments(block(param("v", "not json", "false")))
    assert final == streamed and strict(final) == {"v": "not json"}


def test_a_finished_job_hands_the_client_strict_json_arguments():
    text = block(param("city", "Paris", None), param("x", "NaN", "false"))
    prompt = TOK.encode("<｜User｜>Weather?<｜Assistant｜></think>")
    sched = Scheduler(ScriptedEngine([TOK.encode(text) + TOK.encode("never")]),
                      SchedulerConfig(ctx_size=4096, decode_tokens=4))
    rec = Recorder()
    sched.submit(JobRequest(prompt_tokens=prompt, max_tokens=200, tools_active=True), rec)
    while sched.run_turn():
        pass
    end = rec.finished()
    assert end.finish_reason == "tool_calls"
    assert [strict(c.arguments) for c in end.output.tool_calls] == [{"city": "Paris", "x": "NaN"}]


def test_a_lone_surrogate_in_the_text_is_kept_and_hashed_not_raised():
    # decoded trace text can hold one (JSON "\ud800"); call ids hash the text before the call
    text = "Broken \ud800 char." + block(param("s", "x\udfffy", None))
    final = parse_output(text, thinking=False, tools_active=True)
    parser = OutputParser(thinking=False, tools_active=True)
    parser.feed(text)
    parser.finish()
    assert final.content == "Broken \ud800 char.Calling."
    assert json.loads(final.tool_calls[0].arguments) == {"s": "x\udfffy"}
    assert parser.result() == final
    other = parse_output(text.replace("\ud800", "\ud801"), thinking=False, tools_active=True)
    assert other.tool_calls[0].id != final.tool_calls[0].id


def test_text_before_a_block_keeps_its_last_characters():
    # only the blank line before the block is syntax; "X" is no whitespace
    text = "Use X" + block(param("k", "X", None))[len("Calling."):]
    final = parse_output(text, thinking=False, tools_active=True)
    assert final.content == "Use X" and strict(final.tool_calls[0].arguments) == {"k": "X"}
    assert arguments(text)[1] == final.tool_calls[0].arguments


def test_a_block_at_the_very_start_wins_over_other_spellings_later_in_it():
    # the canonical block opens at offset 0; a plain "<tool_calls>" inside a value is data
    text = block(param("v", "a <tool_calls> b", None))[len("Calling.\n\n"):]
    final = parse_output(text, thinking=False, tools_active=True)
    assert final.content == ""
    assert [strict(c.arguments) for c in final.tool_calls] == [{"v": "a <tool_calls> b"}]
    assert arguments(text)[0] == final.tool_calls[0].arguments
