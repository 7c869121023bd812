"""Whatever parameters a client sends to a generation endpoint, over real HTTP (tiny model,
two slots): an answer below 500, a 4xx in the protocol's own error shape that says what is
wrong, and no slot left busy once the answer is in. The bodies mix every endpoint's knobs
with wrong types, out-of-range numbers, non-finite floats and nested junk (rendering alone:
test_chat_fuzz.py)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server_support import live_server

MSG = [{"role": "user", "content": "hi"}]
BLOCKS = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
ROUTES = {"/v1/chat/completions": {"messages": MSG}, "/v1/completions": {"prompt": "hi"},
          "/v1/responses": {"input": "hi"}, "/v1/messages": {"messages": BLOCKS},
          "/v1/messages/count_tokens": {"messages": BLOCKS}}
KNOBS = ["model", "messages", "prompt", "input", "temperature", "top_p", "top_k", "min_p",
         "stop", "stop_sequences", "stream", "stream_options", "n", "seed", "logprobs",
         "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
         "logit_bias", "tools", "tool_choice", "response_format", "system", "thinking",
         "metadata", "instructions", "reasoning", "reasoning_effort", "parallel_tool_calls",
         "text", "include", "echo", "suffix", "best_of", "chat_template_kwargs", "user"]
LIMITS = ["max_tokens", "max_completion_tokens", "max_output_tokens"]
LEAF = (st.none() | st.booleans() | st.integers(-2, 3) | st.sampled_from([2 ** 63, -(2 ** 63)])
        | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
            ["", "x", "auto", "none", "required", "\u0000", "é", "<｜end▁of▁sentence｜>"]))
JUNK = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(KNOBS + ["type", "name"]), inner,
                                      max_size=2), max_leaves=6)
# token limits stay small or wrong: a valid huge one would only generate to the context
LIMIT = st.none() | st.integers(-3, 4) | st.booleans() | st.floats(-2, 4) | st.text(max_size=2)
BODY = st.tuples(st.sampled_from(sorted(ROUTES)),
                 st.dictionaries(st.sampled_from(KNOBS), JUNK, min_size=1, max_size=4),
                 st.dictionaries(st.sampled_from(LIMITS), LIMIT, max_size=1))


@pytest.fixture(scope="module")
def live():
    with live_server(parallel=2, ctx=1024, tokens=4) as (url, runtime):
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client, runtime


@given(case=BODY)
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
def test_any_knob_gets_an_answer_or_a_4xx_in_the_protocols_shape(live, case):
    client, _ = live
    route, knobs, limits = case
    body = {**ROUTES[route], "max_tokens": 2, **knobs, **limits}
    r = client.post(route, content=json.dumps(body, allow_nan=True),
                    headers={"content-type": "application/json"})
    assert r.status_code < 500, (route, body, r.text)
    if r.status_code >= 400:
        err = r.json()
        if route.startswith("/v1/messages"):
            assert err["type"] == "error" and err["error"]["type"], err
        assert err["error"]["message"].strip(), err
    deadline = time.monotonic() + 10  # its answer is whole: its slot frees within a turn
    while any(s["busy"] for s in client.get("/slots").json()["slots"]):
        assert time.monotonic() < deadline, (route, body, client.get("/slots").text)
        time.sleep(0.01)
