"""MTP speculation on CuPy (GPU only): greedy output equals the plain CUDA-graph decode, the
block matches its NumPy run, forced acceptance keeps the output, rollback restores the state."""

from __future__ import annotations

import numpy as np
import pytest
from test_mtp import plain_session, speculated

from ds4.backend import cuda_available
from ds4.engine import Engine, default_model_dir
from ds4.jobs.speculative import DraftOracle

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]


@pytest.fixture(scope="module")
def engines():
    return {b: Engine.open(default_model_dir(), backend=b, mtp=True) for b in ("cupy", "numpy")}


def ids_of(engine) -> list[int]:
    return engine.tokenizer.encode("Tell me a story about a fox and the sea.")


@pytest.mark.parametrize("draft", [1, 2, 3])
def test_speculated_equals_plain_graph_decode(engines, draft):
    e = engines["cupy"]
    ids = ids_of(e)
    want, ref = plain_session(e, ids, 16)
    got, spec, s = speculated(e, ids, 16, draft)
    assert got == want and spec.stats.drafted > 0
    a = s.state.export(e.backend.to_numpy)
    b = ref.state.export(e.backend.to_numpy)
    for name in a:
        if ".pending_" not in name:  # dead pending rows differ between chunk and step paths
            np.testing.assert_allclose(a[name], b[name], rtol=1e-3, atol=1e-3, err_msg=name)


def test_forced_acceptance_on_the_gpu(engines):
    e = engines["cupy"]
    ids = ids_of(e)
    want, _ = plain_session(e, ids, 24)
    got, spec, _ = speculated(e, ids, 24, 3, DraftOracle([ids + want]))
    assert got == want and spec.stats.acceptance_rate == 1.0


def test_block_matches_numpy(engines):
    out = []
    for backend in ("cupy", "numpy"):
        e = engines[backend]
        s = e.new_session(256)
        s.sync(ids_of(e))
        logits, _ = e.mtp.step(s.mtp_state, s.mtp_state.hidden, 42, len(s.tokens))
        out.append(np.asarray(e.backend.to_numpy(logits)))
    np.testing.assert_allclose(out[0], out[1], rtol=1e-3, atol=1e-3)
