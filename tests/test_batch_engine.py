"""Engine.decode_batch: one engine step for B sessions equals B single `Session.decode` calls.

On NumPy a [B, D] block times a weight is one GEMM while a single decode is a GEMV, and BLAS
sums the two in different orders, so batched logits are not bitwise equal: they agree within
1e-5 of the logits' scale, max|batched - single| <= 1e-5 * max|single| (measured: at most 1.2e-5
absolute on the tiny model's logits of magnitude ~3; 3e-6 on the fixtures'). Sessions sit at
different positions, and the steps cross CSA (m=4) and HCA (m=8 / 16 / 32) window ends, so a
compressor closes a row inside a batched step. The models: both HF-parity fixtures, the tiny
model (every layer type) and the tiny model as packed FP8 + FP4 weights.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4.engine import MAX_BATCH, ContextOverflow, Engine, default_model_dir

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


def prompt(seed: int, length: int, vocab: int = 512) -> list[int]:
    return [0] + np.random.default_rng(seed).integers(2, vocab, length - 1).tolist()


def packed_tiny(root: Path) -> Path:
    """The tiny model as an official FP8 + FP4 checkpoint (held packed, widened per use)."""
    out = root / "packed"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_official.py"), "tiny", str(out),
                    "--shard-mb", "8"], check=True, cwd=ROOT, capture_output=True)
    return out


@pytest.fixture(scope="module", params=["v4_csa_hca", "v4_hca8", "tiny", "tiny-packed"])
def engine(request, tmp_path_factory) -> Engine:
    if request.param == "tiny-packed":
        path = packed_tiny(tmp_path_factory.mktemp("official"))
    else:
        path = default_model_dir() if request.param == "tiny" else FIXTURES / request.param
    return Engine.open(path, backend="numpy", prefill_chunk=16)


def assert_close(batched: np.ndarray, single: np.ndarray) -> None:
    """Within 1e-5 of the logits' scale (see the module docstring)."""
    assert np.abs(batched - single).max() <= TOL * np.abs(single).max()


def twin_sessions(engine: Engine, lengths: list[int]):
    """Two identical sets of sessions holding prompts of the given lengths."""
    sets = []
    for _ in range(2):
        sessions = [engine.new_session(128) for _ in lengths]
        for s, n in zip(sessions, lengths):
            s.sync(prompt(n, n))
        sets.append(sessions)
    return sets


def crosses_window_end(engine: Engine, sessions) -> bool:
    """True when some session's next token closes a compressor window."""
    rates = list(engine.config.compress_rates.values())
    return any((len(s.tokens) + 1) % r == 0 for s in sessions for r in rates)


@pytest.mark.parametrize("lengths", [(15, 30), (7, 70, 22), (15, 30, 47, 63)])
def test_batched_step_equals_single_steps(engine, lengths):
    """Greedy tokens fed to B single decodes and to decode_batch give the same logits."""
    single, batched = twin_sessions(engine, list(lengths))
    crossed = False
    for _ in range(5):
        tokens = [int(np.argmax(s.logits)) for s in single]
        crossed |= crosses_window_end(engine, batched)
        alone = [s.decode(t) for s, t in zip(single, tokens)]
        together = engine.decode_batch(batched, tokens)
        for a, b in zip(alone, together):
            assert_close(b, a)
    assert crossed
    assert [s.tokens for s in single] == [s.tokens for s in batched]


def test_more_than_max_batch_runs_in_several_steps():
    """MAX_BATCH + 1 sessions still each get their own logits."""
    engine = Engine.open(FIXTURES / "v4_hca8", backend="numpy", prefill_chunk=16)
    lengths = [5 + 3 * i for i in range(MAX_BATCH + 1)]
    single, batched = twin_sessions(engine, lengths)
    tokens = [int(np.argmax(s.logits)) for s in single]
    alone = [s.decode(t) for s, t in zip(single, tokens)]
    for a, b in zip(alone, engine.decode_batch(batched, tokens)):
        assert_close(b, a)


def test_batch_of_one_is_session_decode(engine):
    single, batched = twin_sessions(engine, [9])
    a = single[0].decode(5)
    (b,) = engine.decode_batch(batched, [5])
    assert np.array_equal(a, b)


def test_bad_batches_are_refused_before_any_work(engine):
    sessions = [engine.new_session(16) for _ in range(2)]
    for s in sessions:
        s.sync(prompt(1, 16 if s is sessions[1] else 4))
    before = [list(s.tokens) for s in sessions]
    with pytest.raises(ContextOverflow):
        engine.decode_batch(sessions, [3, 3])
    with pytest.raises(ValueError, match="vocabulary"):
        engine.decode_batch(sessions[:1] + [engine.new_session(16)], [3, -1])
    with pytest.raises(ValueError, match="only once"):
        engine.decode_batch([sessions[0], sessions[0]], [3, 4])
    with pytest.raises(ValueError, match="tokens"):
        engine.decode_batch(sessions, [3])
    assert [s.tokens for s in sessions] == before


def test_a_failed_batched_step_rolls_every_session_back(engine, monkeypatch):
    """A step that fails after writing state leaves each session at its prompt's frontier,
    from where it decodes exactly as a fresh twin does."""
    single, batched = twin_sessions(engine, [12, 33])
    prompts = [list(s.tokens) for s in batched]
    run = engine.model.decode_rows

    def broken(states, tokens):
        run(states, tokens)  # every layer wrote its rows
        raise RuntimeError("device lost")
    monkeypatch.setattr(engine.model, "decode_rows", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.decode_batch(batched, [5, 6])
    monkeypatch.undo()
    assert [s.tokens for s in batched] == prompts
    alone = [s.decode(t) for s, t in zip(single, [5, 6])]
    for a, b in zip(alone, engine.decode_batch(batched, [5, 6])):
        assert_close(b, a)


@pytest.mark.parametrize("choice, rows", [("rows", True), ("replay", False), ("", True)])
def test_decode_batch_env_picks_the_batched_pass_or_single_steps(monkeypatch, choice, rows):
    """DS4_DECODE_BATCH=replay runs single steps one after another: bitwise equal to them."""
    monkeypatch.setenv("DS4_DECODE_BATCH", choice)
    engine = Engine.open(FIXTURES / "v4_hca8", backend="numpy", prefill_chunk=16)
    assert engine.model.batch_rows is rows
    single, batched = twin_sessions(engine, [9, 20])
    alone = [s.decode(t) for s, t in zip(single, [4, 7])]
    together = engine.decode_batch(batched, [4, 7])
    for a, b in zip(alone, together):
        assert_close(b, a)
        if not rows:
            assert np.array_equal(a, b)
