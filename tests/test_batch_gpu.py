"""Engine.decode_batch on CuPy (needs CuPy and a GPU).

The default: the kernel decoder's graph of the batch size (1, 2, 4, 8) reads every member's
position, token and state through its member table, and each kernel computes a member's row the
same way whatever the batch, so batched logits equal single steps (the batch-of-one graph)
bitwise; greedy streams therefore equal too. Sessions sit at different positions and lengths,
windows of the CSA and HCA compressors close inside batched steps, 3 and 5 sessions run with
idle members, and one graph per size serves every member set.

The other way (`Model.batch_rows`, DS4_DECODE_BATCH=rows) is the model code run eagerly on CuPy
arrays: shared matrices as one cuBLAS GEMM over the [B, D] block, each routed expert one grouped
GEMM over the rows that picked it, attention per session. It is compared with single steps of
the same eager code (kernel decoder off), within 3e-5 of the logits' scale (measured on the
H200: 1.0-1.7e-5; cuBLAS picks another reduction order for a [B, D] block than for one row), and
with the CUDA-graph single steps, within the 2e-4 that separates the eager path from the kernels
(tests/test_gpu_engine.py) and with the same argmax.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_batch_engine import packed_tiny, prompt, twin_sessions

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


def graphs_of(engine: Engine) -> dict:
    """The kernel decoder's graphs by batch size (it is built on the first decode)."""
    return engine.model.kernel_decoder.decoder.graphs


def test_kernel_batch_equals_single_steps_bitwise(path):
    engine = Engine.open(path, backend="cupy", prefill_chunk=16)
    assert engine.model.kernel_decoder is not None and not engine.model.batch_rows
    for lengths in [(23,), (15, 30), (7, 70, 22), (15, 30, 47, 63), (9, 40, 17, 66, 3)]:
        for alone, together in twin_runs(engine, lengths, steps=6):
            for a, b in zip(alone, together):
                assert np.array_equal(a, b), lengths
    assert set(graphs_of(engine)) == {1, 2, 4, 8}  # 3 runs as 4, 5 as 8 (idle members)


def test_one_graph_per_size_serves_every_member_set():
    engine = Engine.open(default_model_dir(), backend="cupy", prefill_chunk=16)
    pool = [engine.new_session(128) for _ in range(6)]
    twins = [engine.new_session(128) for _ in range(6)]
    for k, (s, t) in enumerate(zip(pool, twins)):
        s.sync(prompt(k, 10 + 7 * k))
        t.sync(prompt(k, 10 + 7 * k))
    seen = []
    for members in ([0, 1, 2, 3], [2, 3, 4, 5], [5, 0, 3], [1, 4, 2, 0], [4, 5, 1]):
        tokens = [int(np.argmax(pool[m].logits)) for m in members]
        together = engine.decode_batch([pool[m] for m in members], tokens)
        alone = [twins[m].decode(t) for m, t in zip(members, tokens)]
        assert all(np.array_equal(a, b) for a, b in zip(alone, together))
        seen.append(graphs_of(engine).get(4))
    assert seen[1] is not None and all(g is seen[1] for g in seen[1:])  # captured once


def test_larger_state_recaptures_the_graph():
    """A member whose compressed rows outgrow the graph's bounds makes it re-capture; its rows
    still equal single steps bitwise, and so do the small members'."""
    engine = Engine.open(default_model_dir(), backend="cupy", prefill_chunk=16)
    ctxs = [128, 128, 1024]
    sets = [[engine.new_session(c) for c in ctxs] for _ in range(2)]
    for group in sets:
        for k, s in enumerate(group):
            s.sync(prompt(k, 20 + 9 * k))
    single, batched = sets
    before = None
    for step, members in enumerate([[0, 1], [0, 1], [0, 2], [0, 1, 2], [1, 2]]):
        tokens = [int(np.argmax(single[m].logits)) for m in members]
        alone = [single[m].decode(t) for m, t in zip(members, tokens)]
        together = engine.decode_batch([batched[m] for m in members], tokens)
        assert all(np.array_equal(a, b) for a, b in zip(alone, together)), step
        if step == 1:
            before = graphs_of(engine).get(2)
    after = graphs_of(engine).get(2)
    assert before is not None and after is not None and after is not before


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
