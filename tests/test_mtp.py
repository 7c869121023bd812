"""MTP speculative decoding on the engine: greedy output unchanged, exact rollback, forced
acceptance, snapshots, the MTP block loaded from bf16 and packed checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

from ds4.engine import Engine, default_model_dir
from ds4.jobs.speculative import DraftOracle, SpeculationConfig, SpeculationStats, Speculator
from ds4.model.weights import WeightsError

PROMPTS = ["Tell me a story about a fox.", "2 + 2 =", "Write a haiku about rain, please."]


@pytest.fixture(scope="module")
def engine():
    return Engine.open(default_model_dir(), backend="numpy", prefill_chunk=16, mtp=True)


def prompt(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def plain_greedy(engine, ids: list[int], n: int) -> list[int]:
    """n tokens of plain greedy decoding, one decode per token."""
    return plain_session(engine, ids, n)[0]


def plain_session(engine, ids: list[int], n: int) -> tuple:
    """(n tokens of plain greedy decoding, the session that decoded them)."""
    s = engine.new_session(512)
    s.sync(ids)
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(s.logits)))
        s.decode(out[-1])
    return out, s


def speculated(engine, ids: list[int], n: int, draft: int, oracle=None):
    """(n tokens in draft/verify rounds, the speculator, the session)."""
    s = engine.new_session(512)
    s.sync(ids)
    spec = Speculator(SpeculationConfig(draft), oracle=oracle)
    out: list[int] = []
    while len(out) < n:
        out += spec.round(s, int(np.argmax(s.logits)), n - len(out))
    return out, spec, s


def main_state(session, live_only: bool = False) -> dict:
    """The main model's state arrays, tokens and logits (what a never-drafting session has);
    live_only: pending rows cut to those of the open window (the rest are never read)."""
    arrays = session.state.export(session.engine.backend.to_numpy)
    if live_only:
        for i, layer in enumerate(session.state.layers):
            for cname, comp in layer.compressors().items():
                for part in ("pending_kv", "pending_score"):
                    name = f"{i}.{cname}.{part}"
                    arrays[name] = arrays[name][: session.state.n % comp.ratio]
    return {"arrays": arrays, "tokens": list(session.tokens), "n": session.state.n,
            "logits": np.array(session.logits)}


def assert_same_state(a: dict, b: dict) -> None:
    assert a["tokens"] == b["tokens"] and a["n"] == b["n"]
    assert a["arrays"].keys() == b["arrays"].keys()
    for name in a["arrays"]:
        assert np.array_equal(a["arrays"][name], b["arrays"][name]), name
    assert np.array_equal(a["logits"], b["logits"])


@pytest.mark.parametrize(("text", "draft"), [(PROMPTS[0], 1), (PROMPTS[1], 2), (PROMPTS[2], 3),
                                             (PROMPTS[0], 3)])
def test_speculated_tokens_equal_plain_greedy(engine, text, draft):
    ids = prompt(engine, text)
    out, spec, _ = speculated(engine, ids, 10, draft)
    assert out == plain_greedy(engine, ids, 10)
    assert spec.stats.drafted > 0 and spec.stats.verify_rounds > 0


def test_a_rejected_draft_leaves_the_state_of_a_session_that_never_drafted(engine):
    ids = prompt(engine, PROMPTS[0])
    s, ref = engine.new_session(512), engine.new_session(512)
    s.sync(ids)
    ref.sync(ids)
    first = int(np.argmax(s.logits))
    drafts = s.draft(first, 3)
    assert len(drafts) == 3
    after = int(np.argmax(plain_logits_after(engine, ids, first)))
    wrong = [(after + 1) % engine.config.vocab_size, 5, 6]  # the first draft is surely rejected
    held = s.mtp_state.positions.copy()
    assert s.verify(first, wrong) == [first]
    ref.decode(first)
    assert_same_state(main_state(s), main_state(ref))
    assert s.mtp_state.positions.max() <= len(ids)  # rows of rejected drafts taken back
    assert (s.mtp_state.positions[: len(ids)] == held[: len(ids)]).all()
    assert s.mtp_state.hidden_at == len(s.tokens)


def plain_logits_after(engine, ids: list[int], first: int) -> np.ndarray:
    s = engine.new_session(512)
    s.sync(ids)
    return s.decode(first)


def test_rounds_with_rejections_keep_the_state_of_plain_decoding(engine):
    ids = prompt(engine, PROMPTS[2])
    out, spec, s = speculated(engine, ids, 10, 3)
    assert spec.stats.accepted < spec.stats.drafted  # random weights: drafts were rejected
    ref = engine.new_session(512)
    ref.sync(ids)
    for tok in out:
        ref.decode(tok)
    assert_same_state(main_state(s), main_state(ref))


def test_forced_acceptance_takes_every_draft_and_keeps_greedy_output(engine):
    ids = prompt(engine, PROMPTS[1])
    reference = plain_greedy(engine, ids, 24)
    oracle = DraftOracle([ids + reference])
    out, spec, s = speculated(engine, ids, 24, 3, oracle)
    assert out == reference
    st = spec.stats
    assert st.accepted == st.drafted > 0 and st.acceptance_rate == 1.0
    assert st.tokens_per_round == pytest.approx(4.0)  # 24 tokens = 6 rounds of 1 + 3
    ref = engine.new_session(512)
    ref.sync(ids)
    for tok in out:
        ref.decode(tok)
    a, b = main_state(s, True), main_state(ref, True)  # chunks of 4 vs single steps
    assert a["tokens"] == b["tokens"]
    for name in a["arrays"]:
        np.testing.assert_allclose(a["arrays"][name], b["arrays"][name], rtol=1e-4, atol=1e-4)


def test_keep_speculated_trims_to_the_state_of_fewer_tokens(engine):
    ids = prompt(engine, PROMPTS[0])
    reference = plain_greedy(engine, ids, 4)
    s = engine.new_session(512)
    s.sync(ids)
    s.draft(reference[0], 3)
    assert s.verify(reference[0], reference[1:]) == reference
    for count in (0, 5):
        with pytest.raises(ValueError, match=f"keep {count} of the 4 verified tokens"):
            s.keep_speculated(count)
    s.keep_speculated(4)  # all of them: nothing changes
    assert s.tokens == ids + reference
    s.keep_speculated(2)
    ref = engine.new_session(512)
    ref.sync(ids)
    ref.sync(ids + reference[:2])  # one chunk of two, as the trim replays them
    assert_same_state(main_state(s), main_state(ref))
    with pytest.raises(ValueError, match="follow a verify"):
        s.decode(reference[2])
        s.keep_speculated(1)


def test_keep_speculated_of_one_token_holds_only_the_first(engine):
    ids = prompt(engine, PROMPTS[1])
    reference = plain_greedy(engine, ids, 3)
    s = engine.new_session(512)
    s.sync(ids)
    assert s.verify(reference[0], reference[1:]) == reference
    s.keep_speculated(1)
    ref = engine.new_session(512)
    ref.sync(ids)
    ref.decode(reference[0])
    assert_same_state(main_state(s), main_state(ref))


def test_margin_gates_drafts(engine):
    ids = prompt(engine, PROMPTS[0])
    s = engine.new_session(512)
    s.sync(ids)
    first = int(np.argmax(s.logits))
    assert s.draft(first, 3, margin=1e9) == []
    assert len(s.draft(first, 3, margin=0.0)) == 3


def test_snapshot_holds_the_mtp_window(engine):
    ids = prompt(engine, PROMPTS[0])
    _, _, s = speculated(engine, ids, 6, 2)
    restored = engine.new_session(512).restore(s.snapshot())
    assert (restored.mtp_state.positions == s.mtp_state.positions).all()
    assert np.array_equal(restored.mtp_state.raw, s.mtp_state.raw)
    first = int(np.argmax(s.logits))
    assert restored.draft(first, 2) == s.draft(first, 2)


def test_an_engine_without_mtp_never_drafts():
    e = Engine.open(default_model_dir(), backend="numpy")
    s = e.new_session(64)
    s.sync([1, 2, 3])
    assert e.mtp is None and s.draft(4, 3) == []


def test_packed_mtp_block_matches_its_widened_values(tmp_path, engine):
    from ds4.model.official_format import write_dequantized, write_official

    packed = write_official(default_model_dir(), tmp_path / "packed")
    wide = write_dequantized(packed, tmp_path / "wide")
    drafts = []
    for path in (packed, wide):
        e = Engine.open(path, backend="numpy", mtp=True, quantize=False)
        s = e.new_session(128)
        s.sync(prompt(engine, PROMPTS[0]))
        logits, _ = e.mtp.step(s.mtp_state, s.mtp_state.hidden, 42, len(s.tokens))
        drafts.append(np.array(logits))
    np.testing.assert_allclose(drafts[0], drafts[1], rtol=1e-4, atol=1e-4)


def test_a_checkpoint_without_an_mtp_block_is_refused_with_mtp(tmp_path):
    import json

    from ds4.model.tiny import CONFIG, tiny_tensors, write_safetensors

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    tensors = {k: v for k, v in tiny_tensors().items() if not k.startswith("mtp.")}
    write_safetensors(tmp_path / "model.safetensors", tensors)
    Engine.open(tmp_path, backend="numpy")  # fine without --mtp
    with pytest.raises(WeightsError, match="no MTP block"):
        Engine.open(tmp_path, backend="numpy", mtp=True)


@pytest.mark.parametrize("packed", [False, True])
def test_dummy_weights_draw_an_mtp_block(tmp_path, packed):
    from ds4.model.official_format import write_official

    path = write_official(default_model_dir(), tmp_path / "p") if packed else default_model_dir()
    e = Engine.open(path, backend="numpy", load_format="dummy", mtp=True, seed=3)
    assert e.memory_report()["mtp_bytes"] > 0
    ids = list(range(100, 120))
    out, spec, _ = speculated(e, ids, 6, 2)
    assert out == plain_greedy(e, ids, 6) and spec.stats.drafted > 0


def test_the_block_input_and_head_follow_the_formula(engine, monkeypatch):
    """With the decoder layer taken out, logits = head(e_proj(norm(embed)) + h_proj(norm(H)))
    computed here from the checkpoint's own mtp.0.* tensors."""
    from ds4.model.safetensors_file import read_checkpoint

    t = {k: v.widen() for k, v in read_checkpoint(default_model_dir()).items()
         if k.startswith("mtp.0.") or k in ("model.embed_tokens.weight", "lm_head.weight")}
    cfg, eps = engine.config, engine.config.rms_norm_eps

    def norm(x, w):
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w

    H = np.random.default_rng(1).standard_normal((cfg.hc_mult, cfg.hidden_size), np.float32)
    token = 777
    e = norm(t["model.embed_tokens.weight"][token], t["mtp.0.enorm.weight"])
    X = e @ t["mtp.0.e_proj.weight"].T + norm(H, t["mtp.0.hnorm.weight"]) @ t[
        "mtp.0.h_proj.weight"].T
    flat = X.reshape(-1)
    mix = t["mtp.0.hc_head_fn"] @ flat / np.sqrt((flat * flat).mean() + eps)
    pre = 1 / (1 + np.exp(-(mix * t["mtp.0.hc_head_scale"][0] + t["mtp.0.hc_head_base"])))
    y = norm((pre + cfg.hc_eps) @ X, t["mtp.0.norm.weight"])
    want = t["lm_head.weight"] @ y
    monkeypatch.setattr(type(engine.mtp), "_layer", lambda self, state, X, ids, pos: X)
    got, streams = engine.mtp.step(engine.mtp.new_state(), H, token, 0)
    np.testing.assert_allclose(streams, X, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_the_window_attends_only_rows_it_holds(engine):
    H = np.random.default_rng(2).standard_normal((engine.config.hc_mult,
                                                  engine.config.hidden_size), np.float32)
    empty, junk = engine.mtp.new_state(), engine.mtp.new_state()
    junk.raw[...] = 5.0  # rows no position owns: masked out
    a, _ = engine.mtp.step(empty, H, 10, 7)
    b, _ = engine.mtp.step(junk, H, 10, 7)
    np.testing.assert_array_equal(a, b)
    c, _ = engine.mtp.step(empty, H, 10, 8)  # now sees its row of position 7
    fresh, _ = engine.mtp.step(engine.mtp.new_state(), H, 10, 8)
    assert not np.allclose(c, fresh)
    assert list(np.flatnonzero(empty.positions >= 0)) == [7, 8]


def test_draft_counts_and_margins_outside_their_range_are_refused():
    assert SpeculationConfig().draft == 1 and SpeculationConfig().margin == 0.0
    for draft in (1, 16):
        assert SpeculationConfig(draft).draft == draft
    for draft in (0, 17):
        with pytest.raises(ValueError, match="--mtp-draft must be 1..16"):
            SpeculationConfig(draft)
    with pytest.raises(ValueError, match="--mtp-margin must be >= 0"):
        SpeculationConfig(1, -0.5)


def test_the_summary_counts_rounds_drafts_and_steps_without_one():
    stats = SpeculationStats()
    assert stats.summary() == ("mtp: 0 verify rounds, 0/0 drafts accepted (0.0%), 0.00 tokens "
                               "per verify round, 0 steps without a draft")
    stats.observe(3, 2)
    stats.observe(0, 0)
    stats.observe(1, 0)
    assert (stats.verify_rounds, stats.drafted, stats.accepted, stats.plain_steps) == (2, 4, 2, 1)
    assert stats.summary() == ("mtp: 2 verify rounds, 2/4 drafts accepted (50.0%), 2.00 tokens "
                               "per verify round, 1 steps without a draft")


def test_the_oracle_proposes_only_after_a_known_prefix():
    oracle = DraftOracle([[5, 6, 7, 8, 9]])
    assert oracle.proposals([5, 6], 7, 2) == [8, 9]
    assert oracle.proposals([5, 6], 7, 5) == [8, 9]
    assert oracle.proposals([5, 6], 4, 2) is None
    assert oracle.proposals([5, 6, 7, 8], 9, 1) is None  # nothing after the reference's end


def test_only_greedy_jobs_speculate():
    from ds4.sampling import SamplingOptions

    spec = Speculator(SpeculationConfig(2))
    assert spec.applies(SamplingOptions(temperature=0.0)) is True
    assert spec.applies(SamplingOptions(temperature=0.7)) is False


def test_drafts_end_before_an_end_of_sequence():
    """Greedy decoding stops at EOS, so a round never asks the verify about drafts after it."""
    from ds4.tokenizer import EOS_ID

    class Drafting:  # a session's draft/verify seam, recording what the verify was asked
        tokens: list[int] = []

        def draft(self, first, count, margin):
            return [4, EOS_ID, 7][:count]

        def verify(self, first, drafts):
            self.asked = list(drafts)
            return [first, *drafts]

    session = Drafting()
    assert Speculator(SpeculationConfig(3)).round(session, 9, 8) == [9, 4]
    assert session.asked == [4]


def test_drafts_and_verification_stop_at_the_context_and_the_vocabulary(engine):
    """Near the end of the context a round drafts only what still fits; a token outside the
    vocabulary, or one more than the context holds, is refused as by plain decoding."""
    from ds4.engine import ContextOverflow

    ids = prompt(engine, "Tell me a story about a fox and the sea.")
    s = engine.new_session(len(ids) + 3)
    s.sync(ids)
    first = int(np.argmax(s.logits))
    spec = Speculator(SpeculationConfig(5))
    assert len(spec.round(s, first, 8)) <= 3  # what is left of a 3-token room
    assert spec.stats.drafted <= 2  # no draft proposed past the context
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        s.verify(engine.config.vocab_size, [])
    held = (list(s.tokens), s.state.n)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        s.verify(first, [engine.config.vocab_size])  # a draft outside it, before any work
    assert (list(s.tokens), s.state.n) == held
    t = engine.new_session(len(ids) + 3)
    t.sync(ids)
    took = t.verify(first, plain_greedy(engine, ids, 6)[1:])  # 5 drafts, room for 2 of them
    assert 1 <= len(took) <= 3 and len(t.tokens) <= t.ctx_size
    while len(s.tokens) < s.ctx_size:
        s.decode(int(np.argmax(s.logits)))
    with pytest.raises(ContextOverflow):
        s.verify(int(np.argmax(s.logits)), [])


def test_verify_keeps_drafts_up_to_the_first_wrong_one(engine):
    """Each draft is checked against greedy's choice after the one before it: a right draft
    then a wrong one keeps exactly the right one, and the session holds what greedy would."""
    ids = prompt(engine, PROMPTS[0])
    reference = plain_greedy(engine, ids, 4)
    wrong = (reference[2] + 1) % engine.config.vocab_size
    s = engine.new_session(512)
    s.sync(ids)
    assert s.verify(reference[0], [reference[1], wrong, reference[3]]) == reference[:2]
    assert s.tokens == ids + reference[:2]
    assert int(np.argmax(s.logits)) == reference[2]


def test_the_margin_is_the_top_logit_less_the_runner_up():
    from ds4.mtp import top_gap

    top, gap = top_gap(np, np.array([1.0, 5.0, 3.5, -2.0], np.float32))
    assert top == 1 and gap == pytest.approx(1.5)


@pytest.mark.parametrize("draft", [1, 2])
def test_forced_rounds_emit_at_most_the_room_they_are_given(engine, draft):
    """A round never emits more than `room` tokens (what the burst and max_tokens leave), and
    with forced acceptance a round of one draft emits two."""
    ids = prompt(engine, PROMPTS[1])
    reference = plain_greedy(engine, ids, 8)
    s = engine.new_session(512)
    s.sync(ids)
    spec = Speculator(SpeculationConfig(draft), oracle=DraftOracle([ids + reference]))
    assert spec.round(s, reference[0], 2) == reference[:2]
    assert spec.round(s, reference[2], 1) == reference[2:3]
    assert spec.stats.accepted == spec.stats.drafted == 1
