"""The engine runs the built-in tiny model (real vocabulary, bf16 on disk, MTP tensors present)
exactly like transformers does: same best tokens, same logits for them within TOLERANCE.

tests/fixtures/tiny_ref.npz comes from tools/make_tiny_reference.py (HF fp32, 300-token cached
prefill, then 8 single-token steps); it keeps the 32 best ids and logits of every checked row.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ds4.engine import Engine
from ds4.model.tiny import TINY_VERSION, make_tiny

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_ref.npz"
TOLERANCE = 2e-4  # max |logit difference| on the best tokens


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    with np.load(FIXTURE) as data:
        ref = {k: data[k] for k in data.files}
    assert str(ref["tiny_version"]) == TINY_VERSION, (
        "tiny recipe changed: rerun tools/make_tiny_reference.py")
    return ref


def check_row(logits, top_ids: np.ndarray, top_logits: np.ndarray, what: str) -> None:
    """The reference's best tokens keep their logits, and no other token outranks the 32nd."""
    logits = np.asarray(logits)
    assert logits.shape == (129280,) and logits.dtype == np.float32, what
    diff = float(np.abs(logits[top_ids] - top_logits).max())
    assert diff <= TOLERANCE, f"{what}: max |dlogit| on the best tokens {diff:.3g}"
    others = np.delete(logits, top_ids)
    assert others.max() <= top_logits[-1] + TOLERANCE, (
        f"{what}: a token outside the reference top-32 ranks in it")
    assert int(logits.argmax()) == int(top_ids[0]), f"{what}: argmax differs"


def test_tiny_model_prefill_and_decode_match_hf(tmp_path: Path, ref: dict) -> None:
    engine = Engine.open(make_tiny(tmp_path / "tiny"), backend="numpy", prefill_chunk=128,
                         quantize=False)
    ids, n = ref["ids"].tolist(), int(ref["prompt_len"])
    session = engine.new_session(ctx_size=512)
    check_row(session.sync(ids[:n]), ref["top_ids"][0], ref["top_logits"][0], "prefill")
    for step, token in enumerate(ids[n:], start=1):
        check_row(session.decode(token), ref["top_ids"][step], ref["top_logits"][step],
                  f"decode {step}")
