"""Sessions of one engine: interleaving, snapshot/restore, rollback, chunking, stopping, overflow.

All on the HF-parity fixture model (window 32, CSA m=4 top-8, HCA m=16), so windows close and
the indexer selects during both prefill and decode. Exact equality is expected where the same
arithmetic runs; chunked-vs-one-shot differs only by summation order (tolerance 1e-4).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ds4.engine import ContextOverflow, Engine

FIXTURE = Path(__file__).parent / "fixtures" / "v4_csa_hca"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.open(FIXTURE, backend="numpy", prefill_chunk=16)


def prompt(seed: int, length: int) -> list[int]:
    return [0] + np.random.default_rng(seed).integers(2, 512, length - 1).tolist()


def greedy(session, logits, steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        token = int(np.argmax(logits))
        out.append(token)
        logits = session.decode(token)
    return out


@pytest.mark.parametrize("lengths", [(45, 45), (23, 70, 41)])
def test_two_sessions_smoke(engine, lengths):
    """Sessions driven interleaved on one thread each equal their isolated run, token by token."""
    steps = 12
    prompts = [prompt(i, n) for i, n in enumerate(lengths)]
    alone = []
    for p in prompts:
        s = engine.new_session(256)
        alone.append(greedy(s, s.sync(p), steps))
    sessions = [engine.new_session(256) for _ in prompts]
    logits = [s.sync(p) for s, p in zip(sessions, prompts)]
    streams = [[] for _ in prompts]
    for _ in range(steps):  # one greedy token each, alternating on one thread
        for k, s in enumerate(sessions):
            token = int(np.argmax(logits[k]))
            streams[k].append(token)
            logits[k] = s.decode(token)
    assert streams == alone
    assert len({tuple(s) for s in streams}) == len(streams)  # the streams really differ


def test_snapshot_restore_mid_decode_gives_identical_logits(engine):
    s = engine.new_session(256)
    logits = s.sync(prompt(7, 50))
    greedy(s, logits, 9)
    blob = s.snapshot()
    r = engine.new_session(128).restore(blob)
    assert r.tokens == s.tokens
    np.testing.assert_array_equal(r.logits, s.logits)
    for token in (5, 77, 300, 2, 9, 41, 100, 7):  # crosses HCA closing at 63 and CSA windows
        np.testing.assert_array_equal(r.decode(token), s.decode(token))
    p = s.tokens[:50]  # the restored session still rolls back to the synced prompt for free
    assert r.reusable_prefix(p) == 50
    np.testing.assert_array_equal(r.sync(p), s.sync(p))
    np.testing.assert_array_equal(r.decode(11), s.decode(11))


def test_rollback_to_prompt_end_equals_fresh_run(engine):
    p = prompt(3, 61)
    s = engine.new_session(256)
    first = s.sync(p)
    greedy(s, first, 10)  # closes windows past the prompt end
    assert s.reusable_prefix(p) == len(p)
    again = s.sync(p)  # regenerate: no prefill
    np.testing.assert_array_equal(again, first)
    fresh = engine.new_session(256)
    fresh_logits = fresh.sync(p)
    assert greedy(s, again, 10) == greedy(fresh, fresh_logits, 10)
    other = p[:40] + [9, 9, 9]
    assert s.reusable_prefix(other) == 0  # a shorter shared prefix rebuilds
    np.testing.assert_allclose(s.sync(other), engine.new_session(64).sync(other), atol=0)


def test_ragged_chunks_equal_one_shot(engine):
    p = prompt(11, 97)
    one = Engine(engine.model_dir, engine.config, engine.model, prefill_chunk=512).new_session(128)
    want = one.sync(p)
    s = engine.new_session(128)
    for end in (5, 6, 38, 41, 70, 71, 97):  # growing prefixes reuse the held tokens
        got = s.sync(p[:end])
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert s.tokens == p


def test_should_stop_leaves_a_valid_prefix(engine):
    p = prompt(5, 80)
    asked = []

    def should_stop() -> bool:
        asked.append(len(s.tokens))
        return len(asked) == 3

    s = engine.new_session(128)
    assert s.sync(p, should_stop=should_stop) is None
    assert asked == [16, 32, 48]  # asked between chunks only
    assert s.tokens == p[:48]  # chunks of 16: stopped before the 4th chunk
    np.testing.assert_allclose(s.logits, engine.new_session(128).sync(p[:48]), atol=1e-4)
    resumed = s.sync(p)
    np.testing.assert_allclose(resumed, engine.new_session(128).sync(p), atol=1e-4)


def test_context_overflow(engine):
    s = engine.new_session(40)
    with pytest.raises(ContextOverflow, match="context size 40"):
        s.sync(prompt(1, 41))
    s.sync(prompt(1, 40))
    with pytest.raises(ContextOverflow):
        s.decode(3)
    assert len(s.tokens) == 40
    with pytest.raises(ValueError, match="token id 512 is outside"):
        engine.new_session(8).sync([0, 512])


def test_memory_report(engine):
    engine.new_session(128).sync(prompt(3, 20))  # scratch is sized by the first forward
    report = engine.memory_report()
    cfg = engine.config
    # CSA layers append head_dim/4 + index_head_dim/4 floats per token, HCA head_dim/16
    assert report["state_bytes_per_token"] == 4 * (2 * (32 / 4 + 16 / 4) + 2 * (32 / 16))
    assert report["weight_bytes"] > 0 and report["scratch_bytes"] > 0
    assert (report["state_fixed_bytes"]
            >= cfg.num_hidden_layers * cfg.sliding_window * cfg.head_dim * 4)


def test_indexer_query_blocks_do_not_change_results(engine, monkeypatch):
    from ds4.model import indexer

    p = prompt(13, 120)
    want = engine.new_session(128).sync(p)
    monkeypatch.setattr(indexer, "SCORE_BLOCK",
                        16 * 30 * 3)  # 16 heads x ~30 rows: 3 queries a block
    np.testing.assert_array_equal(engine.new_session(128).sync(p), want)


def test_session_sample_draws_what_the_host_sampler_draws(engine):
    """Session.sample on the last logits gives the tokens ds4.sampling.sample gives on s.logits
    with the same seed, and needs logits to exist."""
    from ds4.jobs.events import SamplingOptions
    from ds4.sampling import make_rng, sample

    s = engine.new_session(128)
    with pytest.raises(ValueError):
        s.sample(SamplingOptions(), make_rng(0))
    opts = SamplingOptions(temperature=1.5, top_p=0.9, min_p=0.0)
    s.sync(prompt(4, 20))
    mine, theirs = make_rng(3), make_rng(3)
    for _ in range(8):
        token = s.sample(opts, mine)
        assert token == sample(s.logits, opts, theirs)
        s.decode(token)


def test_a_bad_token_id_leaves_the_held_prompt_intact(engine):
    """A prompt with an id outside the vocabulary fails before any state is touched, so the
    session still holds (and reuses) what it held."""
    p = prompt(6, 40)
    s = engine.new_session(128)
    want = s.sync(p).copy()
    for bad in ([0, 5, 512],
                p[:20] + [7] * 30 + [-1]):  # a diverging prompt, bad id in a later chunk
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            s.sync(bad)
        assert s.tokens == p and s.reusable_prefix(p) == len(p)
        np.testing.assert_array_equal(s.logits, want)
    np.testing.assert_allclose(s.decode(3), engine.new_session(128).sync(p + [3]), atol=1e-4)


def test_memory_report_matches_what_a_session_allocates(engine):
    report = engine.memory_report()
    ctx = 4 * 16 * 8  # a multiple of every compress ratio: no partial row of capacity
    held = engine.new_session(ctx).state.nbytes
    assert held == report["state_fixed_bytes"] + report["state_bytes_per_token"] * ctx


@pytest.mark.parametrize("synced_before", [True, False])
def test_a_forward_that_raises_leaves_no_half_written_state(engine, monkeypatch, synced_before):
    """An error inside a layer (e.g. out of memory) after earlier layers wrote their rows must
    not leave those rows behind: the next sync equals a fresh run."""
    p, more = prompt(8, 40), prompt(9, 30)[1:]
    s = engine.new_session(128)
    if synced_before:
        s.sync(p)
    real_layer = engine.model._layer

    def failing_layer(i, *args):
        if i == len(engine.config.layer_types) - 1:  # every earlier layer already ran the chunk
            raise MemoryError("out of memory")
        return real_layer(i, *args)

    monkeypatch.setattr(engine.model, "_layer", failing_layer)
    with pytest.raises(MemoryError):
        s.sync(p + more)
    monkeypatch.undo()
    assert len(s.tokens) == s.state.n and s.tokens == (p + more)[: len(s.tokens)]
    np.testing.assert_allclose(s.sync(p + more), engine.new_session(128).sync(p + more), atol=1e-4)
    np.testing.assert_allclose(s.decode(5), engine.new_session(128).sync(p + more + [5]), atol=1e-4)


def test_a_damaged_or_foreign_snapshot_is_a_clear_error(engine):
    """restore() rejects bytes that are no snapshot, a truncated one, one lacking an array, or
    one of another model with ValueError; a session that failed to restore is still usable."""
    import io

    src = engine.new_session(128)
    src.sync(prompt(12, 30))
    blob = src.snapshot()
    with np.load(io.BytesIO(blob)) as data:
        arrays = {k: data[k] for k in data.files if not k.endswith(".compressor.rows")}
    lacking = io.BytesIO()
    np.savez(lacking, **arrays)
    other = Engine.open(FIXTURE.parent / "v4_hca8", backend="numpy").new_session(128)
    other.sync([0, 5, 6])
    p = prompt(14, 20)
    for bad, match in ((b"garbage", "not a session snapshot"),
                       (blob[: len(blob) // 2], "not a session snapshot"),
                       (lacking.getvalue(), "lacks"), (other.snapshot(), "different model")):
        s = engine.new_session(128)
        s.sync(p)
        with pytest.raises(ValueError, match=match):
            s.restore(bad)
        np.testing.assert_allclose(s.sync(p + [3]), engine.new_session(128).sync(p + [3]),
                                   atol=1e-4)


def test_returned_logits_are_read_only_so_a_regenerate_gets_them_unchanged(engine):
    """sync and decode hand out the arrays the session keeps (the prompt frontier's logits serve
    every regenerate), so writing into them is refused instead of corrupting later syncs."""
    p = prompt(15, 30)
    s = engine.new_session(128)
    first = s.sync(p)
    want = first.copy()
    with pytest.raises(ValueError, match="read-only"):
        first[0] = 1e9
    with pytest.raises(ValueError, match="read-only"):
        s.decode(4)[0] = 1e9
    np.testing.assert_array_equal(s.sync(p), want)
    r = engine.new_session(128).restore(s.snapshot())
    with pytest.raises(ValueError, match="read-only"):
        r.logits[0] = 1e9
