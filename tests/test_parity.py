"""The NumPy engine reproduces transformers' DeepseekV4ForCausalLM (fp32) logits.

Fixtures come from tools/make_reference.py (see tests/fixtures/README.md). HF's own cached
runs agree with its non-cached forward within 1e-5; an engine in fp32 must stay within
TOLERANCE of HF on every checked row, and pick the same argmax.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest

from ds4.engine import Engine

FIXTURES = Path(__file__).parent / "fixtures"
CASES = ["v4_csa_hca", "v4_hca8"]
LAYOUTS = {"hf": "", "official": "official", "default": "default"}
TOLERANCE = 2e-4  # max |logit difference|, logits reach ~4.5


@cache
def reference(case: str) -> dict[str, np.ndarray]:
    """The fixture's ref.npz as a dict."""
    with np.load(FIXTURES / case / "ref.npz") as ref:
        return {k: ref[k] for k in ref.files}


@cache
def engine(case: str, layout: str, prefill_chunk: int = 512) -> Engine:
    """One NumPy fp32 engine per fixture directory, without FP8/FP4 simulation."""
    model_dir = FIXTURES / case / LAYOUTS[layout]
    return Engine.open(model_dir, backend="numpy", prefill_chunk=prefill_chunk, quantize=False)


def assert_logits_close(got, want: np.ndarray, what: str) -> None:
    """Same shape, float32, within TOLERANCE, same argmax."""
    assert got is not None, f"{what}: no logits"
    got = np.asarray(got)
    assert got.dtype == np.float32, f"{what}: dtype {got.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    diff = float(np.abs(got - want).max())
    assert diff <= TOLERANCE, f"{what}: max |dlogit| {diff:.3g} > {TOLERANCE}"
    assert int(got.argmax()) == int(want.argmax()), f"{what}: argmax differs"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", CASES)
def test_prefill_then_decode_matches_hf(case: str, layout: str) -> None:
    """One sync of the whole prompt, then every single-token decode step."""
    ref = reference(case)
    ids, p = ref["ids"].tolist(), int(ref["prefill_len"])
    session = engine(case, layout).new_session(ctx_size=256)
    logits = session.sync(ids[:p])
    assert_logits_close(logits, ref["full_logits"][p - 1], f"{case}/{layout} prefill")
    assert session.tokens == ids[:p]
    for i, token in enumerate(ids[p:]):
        logits = session.decode(token)
        assert_logits_close(logits, ref["decode_logits"][i], f"{case}/{layout} decode step {i}")
        assert_logits_close(logits, ref["full_logits"][p + i],
                            f"{case}/{layout} decode vs full {i}")
    assert session.tokens == ids


@pytest.mark.parametrize("case", CASES)
def test_ragged_syncs_growing_the_prefix_match_hf(case: str) -> None:
    """Several syncs, each extending the held prefix by a ragged chunk (as HF's cached run)."""
    ref = reference(case)
    ids = ref["ids"].tolist()
    session = engine(case, "hf").new_session(ctx_size=256)
    for end, want in zip(ref["chunk_ends"].tolist(), ref["chunk_logits"]):
        logits = session.sync(ids[:end])
        assert_logits_close(logits, want, f"{case} sync to {end}")
        assert_logits_close(logits, ref["full_logits"][end - 1], f"{case} sync to {end} vs full")
        assert session.tokens == ids[:end]


@pytest.mark.parametrize("prefill_chunk", [1, 3, 7])
def test_small_prefill_chunks_match_hf(prefill_chunk: int) -> None:
    """A whole-prompt sync cut into small internal chunks gives the non-cached logits."""
    case = "v4_hca8"
    ref = reference(case)
    ids, p = ref["ids"].tolist(), int(ref["prefill_len"])
    session = engine(case, "official", prefill_chunk).new_session(ctx_size=256)
    logits = session.sync(ids[:p])
    assert_logits_close(logits, ref["full_logits"][p - 1], f"{case} chunk {prefill_chunk}")
    for i, token in enumerate(ids[p : p + 4]):
        logits = session.decode(token)
        assert_logits_close(logits, ref["decode_logits"][i],
                            f"{case} chunk {prefill_chunk} decode {i}")


@pytest.mark.parametrize("case", CASES)
def test_every_prefix_length_matches_hf(case: str) -> None:
    """Token-by-token decode from the first token reproduces every non-cached row."""
    ref = reference(case)
    ids = ref["ids"].tolist()
    session = engine(case, "hf").new_session(ctx_size=256)
    logits = session.sync(ids[:1])
    assert_logits_close(logits, ref["full_logits"][0], f"{case} position 0")
    for t in range(1, len(ids)):
        logits = session.decode(ids[t])
        assert_logits_close(logits, ref["full_logits"][t], f"{case} position {t}")


@pytest.mark.parametrize("case", CASES)
def test_going_back_to_earlier_prefixes_matches_hf(case: str) -> None:
    """Regenerate after decoding (back to the synced prompt end), a shorter prefix (rebuild),
    and a longer one again: each sync returns the non-cached logits of its last position."""
    ref = reference(case)
    ids, p = ref["ids"].tolist(), int(ref["prefill_len"])
    full = ref["full_logits"]
    session = engine(case, "hf").new_session(ctx_size=256)
    session.sync(ids[:p])
    for token in ids[p : p + 6]:
        session.decode(token)
    assert_logits_close(session.sync(ids[:p]), full[p - 1], f"{case} back to the prompt end")
    assert session.tokens == ids[:p]
    assert_logits_close(session.decode(ids[p]), full[p], f"{case} decode after going back")
    assert_logits_close(session.sync(ids[: p - 9]), full[p - 10], f"{case} shorter prefix")
    assert_logits_close(session.sync(ids[: p + 11]), full[p + 10], f"{case} longer again")
    assert session.tokens == ids[: p + 11]
