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

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]

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


@pytest.mark.parametrize("quantize", [False, True])
def test_cupy_packed_equals_numpy(packed, quantize):
    gpu = Engine.open(packed, backend="cupy", prefill_chunk=16, quantize=quantize)
    cpu = Engine.open(packed, backend="numpy", prefill_chunk=16, quantize=quantize)
    layer = gpu.model.weights.layer(2)
    assert isinstance(layer["self_attn.q_b_proj.weight"], PackedMatrix)
    assert type(layer["self_attn.q_b_proj.weight"].codes).__module__.startswith("cupy")
    got, want = _run(gpu), _run(cpu)
    # FP8/FP4 rounding of KV and indexer rows turns fp32 summation-order noise into rare flips
    np.testing.assert_allclose(got, want, atol=5e-2 if quantize else 2e-4, rtol=0)
    if not quantize:
        assert (got.argmax(axis=1) == want.argmax(axis=1)).all()


def test_cupy_weight_bytes_are_the_packed_bytes(packed):
    gpu = Engine.open(packed, backend="cupy").memory_report()["weight_bytes"]
    cpu = Engine.open(packed, backend="numpy").memory_report()["weight_bytes"]
    assert abs(gpu - cpu) <= 0.05 * cpu  # the NumPy figure is the stored bytes (CPU test)
