"""Stop strings: the answer ends before the earliest match, whatever the order of the list or
how the text arrives, and text held back as a possible stop string is released when it is not.

The HTTP side (a stop list in two orders on every route that takes one) is in
test_server_knobs.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_jobs_support import Recorder, ScriptedEngine

from ds4.chat.events import TextDelta, ToolCallStart
from ds4.jobs.events import JobRequest, SamplingOptions
from ds4.jobs.scheduler import Scheduler, SchedulerConfig
from ds4.jobs.stop import StopText
from ds4.tokenizer import Tokenizer

TOK = Tokenizer.for_model()
EOS = 1
PROMPT = TOK.encode("<｜User｜>Go on.<｜Assistant｜></think>")


def fed(stop: StopText, pieces: list[str]) -> str:
    """The text a client sees of `pieces` sent through `stop`, the end of the answer included."""
    out = [e for piece in pieces for e in stop.filter([TextDelta(piece)])] + stop.flush()
    assert all(isinstance(e, TextDelta) for e in out)
    return "".join(e.text for e in out)


def cut(text: str, stops: list[str]) -> str:
    """The reference: text before the match that starts first (str.find on the whole text)."""
    starts = [text.find(s) for s in stops if s and s in text]
    return text[: min(starts)] if starts else text


@pytest.mark.parametrize("stops", [["world", "lo"], ["lo", "world"]])
def test_the_earliest_match_wins_whatever_the_order_of_the_list(stops):
    stop = StopText(stops)
    assert fed(stop, ["Hello world, again"]) == "Hel"
    assert stop.hit == "lo"


@pytest.mark.parametrize("stops", [["bcd", "abcde"], ["abcde", "bcd"]])
def test_a_longer_stop_that_began_first_wins_over_one_completed_inside_it(stops):
    # char by char "bcd" completes first, but "abcde" starts earlier: the cut is before "a"
    stop = StopText(stops)
    assert fed(stop, list("xabcdefg")) == "x" and stop.hit == "abcde"
    stop = StopText(stops)  # "abcde" never completes: "bcd" ends the answer after all
    assert fed(stop, list("xabcdq")) == "xa" and stop.hit == "bcd"


def test_held_text_is_released_when_the_answer_ends_without_a_stop_string():
    stop = StopText(["END!"])
    assert stop.filter([TextDelta("so it ENDS at EN")]) == [TextDelta("so it ENDS at ")]
    assert stop.held == "EN"
    assert stop.flush() == [TextDelta("EN")]
    assert (stop.hit, stop.emitted) == (None, "so it ENDS at EN")
    assert stop.flush() == []  # nothing is released twice


def test_held_text_holding_a_complete_stop_string_ends_at_it_when_flushed():
    stop = StopText(["bcd", "abcdef"])
    assert fed(stop, ["x", "abcd"]) == "xa" and stop.hit == "bcd"


def test_the_longest_possible_stop_prefix_is_held_and_no_more():
    stop = StopText(["abc", "cab"])
    assert stop.filter([TextDelta("xxcab")]) == [TextDelta("xx")] and stop.hit == "cab"
    stop = StopText(["abcd", "cd"])
    assert stop.filter([TextDelta("ab")]) == []  # all held: no empty delta reaches a client
    assert stop.filter([TextDelta("")]) == [] and stop.held == "ab"
    assert stop.filter([TextDelta("x")]) == [TextDelta("abx")]
    assert stop.filter([TextDelta("zabc")]) == [TextDelta("z")]  # "abc" may become "abcd"
    assert stop.filter([TextDelta("x")]) == [TextDelta("abcx")]
    assert stop.filter([TextDelta("zc")]) == [TextDelta("z")] and stop.held == "c"


def test_a_stop_string_that_repeats_its_first_letter_is_held_whole_across_pieces():
    # "xaa" ends with both "aa" and "a", prefixes of "aab": the longer one must be held, or the
    # "b" that follows completes the stop string with nobody looking
    stop = StopText(["aab"])
    assert stop.filter([TextDelta("xaa")]) == [TextDelta("x")] and stop.held == "aa"
    assert stop.filter([TextDelta("b and on")]) == [] and stop.hit == "aab"
    assert fed(StopText(["abab"]), ["zzab", "a", "b!"]) == "zz"


def test_a_non_text_event_releases_held_text_before_it():
    stop = StopText(["END!"])
    start = ToolCallStart(index=0, id="call_1", name="f")
    assert stop.filter([TextDelta("ab EN"), start]) == [TextDelta("ab "), TextDelta("EN"), start]


def test_nothing_passes_after_the_stop_string():
    stop = StopText(["!"])
    start = ToolCallStart(index=0, id="call_1", name="f")
    assert stop.filter([TextDelta("hi! there"), start, TextDelta("more")]) == [TextDelta("hi")]
    assert stop.filter([TextDelta("again")]) == [] and stop.flush() == []


def test_without_stop_strings_text_passes_at_once():
    stop = StopText(["", ""])
    assert stop.filter([TextDelta("a")]) == [TextDelta("a")] and stop.held == ""


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc ", max_size=24),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(min_value=0, max_value=24), max_size=6))
def test_any_split_of_the_text_gives_the_cut_of_the_whole_text(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    stop = StopText(stops)
    assert fed(stop, pieces) == cut(text, stops)
    assert (stop.hit is None) == (cut(text, stops) == text)
    if stop.hit is not None:
        assert text.find(stop.hit) == len(cut(text, stops))


def run(script: list[int], stop: list[str], max_tokens: int = 200):
    """One job on a scripted one-slot scheduler; returns its Recorder."""
    sched = Scheduler(ScriptedEngine([script]), SchedulerConfig(ctx_size=4096, decode_tokens=4))
    rec = Recorder()
    req = JobRequest(prompt_tokens=PROMPT, sampling=SamplingOptions(temperature=0.7, seed=5),
                     max_tokens=max_tokens, stop=stop)
    sched.submit(req, rec)
    while sched.run_turn():
        pass
    return rec


def streamed(rec: Recorder) -> str:
    return "".join(e.text for te in rec.token_events() for e in te.events
                   if isinstance(e, TextDelta))


def test_a_stream_whose_tail_looks_like_a_stop_string_gets_all_of_it_at_eos():
    rec = run(TOK.encode("It ends with EN") + [EOS], stop=["END!"])
    end = rec.finished()
    assert (end.finish_reason, end.output.content, end.text) == ("stop", "It ends with EN",
                                                                 "It ends with EN")
    assert streamed(rec) == "It ends with EN"


def test_a_stream_whose_tail_looks_like_a_stop_string_gets_all_of_it_at_the_cap():
    script = TOK.encode("It ends with EN")
    rec = run(script + TOK.encode("D! never"), stop=["END!"], max_tokens=len(script))
    end = rec.finished()
    assert (end.finish_reason, end.output.content) == ("length", "It ends with EN")
    assert streamed(rec) == "It ends with EN"


@pytest.mark.parametrize("stops", [["brown", "quick"], ["quick", "brown"]])
def test_a_job_stops_at_the_earliest_match_in_either_order(stops):
    rec = run(TOK.encode("The quick brown fox") + [EOS], stop=stops)
    end = rec.finished()
    assert (end.finish_reason, end.output.content, end.text) == ("stop", "The ", "The ")
    assert streamed(rec) == "The "


def test_a_complete_stop_string_ends_the_answer_at_once_even_if_a_longer_one_may_follow():
    # "ab" and "abc" start at the same place: the cut is the same, so no reason to wait
    stop = StopText(["abc", "ab"])
    assert stop.filter([TextDelta("xab")]) == [TextDelta("x")] and stop.hit == "ab"
