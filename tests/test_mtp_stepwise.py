"""Verification where the model decodes through the kernel decoder (the GPU's path), run on
CPU through the decoder's NumPy twins: a verify is one decode-graph pass whose rows are plain
decoding steps, so speculation gives plain greedy decoding's tokens and state bitwise, forced
drafts are all kept, and rejected drafts and a stop inside the verified tokens
(keep_speculated) roll back exactly, wherever the windows close."""

from __future__ import annotations

import numpy as np
import pytest
from test_gpu_decode_twins import row_twins, twins  # noqa: F401 (fixtures)
from test_mtp import PROMPTS, assert_same_state, main_state, plain_session, speculated

from ds4.engine import Engine, default_model_dir
from ds4.jobs.speculative import DraftOracle
from ds4.model import gpu_decode
from ds4.model.graph_decode import GraphDecode


@pytest.fixture
def engine(row_twins):  # noqa: F811 (the fixture above)
    e = Engine.open(default_model_dir(), backend="numpy", mtp=True)
    e.model.kernel_decoder = GraphDecode(e.model)  # one-token steps through the twin decoder
    return e


@pytest.mark.parametrize("draft", [1, 3, 5])  # 5: graph steps, past the one-pass limit
def test_speculation_equals_plain_decoding_bitwise(engine, draft):
    ids = engine.tokenizer.encode(PROMPTS[0])
    want, ref = plain_session(engine, ids, 10)
    got, spec, s = speculated(engine, ids, 10, draft)
    assert got == want and spec.stats.drafted > 0
    assert_same_state(main_state(s), main_state(ref))


def test_forced_drafts_are_all_kept_in_one_round_each(engine):
    ids = engine.tokenizer.encode(PROMPTS[1])
    want, ref = plain_session(engine, ids, 9)
    got, spec, s = speculated(engine, ids, 9, 2, DraftOracle([ids + want]))
    assert got == want and spec.stats.acceptance_rate == 1.0
    assert spec.stats.tokens_per_round == pytest.approx(3.0)
    assert_same_state(main_state(s), main_state(ref))


@pytest.mark.parametrize("count", [4, 6])  # one graph pass; graph steps (past the CSA ratio)
def test_a_stop_inside_the_verified_tokens_rolls_back_to_plain_decoding(engine, count):
    ids = engine.tokenizer.encode(PROMPTS[2])
    want, _ = plain_session(engine, ids, count)
    s = engine.new_session(512)
    s.sync(ids)
    first = int(np.argmax(s.logits))
    assert s.verify(first, want[1:count]) == want[:count]  # the greedy continuation: all kept
    s.keep_speculated(2)
    _, ref = plain_session(engine, ids, 2)
    assert_same_state(main_state(s), main_state(ref))
    assert s.mtp_state.hidden_at == len(s.tokens)  # the next draft starts from here


@pytest.mark.parametrize("count", [2, 3, 4])
def test_a_verify_is_one_serial_pass_of_the_decode_graph(engine, monkeypatch, count):
    ids = engine.tokenizer.encode(PROMPTS[0])
    want, _ = plain_session(engine, ids, 4)
    s = engine.new_session(512)
    s.sync(ids)
    runs = []
    real = gpu_decode.KernelDecoder.run
    monkeypatch.setattr(gpu_decode.KernelDecoder, "run",
                        lambda self, B, serial=False: runs.append((B, serial)) or
                        real(self, B, serial))
    assert s.verify(want[0], want[1:count]) == want[:count]
    # one pass of the smallest graph that holds them, the state kernels member after member
    assert runs == [(2 if count == 2 else 4, True)]


@pytest.mark.parametrize("offset", range(4))
@pytest.mark.parametrize("wrong", range(3))
def test_rejected_drafts_leave_the_state_of_plain_decoding(engine, offset, wrong):
    """Drafts wrong from the `wrong`-th on, at every phase of the CSA's 4-token windows (a
    rejected token closes one in some of these): the session equals one that decoded only
    the accepted tokens. The prompt is longer than the raw window, so the ring has wrapped:
    each token's ring row is one the tokens before it still attend until they have run."""
    ids = engine.tokenizer.encode(" ".join(PROMPTS) * 3)
    assert len(ids) > engine.config.sliding_window
    want, _ = plain_session(engine, ids, offset + 4)
    s = engine.new_session(512)
    s.sync(ids)
    for token in want[:offset]:
        s.decode(token)
    drafts = list(want[offset + 1:offset + 4])
    drafts[wrong] = (drafts[wrong] + 1) % engine.config.vocab_size
    assert s.verify(want[offset], drafts) == want[offset:offset + 1 + wrong]
    _, ref = plain_session(engine, ids, offset + 1 + wrong)
    assert_same_state(main_state(s), main_state(ref))
    s.decode(want[offset + 1 + wrong])  # and decoding goes on as plain decoding does
    ref.decode(want[offset + 1 + wrong])
    assert_same_state(main_state(s), main_state(ref))


def test_after_a_whole_verify_the_next_draft_starts_from_plain_streams(engine):
    """A verify that keeps every draft hands MTP the final streams of its last token, bitwise
    what plain decoding leaves, so the next draft is plain decoding's next draft."""
    ids = engine.tokenizer.encode(PROMPTS[0])
    want, ref = plain_session(engine, ids, 4)
    s = engine.new_session(512)
    s.sync(ids)
    assert s.verify(want[0], want[1:4]) == want[:4]
    assert s.mtp_state.hidden_at == len(s.tokens) == len(ref.tokens)
    assert np.array_equal(np.asarray(s.mtp_state.hidden), np.asarray(ref.mtp_state.hidden))
    first = int(np.argmax(s.logits))
    assert s.draft(first, 2) == ref.draft(first, 2) != []


@pytest.mark.parametrize("count", [3, 5])  # one graph pass; graph steps
def test_rejected_drafts_give_back_their_mtp_rows(engine, count):
    ids = engine.tokenizer.encode(PROMPTS[0])
    want, _ = plain_session(engine, ids, 2)
    s = engine.new_session(512)
    s.sync(ids)
    assert len(s.draft(want[0], count)) == count
    held = s.mtp_state.positions.copy()
    wrong = [(want[1] + 1) % engine.config.vocab_size] + [5] * (count - 1)
    assert s.verify(want[0], wrong) == want[:1]
    assert s.mtp_state.positions.max() <= len(ids)  # rows of rejected drafts taken back
    assert (s.mtp_state.positions[:len(ids)] == held[:len(ids)]).all()


def test_a_verify_that_fails_mid_pass_leaves_a_whole_session(engine, monkeypatch):
    """A device error inside the pass (after it wrote state) propagates, and the session is
    back at its synced prompt, decoding on as plain decoding does."""
    ids = engine.tokenizer.encode(PROMPTS[1])
    want, _ = plain_session(engine, ids, 3)
    s = engine.new_session(512)
    s.sync(ids)
    real = gpu_decode.KernelDecoder.verify

    def failing(self, state, tokens):
        real(self, state, tokens)
        raise RuntimeError("device lost")
    monkeypatch.setattr(gpu_decode.KernelDecoder, "verify", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        s.verify(want[0], want[1:3])
    monkeypatch.setattr(gpu_decode.KernelDecoder, "verify", real)
    assert s.tokens == ids and s.state.n == len(ids)
    _, ref = plain_session(engine, ids, 0)
    assert_same_state(main_state(s), main_state(ref))
