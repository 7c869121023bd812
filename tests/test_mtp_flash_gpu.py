"""MTP at V4-Flash dimensions (4 layers, dummy weights; GPU only). The bench at full size saw
forced drafts rejected while the tiny model keeps them (2026-12-01, before verification moved
to graph steps): these pin where the two paths may part: a draft must not move the main
session's state, and after drafts a chunk pass must agree with the decode graph. A verify is
one decode-graph pass (KernelDecoder.verify): its rows must be plain decoding steps bitwise,
and rejected drafts must leave plain decoding's state (the prompt outlasts the raw window)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from ds4.backend import cuda_available
from ds4.engine import Engine
from ds4.jobs.speculative import DraftOracle, SpeculationConfig, Speculator

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture(scope="module")
def engine():
    sys.path.insert(0, str(TOOLS))
    from bench_batch import first_layers

    return Engine.open(first_layers("deepseek-v4-flash", 4), backend="cupy",
                       load_format="dummy", mtp=True, prefill_chunk=2048)


def prompt() -> list[int]:
    return np.random.default_rng(0).integers(1000, 100000, 256).tolist()


def plain(engine, n: int) -> tuple[list[int], list]:
    s = engine.new_session(1024)
    s.sync(prompt())
    out, logits = [], []
    for _ in range(n):
        out.append(int(np.argmax(s.logits)))
        s.decode(out[-1])
        logits.append(np.array(s.logits))
    return out, logits


def test_a_draft_leaves_the_main_state_alone(engine):
    s = engine.new_session(1024)
    s.sync(prompt())
    before = s.state.export(engine.backend.to_numpy)
    assert len(s.draft(int(np.argmax(s.logits)), 2, 0.0)) == 2
    after = s.state.export(engine.backend.to_numpy)
    assert [k for k in before if not np.array_equal(before[k], after[k])] == []


def test_forced_drafts_are_kept_and_give_plain_tokens(engine):
    want, _ = plain(engine, 8)
    s = engine.new_session(1024)
    s.sync(prompt())
    spec = Speculator(SpeculationConfig(2, 0.0), oracle=DraftOracle([prompt() + want]))
    got: list[int] = []
    while len(got) < 8:
        got += spec.round(s, int(np.argmax(s.logits)), 8 - len(got))
    assert got == want and spec.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("chunk", [2, 3, 6])
def test_after_drafts_a_chunk_pass_agrees_with_the_decode_graph(engine, chunk):
    want, logits = plain(engine, chunk)
    s = engine.new_session(1024)
    s.sync(prompt())
    s.draft(int(np.argmax(s.logits)), 2, 0.0)
    rows, _ = s._run_rows(want, every_row=True)
    for got, ref in zip(rows, logits):
        assert int(np.argmax(got)) == int(np.argmax(ref))
        assert np.abs(got - ref).max() <= 1e-2 * np.abs(ref).max()


def plain_state(engine, n: int) -> tuple:
    """(n plain greedy tokens, the state export, logits of the session after them)."""
    want, logits = plain(engine, n)
    s = engine.new_session(1024)
    s.sync(prompt())
    for t in want:
        s.decode(t)
    return want, s.state.export(engine.backend.to_numpy), np.array(s.logits)


def assert_state(got: dict, want: dict) -> None:
    assert [k for k in want if not np.array_equal(got[k], want[k])] == []


@pytest.mark.parametrize("count", [2, 3, 4])
def test_a_verify_pass_is_plain_decoding_bitwise(engine, count):
    want, logits = plain(engine, count + 1)
    s = engine.new_session(1024)
    s.sync(prompt())
    assert s.verify(want[0], want[1:count]) == want[:count]
    assert np.array_equal(np.array(s.logits), logits[count - 1])
    assert_state(s.state.export(engine.backend.to_numpy), plain_state(engine, count)[1])


@pytest.mark.parametrize("wrong", [0, 1, 2])
def test_rejected_drafts_leave_plain_decodings_state(engine, wrong):
    want, _ = plain(engine, 5)
    s = engine.new_session(1024)
    s.sync(prompt())
    drafts = list(want[1:4])
    drafts[wrong] = (drafts[wrong] + 1) % engine.config.vocab_size
    assert s.verify(want[0], drafts) == want[:1 + wrong]
    _, state, logits = plain_state(engine, 1 + wrong)
    assert_state(s.state.export(engine.backend.to_numpy), state)
    assert np.array_equal(np.array(s.logits), logits)
