"""Per-token decode logic on exact token scripts: tool calls, stop strings, forced text, redecode.

A random tiny model never writes DSML, so these run on ScriptedEngine (tests/ only), whose
sessions make the greedy choice follow a script; the real parser and tokenizer do the rest.
"""

from __future__ import annotations

from test_jobs_support import Recorder, ScriptedEngine

from ds4.chat.events import TextDelta, ToolArgsDelta, ToolCallStart
from ds4.jobs.events import Failed, JobRequest, SamplingOptions
from ds4.jobs.scheduler import Scheduler, SchedulerConfig
from ds4.jobs.stop import StopText
from ds4.tokenizer import Tokenizer

TOK = Tokenizer.for_model()
EOS = 1
OPEN = "\n\n<｜DSML｜tool_calls>\n"
INVOKE = '<｜DSML｜invoke name="get_weather">\n'
CALL = (OPEN + INVOKE
        + '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        + '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
        + "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
BROKEN = OPEN + INVOKE + "<｜DSML｜bogus>oops"
PROMPT = TOK.encode("<｜User｜>Weather in Paris for 2 days?<｜Assistant｜></think>")


def run(scripts, **kw):
    """One job on a one-slot scheduler whose session follows `scripts`."""
    sched = Scheduler(ScriptedEngine(scripts), SchedulerConfig(ctx_size=4096, decode_tokens=4))
    rec = Recorder()
    req = JobRequest(prompt_tokens=PROMPT, sampling=SamplingOptions(temperature=0.7, seed=5),
                     max_tokens=kw.pop("max_tokens", 200), **kw)
    job = sched.submit(req, rec)
    while sched.run_turn():
        pass
    return sched, job, rec


def streamed_text(rec) -> str:
    return "".join(ev.text for te in rec.token_events() for ev in te.events
                   if isinstance(ev, TextDelta))


def test_a_closed_tool_call_ends_the_turn_and_binds_its_id_to_the_slot():
    script = TOK.encode("Checking." + CALL) + TOK.encode("never sampled")
    sched, _, rec = run([script], tools_active=True)
    end = rec.finished()
    assert end.finish_reason == "tool_calls"
    call = end.output.tool_calls[0]
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris", "days": 2}')
    assert end.output.content == "Checking."
    assert sched.engine.sessions[0].decoded == TOK.encode("Checking." + CALL)  # stopped there
    assert [e.id for te in rec.token_events() for e in te.events
            if isinstance(e, ToolCallStart)] == [call.id]
    assert sched.live_call_ids() == {call.id}
    assert end.usage.completion_tokens == len(TOK.encode("Checking." + CALL))


def test_eos_is_never_fed_to_the_session():
    script = TOK.encode("Short answer.") + [EOS]
    sched, _, rec = run([script])
    end = rec.finished()
    assert (end.finish_reason, end.text, end.output.content) == ("stop", "Short answer.",
                                                                  "Short answer.")
    assert sched.engine.sessions[0].decoded == TOK.encode("Short answer.")
    assert streamed_text(rec) == "Short answer."


def test_stop_string_cuts_the_answer_and_is_never_streamed():
    script = TOK.encode("Hello world. STOP here and more text") + [EOS]
    sched, _, rec = run([script], stop=["STOP", "never"])
    end = rec.finished()
    assert end.finish_reason == "stop"
    assert end.output.content == "Hello world. " and end.text == "Hello world. "
    assert streamed_text(rec) == "Hello world. "
    assert "here" not in TOK.decode(sched.engine.sessions[0].decoded)  # stopped at the match


def test_text_is_cut_at_the_first_match_even_when_the_last_token_repeats_it():
    # "\n\n" is one token: the stop "\n" ends the answer at its first newline, and the raw
    # text (a completions body, a trace) must end there too, like the stream
    script = TOK.encode("Line one\n\nmore") + [EOS]
    _, _, rec = run([script], stop=["\n"])
    end = rec.finished()
    assert (end.finish_reason, end.text, end.output.content) == ("stop", "Line one", "Line one")
    assert streamed_text(rec) == "Line one"


def test_a_stop_string_in_the_reasoning_does_not_cut_the_text():
    script = TOK.encode("Done thinking.</think>Answer. Done more") + [EOS]
    _, _, rec = run([script], stop=["Done"], thinking=True)
    end = rec.finished()
    assert end.text == "Done thinking.</think>Answer. " and end.output.content == "Answer. "


def test_stop_filter_holds_back_partial_matches():
    stop = StopText(["END!"])
    out = stop.filter([TextDelta("abc EN")]) + stop.filter([TextDelta("Dx")])
    assert "".join(e.text for e in out) == "abc ENDx" and stop.hit is None
    out = stop.filter([TextDelta(" E")]) + stop.filter([TextDelta("ND!tail")])
    assert "".join(e.text for e in out) == " " and stop.hit == "END!"
    assert stop.emitted == "abc ENDx "


def test_forced_text_is_inserted_as_if_sampled():
    forced = TOK.encode(OPEN + INVOKE)
    script = TOK.encode("xx") * len(forced) + TOK.encode(CALL)[len(forced):]
    sched, _, rec = run([script], tools_active=True, forced_text=OPEN + INVOKE)
    end = rec.finished()
    assert end.finish_reason == "tool_calls"
    assert end.output.tool_calls[0].name == "get_weather"
    assert sched.engine.sessions[0].decoded[: len(forced)] == forced


def test_malformed_block_is_redecoded_from_the_last_valid_offset():
    bad = TOK.encode("Checking." + BROKEN)
    good = TOK.encode("Checking." + CALL)
    sched, job, rec = run([bad, good], tools_active=True)
    end = rec.finished()
    assert job.redecodes == 1
    assert end.finish_reason == "tool_calls"
    assert end.output.tool_calls[0].arguments == '{"city": "Paris", "days": 2}'
    assert sched.engine.sessions[0].tokens == PROMPT + good
    starts = [e for te in rec.token_events() for e in te.events if isinstance(e, ToolCallStart)]
    assert [s.id for s in starts] == [end.output.tool_calls[0].id]  # announced once
    streamed_args = "".join(e.text for te in rec.token_events() for e in te.events
                            if isinstance(e, ToolArgsDelta))
    assert streamed_args == end.output.tool_calls[0].arguments  # the stream agrees


def test_recovery_gives_up_after_two_redecodes():
    bad = TOK.encode("Checking." + BROKEN) + [EOS]
    _, job, rec = run([bad, bad, bad], tools_active=True)
    end = rec.finished()
    assert job.redecodes == 2
    assert end.finish_reason == "stop" and not end.output.tool_calls
    assert end.output.malformed and end.output.content == end.text  # all of it, as text


def test_a_block_recovery_cannot_repair_becomes_the_answer_text():
    # a complete call, then a broken one: no call survives, the text after the reasoning is
    # the content, the reasoning keeps its field (a stream already sent it as reasoning)
    first = CALL.removesuffix("</｜DSML｜tool_calls>")
    bad = TOK.encode("Hmm.</think>Checking." + first + INVOKE + "<｜DSML｜bogus>oops") + [EOS]
    _, job, rec = run([bad, bad, bad], tools_active=True, thinking=True)
    end = rec.finished()
    assert job.redecodes == 2 and end.finish_reason == "stop" and not end.output.tool_calls
    assert end.output.reasoning == "Hmm."
    assert end.output.content == end.text.split("</think>", 1)[1]
    assert end.output.content.startswith("Checking." + first + INVOKE + "<｜DSML｜b")  # cut there
    assert any(isinstance(e, ToolCallStart) for te in rec.token_events() for e in te.events)


def test_an_unterminated_block_fails_the_turn():
    cut = TOK.encode("Checking." + OPEN + INVOKE) + [EOS]
    sched, job, rec = run([cut, cut, cut], tools_active=True)
    end = rec.final()
    assert isinstance(end, Failed) and end.message == "unterminated tool call"
    assert job.redecodes == 2
    assert not any(s["busy"] for s in sched.slots_info())


def test_a_stop_string_held_back_by_the_parser_still_stops_at_the_cap():
    # with tools active the parser holds trailing whitespace; the cap flushes it
    script = TOK.encode("Answer: done \n") + TOK.encode("more")
    _, _, rec = run([script], tools_active=True, stop=[" \n"],
                    max_tokens=len(TOK.encode("Answer: done \n")))
    end = rec.finished()
    assert end.finish_reason == "stop"
    assert end.output.content == "Answer: done" and streamed_text(rec) == "Answer: done"
