"""Request fields, thinking controls, error shapes and flags of the server (no model)."""

from __future__ import annotations

import pytest

from ds4.cli.server import config_from
from ds4.jobs.events import SamplingOptions
from ds4.server import request_fields as rf
from ds4.server.errors import ANTHROPIC, OPENAI, ApiError, error_body

CTX = 4096


@pytest.mark.parametrize("body, alias, mode", [
    ({}, None, "high"),
    ({}, "none", "none"),                                   # deepseek-chat
    ({"thinking": True}, "none", "high"),                   # explicit control beats the alias
    ({"thinking": {"type": "disabled"}}, None, "none"),
    ({"thinking": {"type": "enabled", "budget_tokens": 9}}, "none", "high"),
    ({"think": False}, None, "none"),
    ({"reasoning_effort": "none"}, None, "none"),
    ({"reasoning_effort": "low"}, "none", "high"),
    ({"reasoning_effort": "max"}, None, "high"),            # Think Max needs ctx >= 393216
    ({"output_config": {"effort": "medium"}}, "none", "high"),
    ({"reasoning": {"effort": "none"}}, None, "none"),
    ({"reasoning": {"effort": None, "summary": "auto"}}, "none", "none"),
])
def test_thinking_mode(body, alias, mode):
    assert rf.thinking_mode(body, alias, CTX) == mode


def test_think_max_kept_with_a_long_context():
    assert rf.thinking_mode({"reasoning_effort": "max"}, None, 393216) == "max"


def test_thinking_overrides_client_sampling():
    body = {"temperature": 0.0, "top_p": 0.5, "top_k": 3, "seed": 7}
    assert rf.sampling(body, "high") == SamplingOptions(1.0, 0, 1.0, 0.05, 7)
    assert rf.sampling(body, "none") == SamplingOptions(0.0, 3, 0.5, 0.05, 7)


def test_sampling_defaults_and_clamps():
    assert rf.sampling({}, "none") == SamplingOptions(1.0, 0, 1.0, 0.05, None)
    got = rf.sampling({"top_p": 1.5, "min_p": -1, "top_k": 5000, "seed": 0}, "none")
    assert (got.top_p, got.min_p, got.top_k, got.seed) == (1.0, 0.0, 1024, None)


def test_out_of_range_knobs_are_clamped_not_a_sampler_crash():
    # min_p above 1 would filter out every token; a seed is a 64-bit word as in ds4 (C cast)
    got = rf.sampling({"min_p": 2.5, "seed": -1}, "none")
    assert (got.min_p, got.seed) == (1.0, 2**64 - 1)
    assert rf.sampling({"seed": 2**64 + 5}, "none").seed == 5


def test_json_without_nan_or_infinity():
    with pytest.raises(ApiError) as err:
        rf.parse_json('{"temperature": NaN}')
    assert err.value.status == 400 and err.value.message == "invalid JSON request"
    assert rf.parse_json('{"temperature": 1e5}') == {"temperature": 1e5}


@pytest.mark.parametrize("read, body, name", [
    (lambda b: rf.sampling(b, "none"), {"temperature": "hot"}, "temperature"),
    (lambda b: rf.sampling(b, "none"), {"temperature": True}, "temperature"),
    (lambda b: rf.sampling(b, "none"), {"top_k": 1.5}, "top_k"),
    (lambda b: rf.sampling(b, "none"), {"seed": "1"}, "seed"),
    (lambda b: rf.sampling(b, "high"), {"top_p": "x"}, "top_p"),  # checked even when thinking
    (lambda b: rf.thinking_mode(b, None, CTX), {"reasoning_effort": "extreme"},
     "reasoning_effort"),
    (lambda b: rf.thinking_mode(b, None, CTX), {"thinking": "yes"}, "thinking"),
    (rf.stop_sequences, {"stop": [1, 2]}, "stop"),
])
def test_wrong_types_are_400(read, body, name):
    with pytest.raises(ApiError) as err:
        read(body)
    assert (err.value.status, err.value.param) == (400, name)
    assert err.value.message.startswith("invalid JSON request: ")


def test_models_and_aliases():
    assert rf.resolve_model({}) == ("deepseek-v4-flash", None)
    assert rf.resolve_model({"model": "deepseek-reasoner"}) == ("deepseek-reasoner", "high")
    with pytest.raises(ApiError) as err:
        rf.resolve_model({"model": "gpt-4o"})
    assert err.value.status == 404 and err.value.code == "model_not_found"


def test_stop_and_max_tokens():
    assert rf.stop_sequences({"stop": "END"}) == ["END"]
    assert rf.stop_sequences({"stop_sequences": ["a", ""]}, "stop_sequences") == ["a"]
    assert rf.max_tokens({"max_completion_tokens": 5, "max_tokens": 9},
                         ("max_completion_tokens", "max_tokens"), 100) == 5
    assert rf.max_tokens({"max_tokens": -3}, ("max_tokens",), 100) == 0
    assert rf.max_tokens({}, ("max_tokens",), 100) == 100


def test_error_bodies_per_protocol():
    err = ApiError(400, "Prompt has 9 tokens", param="messages", code="context_length_exceeded",
                   extra={"n_prompt_tokens": 9, "n_ctx": 8})
    assert error_body(err, OPENAI) == {"error": {
        "message": "Prompt has 9 tokens", "type": "invalid_request_error", "param": "messages",
        "code": "context_length_exceeded", "n_prompt_tokens": 9, "n_ctx": 8}}
    assert error_body(err, ANTHROPIC) == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "prompt is too long: 9 tokens > 8 maximum (Prompt has 9 tokens)",
        "n_prompt_tokens": 9, "n_ctx": 8}}
    plain = ApiError(400, "missing messages")  # other errors keep ds4's words
    assert error_body(plain, ANTHROPIC)["error"]["message"] == "missing messages"
    assert error_body(ApiError(401, "no"), ANTHROPIC)["error"]["type"] == "authentication_error"
    assert error_body(ApiError(503, "x"), OPENAI)["error"]["type"] == "server_error"


def test_flags():
    cfg = config_from(["--parallel", "3", "--ctx", "1024", "--cors", "--api-key", "k"])
    assert (cfg.parallel, cfg.ctx, cfg.cors, cfg.api_key, cfg.host) == (3, 1024, True, "k",
                                                                         "127.0.0.1")


@pytest.mark.parametrize("argv", [["--parallel", "2", "--ssd-streaming"], ["--port", "65536"],
                                  ["--backend", "cupy", "--ssd-streaming"],
                                  ["--ctx", "x"], ["--kv-disk-space-mb", "0"]])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        config_from(argv)
    assert exit_.value.code == 2
    if "--ssd-streaming" in argv:
        assert "--ssd-streaming" in capsys.readouterr().err
