"""The latency figures follow vLLM's definitions: TTFT to the first token, ITL pooled over
requests, TPOT = (latency - TTFT) / (tokens - 1), and throughput over the whole run."""

from __future__ import annotations

import pytest

from ds4.jobs.latency import JobTiming, summary


def test_ttft_itl_tpot_and_throughput():
    a = JobTiming(0.0, [0.5, 0.6, 0.8], ended=1.0)  # TTFT 0.5, TPOT (1.0-0.5)/2
    b = JobTiming(1.0, [1.2, 1.3], ended=1.3)  # TTFT 0.2, TPOT 0.1
    assert (a.ttft, a.tpot, a.latency) == pytest.approx((0.5, 0.25, 1.0))
    assert a.itl == pytest.approx([0.1, 0.2])
    s = summary([a, b])
    assert s["ttft_s"]["mean"] == pytest.approx(0.35)
    assert s["itl_s"]["mean"] == pytest.approx((0.1 + 0.2 + 0.1) / 3)  # pooled gaps
    assert s["tpot_s"]["p50"] == pytest.approx(0.175)
    assert s["duration_s"] == pytest.approx(1.3)
    assert s["request_throughput"] == pytest.approx(2 / 1.3)
    assert s["token_throughput"] == pytest.approx(5 / 1.3)


def test_a_one_token_reply_has_no_tpot_and_counted_tokens_have_no_ttft():
    assert JobTiming(0.0, [0.4], ended=0.5).tpot is None
    http = JobTiming(0.0, ended=2.0, counted=8)
    assert (http.ttft, http.tpot, http.latency, http.tokens) == (None, None, 2.0, 8)
    assert summary([http])["ttft_s"] is None
