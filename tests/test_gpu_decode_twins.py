"""The kernel decode step (ds4/model/gpu_decode.py), run through the kernels' NumPy twins on the
CPU, equals the NumPy engine's forward token by token on the parity fixtures and the tiny model.

This checks the composition of the GPU decode (which kernel reads which state, in which order)
on machines without a GPU; tests/test_gpu_engine.py checks the kernels themselves on a GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ds4.backend import get_backend
from ds4.kernels import (
    attention,
    compressor,
    gemv,
    hyper_connection,
    indexer,
    moe,
    norm,
    packed,
    quant,
    rope,
    sampling,
)
from ds4.model import gpu_decode
from ds4.model.config import ModelConfig
from ds4.model.forward import Model
from ds4.model.state import SessionState
from ds4.model.weights import load_weights

FIXTURES = Path(__file__).parent / "fixtures"
TOL = 2e-4  # fp32 logits, same weights, different summation order


@pytest.fixture
def twins(monkeypatch):
    """Route every launcher the decoder calls to its NumPy twin (packed and quant too)."""
    for mod in (attention, compressor, hyper_connection, indexer, moe, sampling, packed, quant):
        for name in dir(mod):
            if name.endswith("_numpy") and hasattr(mod, name[:-6]):
                monkeypatch.setattr(mod, name[:-6], getattr(mod, name))
    monkeypatch.setattr(gpu_decode, "gemv", gemv.gemv_numpy)
    monkeypatch.setattr(gpu_decode, "gemv_many", gemv.gemv_many_numpy)
    monkeypatch.setattr(gpu_decode, "rms_norm", norm.rms_norm_numpy)
    monkeypatch.setattr(gpu_decode, "rope_tail", rope.rope_tail_numpy)
    return gpu_decode


def open_model(model_dir: Path) -> Model:
    backend = get_backend("numpy")
    cfg = ModelConfig.from_dir(model_dir)
    return Model(cfg, load_weights(model_dir, cfg, backend.xp), backend, quantize=False)


def twin_step(decoder, state, token: int) -> np.ndarray:
    decoder.pos_token[...] = (state.n, token)
    decoder.run(state)
    state.n += 1
    return decoder.buf["logits"].copy()


def model_dir(case: str) -> Path:
    if case == "tiny":
        from ds4.engine import default_model_dir

        return Path(default_model_dir())
    return FIXTURES / case


@pytest.mark.parametrize("case", ["v4_csa_hca", "v4_hca8", "tiny"])
def test_twin_decode_matches_engine(twins, case):
    model = open_model(model_dir(case))
    rng = np.random.default_rng(5)
    ids = [0] + rng.integers(2, min(model.cfg.vocab_size, 50000), 40).tolist()
    decoder = gpu_decode.KernelDecoder.from_model(model)
    ctx = 128
    ref, mine = SessionState(np, model.cfg, ctx), SessionState(np, model.cfg, ctx)
    prefill = 9
    model.forward(ref, ids[:prefill])
    model.forward(mine, ids[:prefill])  # prefill stays on the engine path, as in real use
    worst = 0.0
    for tok in ids[prefill:]:
        want = model.forward(ref, [tok])
        got = twin_step(decoder, mine, tok)
        worst = max(worst, float(np.abs(got - want).max()))
        assert int(np.argmax(got)) == int(np.argmax(want))
    assert worst < TOL, worst
    assert mine.n == ref.n == len(ids)


def test_kernel_decode_declines_what_it_does_not_cover():
    """Streamed experts stay on the engine's own path; the FP8/FP4 simulation no longer does
    (ds4/kernels/quant.cu runs it inside the graph)."""
    from ds4.model import gpu_weights

    model = open_model(FIXTURES / "v4_csa_hca")
    assert gpu_weights.supported(model) is None
    model.quantize = True
    assert gpu_weights.supported(model) is None
    model.weights.experts[0].resident = False
    assert "resident" in gpu_weights.supported(model)
