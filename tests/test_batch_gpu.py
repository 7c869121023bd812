"""Engine.decode_batch on CuPy (needs CuPy and a GPU).

Two ways to run a batch there. The batched pass (`Model.batch_rows`, DS4_DECODE_BATCH=rows) is
the model code run eagerly on CuPy arrays: shared matrices as one cuBLAS GEMM over the [B, D]
block, each routed expert one grouped GEMM over the rows that picked it, attention per
session. It is compared with single steps of the same eager code (kernel decoder off), within
3e-5 of the logits' scale (measured on the H200: 1.0-1.7e-5; cuBLAS picks another reduction
order for a [B, D] block than for one row, so the issue's 1e-5 is not met there), and with the
CUDA-graph single steps, within the 2e-4 that separates
the eager path from the kernels (tests/test_gpu_engine.py) and with the same argmax. The default
where the kernel decoder runs (DS4_DECODE_BATCH=replay) replays each session's graph in turn,
which must equal single steps bitwise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_batch_engine import packed_tiny, twin_sessions

from ds4.backend import cuda_available
from ds4.engine import Engine, default_model_dir

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]

FIXTURES = Path(__file__).parent / "fixtures"
LENGTHS = [(15, 30), (7, 70, 22), (15, 30, 47, 63)]


def model_dir(case: str, tmp_path_factory) -> Path:
    if case == "tiny":
        return Path(default_model_dir())
    if case == "tiny-packed":
        return packed_tiny(tmp_path_factory.mktemp("official"))
    return FIXTURES / case


@pytest.fixture(scope="module", params=["v4_csa_hca", "v4_hca8", "tiny", "tiny-packed"])
def path(request, tmp_path_factory) -> Path:
    return model_dir(request.param, tmp_path_factory)


def twin_runs(engine: Engine, lengths, steps: int = 5):
    """(single-step logits, batched logits) per step, the same greedy tokens fed to both."""
    single, batched = twin_sessions(engine, list(lengths))
    for _ in range(steps):
        tokens = [int(np.argmax(s.logits)) for s in single]
        alone = [s.decode(t) for s, t in zip(single, tokens)]
        yield alone, engine.decode_batch(batched, tokens)


@pytest.mark.parametrize("lengths", LENGTHS)
def test_cupy_batched_step_equals_single_eager_steps(path, lengths):
    # the packed model's FP8/FP4 rounding simulation would turn summation-order noise into
    # whole rounding steps: compare the plain math (tests/test_packed_gpu.py covers it)
    engine = Engine.open(path, backend="cupy", prefill_chunk=16, quantize=False)
    engine.model.kernel_decoder = None  # single steps through the same model code
    engine.model.batch_rows = True
    for alone, together in twin_runs(engine, lengths):
        for a, b in zip(alone, together):
            assert np.abs(b - a).max() <= 3e-5 * np.abs(a).max()


@pytest.mark.parametrize("lengths", LENGTHS[1:])
def test_cupy_batched_step_tracks_graph_decode(path, lengths):
    engine = Engine.open(path, backend="cupy", prefill_chunk=16, quantize=False)
    assert engine.model.kernel_decoder is not None
    engine.model.batch_rows = True
    for alone, together in twin_runs(engine, lengths):
        for a, b in zip(alone, together):
            np.testing.assert_allclose(b, a, atol=2e-4, rtol=0)
            assert int(np.argmax(a)) == int(np.argmax(b))


def test_cupy_default_batch_replays_each_graph_bitwise(path):
    engine = Engine.open(path, backend="cupy", prefill_chunk=16)
    assert engine.model.kernel_decoder is not None and not engine.model.batch_rows
    for alone, together in twin_runs(engine, LENGTHS[2]):
        for a, b in zip(alone, together):
            assert np.array_equal(a, b)
