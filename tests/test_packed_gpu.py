"""The official-format (FP8 + FP4) tiny model on CuPy: packed bytes and scales on the device
once, the same logits as the NumPy engine with the FP8/FP4 simulation off and on (GPU only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4.backend import cuda_available
from ds4.engine import Engine
from ds4.model.packed import PackedMatrix

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]

ROOT = Path(__file__).resolve().parents[1]
IDS = [0] + list(range(7, 4000, 41))


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    out = tmp_path_factory.mktemp("official") / "tiny"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_official.py"), "tiny", str(out),
                    "--shard-mb", "8"], check=True, cwd=ROOT, capture_output=True)
    return out


def _run(engine: Engine) -> np.ndarray:
    s = engine.new_session(256)
    logits = [s.sync(IDS[:37]), s.sync(IDS[:70])]
    logits += [s.decode(t) for t in IDS[70:90]]
    return np.stack(logits)


def test_cupy_packed_equals_numpy(packed):
    gpu = Engine.open(packed, backend="cupy", prefill_chunk=16, quantize=False)
    cpu = Engine.open(packed, backend="numpy", prefill_chunk=16, quantize=False)
    layer = gpu.model.weights.layer(2)
    assert isinstance(layer["self_attn.q_b_proj.weight"], PackedMatrix)
    assert type(layer["self_attn.q_b_proj.weight"].codes).__module__.startswith("cupy")
    got, want = _run(gpu), _run(cpu)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
    assert (got.argmax(axis=1) == want.argmax(axis=1)).all()


def test_cupy_packed_simulation_tracks_numpy(packed):
    """Simulation on (the default for a packed checkpoint): GPU prefill through the model code
    and decode steps through the CUDA graph with ds4/kernels/quant.cu track the NumPy run."""
    engines = {(backend, q): Engine.open(packed, backend=backend, prefill_chunk=16, quantize=q)
               for backend in ("cupy", "numpy") for q in (False, True)}
    assert engines["cupy", True].model.kernel_decoder is not None  # the graph stays on
    assert Engine.open(packed, backend="cupy").model.quantize
    runs = {key: _run(engine) for key, engine in engines.items()}
    moved = np.abs(runs["numpy", True] - runs["numpy", False]).mean()  # what the rounding does
    apart = np.abs(runs["cupy", True] - runs["numpy", True]).mean()
    # fp32 summation-order noise moves some values across FP8 / FP4 rounding boundaries, so the
    # two simulations are close, not equal; without the simulation they would be `moved` apart
    assert apart < moved / 3, (apart, moved)
    assert np.abs(runs["cupy", True] - runs["cupy", False]).mean() > moved / 2


def test_cupy_weight_bytes_are_the_packed_bytes(packed):
    gpu = Engine.open(packed, backend="cupy").memory_report()["weight_bytes"]
    cpu = Engine.open(packed, backend="numpy").memory_report()["weight_bytes"]
    assert abs(gpu - cpu) <= 0.05 * cpu  # the NumPy figure is the stored bytes (CPU test)


def test_decode_graph_on_packed_weights_equals_eager(packed):
    """The CUDA-graph decode reads the FP8 / FP4 codes in place (ds4/kernels/packed.cu) and
    gives the model code's logits (per-use widening on CuPy) and the NumPy engine's."""
    import cupy

    from ds4.model.gpu_decode import KernelDecoder
    from ds4.model.state import SessionState

    gpu = Engine.open(packed, backend="cupy", quantize=False).model
    cpu = Engine.open(packed, backend="numpy", quantize=False)
    assert gpu.kernel_decoder is not None  # packed weights no longer switch the graph off
    gpu.kernel_decoder = None
    decoder = KernelDecoder.from_model(gpu)
    eager, graphed = SessionState(cupy, gpu.cfg, 256), SessionState(cupy, gpu.cfg, 256)
    ref = cpu.new_session(256)
    gpu.forward(eager, IDS[:40])
    gpu.forward(graphed, IDS[:40])
    ref.sync(IDS[:40])
    for step, t in enumerate(IDS[40:70]):
        a = cupy.asnumpy(gpu.forward(eager, [t]))
        b = cupy.asnumpy(decoder.decode(graphed, t))
        c = ref.decode(t)
        # three summation orders, each writing its own KV rows for 30 steps: the gap grows
        # with the steps (1e-5 at the first, 2.2e-4 at the 27th on the H200, 2026-12-02)
        gaps = np.abs(a - b).max(), np.abs(b - c).max()
        assert max(gaps) < 5e-4, (step, gaps)
        assert int(np.argmax(a)) == int(np.argmax(b)) == int(np.argmax(c)), step
    assert 1 in decoder.graphs  # later steps were replays of the batch-of-one graph
    # the decoder holds the engine's packed arrays, not copies
    layer = gpu.weights.layer(3)
    assert decoder.layers[3]["self_attn.q_b_proj.weight"] is layer["self_attn.q_b_proj.weight"]
    assert decoder.layers[3]["experts.gate_up"] is layer.experts.stacked[0]
