"""Reading a request body and its shared fields as a client meets them: the body limit and
JSON checks over a real ASGI request, the exact 400 messages of wrongly typed fields, and the
stream flags. (test_server_requests.py covers thinking controls and sampling values.)"""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from ds4.server import request_fields as rf
from ds4.server.errors import ApiError

LIMIT = 64


async def echo(request: Request) -> JSONResponse:
    """What read_json gives, or the refusal it raises."""
    try:
        body, text = await rf.read_json(request, LIMIT)
    except ApiError as err:
        return JSONResponse({"status": err.status, "message": err.message}, status_code=299)
    return JSONResponse({"body": body, "text": text})


@pytest.fixture(scope="module")
def client():
    return TestClient(Starlette(routes=[Route("/", echo, methods=["POST"])]))


def test_a_json_object_comes_back_with_its_text(client):
    raw = '{"a": [1, "é"], "b": null}'
    assert client.post("/", content=raw.encode()).json() == {"body": {"a": [1, "é"], "b": None},
                                                             "text": raw}


@pytest.mark.parametrize("raw, status, message", [
    (b"x" * (LIMIT + 1), 413, f"request body is larger than {LIMIT} bytes"),
    (b"\xff\xfe{}", 400, "invalid JSON request"),
    (b"[1, 2]", 400, "invalid JSON request"),
    (b'{"a": NaN}', 400, "invalid JSON request"),
    (b"{", 400, "invalid JSON request"),
])
def test_bodies_that_are_refused(client, raw, status, message):
    assert client.post("/", content=raw).json() == {"status": status, "message": message}


def test_a_body_past_the_limit_is_refused_without_a_length_header(client):
    def chunks():
        yield b'{"a": "'
        yield b"x" * LIMIT
        yield b'"}'

    assert client.post("/", content=chunks()).json() == {
        "status": 413, "message": f"request body is larger than {LIMIT} bytes"}


def test_a_body_of_exactly_the_limit_is_read(client):
    raw = '{"a": "' + "x" * (LIMIT - 9) + '"}'
    assert len(raw) == LIMIT
    assert client.post("/", content=raw.encode()).json()["text"] == raw  # a length header
    assert client.post("/", content=iter([raw[:10].encode(), raw[10:].encode()])).json() == {
        "body": {"a": "x" * (LIMIT - 9)}, "text": raw}  # chunked: counted as it arrives


@pytest.mark.parametrize("body, place, char", [
    ({"messages": [{"content": "a\ud800"}]}, "'messages[0].content'", "d800"),
    ({"tools": {"\udc00x": 1}}, "'tools.\\udc00x (key)'", "dc00"),  # the key, escaped
    ({"": "\udbff"}, "a string of the request", "dbff"),  # no name to give
])
def test_a_lone_surrogate_error_says_where_it_sits(body, place, char):
    with pytest.raises(ApiError) as err:
        rf.refuse_lone_surrogates(body)
    assert err.value.message == (f"invalid JSON request: {place} holds a lone surrogate escape "
                                 f"\\u{char}; strings must be valid Unicode")


@pytest.mark.parametrize("read, body, message", [
    (lambda b: rf.stop_sequences(b), {"stop": 5}, "'stop' must be string or array"),
    (lambda b: rf.stop_sequences(b), {"stop": ["a", 1]}, "'stop' must hold strings"),
    (lambda b: rf.stream_flags(b), {"stream": "yes"}, "'stream' must be boolean"),
    (lambda b: rf.stream_flags(b), {"stream_options": []}, "'stream_options' must be object"),
    (lambda b: rf.sampling(b, "none"), {"top_p": "1"}, "'top_p' must be number"),
    (lambda b: rf.sampling(b, "none"), {"seed": 1.5}, "'seed' must be integer"),
    (lambda b: rf.max_tokens(b, ("max_tokens",), 9), {"max_tokens": 2.0},
     "'max_tokens' must be integer"),
])
def test_wrong_types_get_their_exact_message(read, body, message):
    with pytest.raises(ApiError) as err:
        read(body)
    assert err.value.message == "invalid JSON request: " + message


@pytest.mark.parametrize("body, flags", [
    ({}, (False, False)),
    ({"stream": True}, (True, False)),
    ({"stream": True, "stream_options": {"include_usage": True}}, (True, True)),
    ({"stream": False, "stream_options": {"include_usage": False}}, (False, False)),
    ({"stream": None, "stream_options": None}, (False, False)),
])
def test_stream_flags(body, flags):
    assert rf.stream_flags(body) == flags


def test_max_tokens_takes_the_first_field_present():
    names = ("max_completion_tokens", "max_tokens")
    assert rf.max_tokens({"max_tokens": 7, "max_completion_tokens": 3}, names, 9) == 3
    assert rf.max_tokens({"max_tokens": 7, "max_completion_tokens": None}, names, 9) == 7
    assert rf.max_tokens({"max_tokens": -4}, names, 9) == 0
    assert rf.max_tokens({}, names, 9) == 9


@pytest.mark.parametrize("effort, mode", [
    ("max", "max"), ("xhigh", "high"), ("high", "high"), ("medium", "high"), ("low", "high"),
    ("minimal", "high"), ("none", "none"),
])
def test_every_reasoning_effort_word(effort, mode):
    for body in ({"reasoning_effort": effort}, {"reasoning": {"effort": effort}},
                 {"output_config": {"effort": effort}}):
        assert rf.thinking_mode(body, "none", 393216) == mode


def test_protocols_without_min_p_get_the_default():
    # Anthropic and Responses carry no min_p: a field in the body is ignored, 0.05 applies
    got = rf.sampling({"min_p": 0.5, "top_k": 9, "seed": 4}, "none", with_min_p=False,
                      with_top_k=False, with_seed=False)
    assert (got.min_p, got.top_k, got.seed) == (0.05, 0, None)
    assert rf.sampling({"min_p": 0.5}, "none").min_p == 0.5


def test_an_unknown_model_is_a_404_naming_the_field_and_the_models():
    with pytest.raises(ApiError) as err:
        rf.resolve_model({"model": "gpt-4o"})
    assert (err.value.status, err.value.param, err.value.code) == (404, "model", "model_not_found")
    assert err.value.message == ("The model 'gpt-4o' does not exist; this server serves "
                                 "deepseek-v4-flash, deepseek-chat, deepseek-reasoner")


@pytest.mark.parametrize("top_p, kept", [(0, 1.0), (-0.5, 1.0), (1.5, 1.0), (1, 1.0),
                                         (0.25, 0.25)])
def test_top_p_outside_zero_to_one_is_read_as_one(top_p, kept):
    # what the sampler applies and what a trace records of the request
    assert rf.sampling({"top_p": top_p}, "none").top_p == kept
