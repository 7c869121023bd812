"""The CuPy backend against the NumPy one on the parity fixtures (needs CuPy and a GPU).

Three paths are compared token by token with the NumPy forward: the model code run eagerly on
CuPy arrays, and the kernel decode step (ds4/model/gpu_decode.py) replayed from CUDA graphs.
Tolerance: 2e-4 absolute on fp32 logits (weights identical, only summation order differs), and
the same argmax at every step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ds4.backend import cuda_available, get_backend

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]

FIXTURES = Path(__file__).parent / "fixtures"
CASES = ["v4_csa_hca", "v4_hca8", "tiny"]
TOL = 2e-4
# bf16-word matrices (the tiny model's) go through ds4/kernels/rows.py, which splits x into hi + lo
# bf16 (~1e-5 of |W| |x| per product): its twins put the tiny logits 2.3e-4 from the engine
ROWS_TOL = 5e-4


def model_dir(case: str) -> Path:
    if case == "tiny":
        from ds4.engine import default_model_dir

        return Path(default_model_dir())
    return FIXTURES / case


def open_model(case: str, backend: str):
    from ds4.model.config import ModelConfig
    from ds4.model.forward import Model
    from ds4.model.weights import load_weights

    b = get_backend(backend)
    cfg = ModelConfig.from_dir(model_dir(case))
    return Model(cfg, load_weights(model_dir(case), cfg, b.xp), b, quantize=False)


def prompt(cfg, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [0] + rng.integers(2, min(cfg.vocab_size, 50000), n - 1).tolist()


def numpy_run(model, ids, prefill: int, ctx: int) -> list[np.ndarray]:
    from ds4.model.state import SessionState

    state = SessionState(np, model.cfg, ctx)
    out = [np.asarray(model.forward(state, ids[:prefill]))]
    out += [np.asarray(model.forward(state, [t])) for t in ids[prefill:]]
    return out


@pytest.mark.parametrize("case", CASES)
def test_cupy_eager_and_graph_decode_match_numpy(case):
    import cupy

    from ds4.model.gpu_decode import KernelDecoder
    from ds4.model.state import SessionState

    ref_model, gpu_model = open_model(case, "numpy"), open_model(case, "cupy")
    assert gpu_model.kernel_decoder is not None  # the engine's hook is on for these models
    gpu_model.kernel_decoder = None  # first the model code itself on CuPy arrays
    ids, prefill, ctx = prompt(ref_model.cfg, 70, 1), 23, 256
    want = numpy_run(ref_model, ids, prefill, ctx)
    eager = SessionState(cupy, gpu_model.cfg, ctx)
    got = [cupy.asnumpy(gpu_model.forward(eager, ids[:prefill]))]
    got += [cupy.asnumpy(gpu_model.forward(eager, [t])) for t in ids[prefill:]]
    decoder = KernelDecoder.from_model(gpu_model)
    graphed = SessionState(cupy, gpu_model.cfg, ctx)
    kern = [cupy.asnumpy(gpu_model.forward(graphed, ids[:prefill]))]
    kern += [cupy.asnumpy(decoder.decode(graphed, t)) for t in ids[prefill:]]
    assert 1 in decoder.graphs  # later steps were replays of the batch-of-one graph
    for name, run in (("eager", got), ("graph", kern)):
        for step, (a, b) in enumerate(zip(run, want)):
            err = float(np.abs(a - b).max())
            tol = ROWS_TOL if name == "graph" and case == "tiny" else TOL
            assert err < tol, f"{name} step {step}: max |dlogit| {err}"
            assert int(np.argmax(a)) == int(np.argmax(b)), f"{name} step {step}"


def test_two_sessions_share_the_decoder():
    """Interleaved graph decodes of two sessions equal each one's isolated NumPy run."""
    import cupy

    from ds4.model.gpu_decode import KernelDecoder
    from ds4.model.state import SessionState

    ref_model, gpu_model = open_model("v4_csa_hca", "numpy"), open_model("v4_csa_hca", "cupy")
    decoder = KernelDecoder.from_model(gpu_model)
    runs = [(prompt(ref_model.cfg, 60, 2), 17), (prompt(ref_model.cfg, 45, 3), 5)]
    wants = [numpy_run(ref_model, ids, p, 128) for ids, p in runs]
    states = [SessionState(cupy, gpu_model.cfg, 128) for _ in runs]
    gots = [[cupy.asnumpy(gpu_model.forward(s, ids[:p]))] for s, (ids, p) in zip(states, runs)]
    for step in range(max(len(ids) - p for ids, p in runs)):
        for k, (ids, p) in enumerate(runs):
            if p + step < len(ids):
                gots[k].append(cupy.asnumpy(decoder.decode(states[k], ids[p + step])))
    for got, want in zip(gots, wants):
        assert len(got) == len(want)
        assert max(float(np.abs(a - b).max()) for a, b in zip(got, want)) < TOL


def greedy(session, prompt_ids: list[int], n: int) -> list[int]:
    logits = session.sync(prompt_ids)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = session.decode(out[-1])
    return out


def test_engine_two_sessions_smoke_cupy():
    """two_sessions_smoke on backend="cupy": interleaved greedy streams equal isolated NumPy
    runs token by token; decode steps ran as graph replays; snapshot/restore resumes exactly."""
    from ds4.engine import Engine

    path = model_dir("tiny")
    cpu, gpu = Engine.open(path, backend="numpy"), Engine.open(path, backend="cupy")
    prompts = [prompt(cpu.config, 37, 7), prompt(cpu.config, 90, 8), prompt(cpu.config, 5, 9)]
    want = [greedy(cpu.new_session(512), p, 12) for p in prompts]
    sessions = [gpu.new_session(512) for _ in prompts]
    logits = [s.sync(p) for s, p in zip(sessions, prompts)]
    got = [[] for _ in prompts]
    for _ in range(12):
        for k, s in enumerate(sessions):
            got[k].append(int(np.argmax(logits[k])))
            logits[k] = s.decode(got[k][-1])
    assert got == want
    decoder = gpu.model.kernel_decoder.decoder
    assert list(decoder.graphs) == [1]  # one graph served all three sessions
    blob = sessions[1].snapshot()
    resumed = gpu.new_session(512).restore(blob)
    a, b = sessions[1].decode(got[1][-1]), resumed.decode(got[1][-1])
    assert np.abs(a - b).max() < 1e-5


def test_decoder_reads_the_engine_weights_in_place():
    """Building the kernel decoder adds no second copy of any weight: its matrices and expert
    stacks are the engine's own bf16 arrays, and the memory pool grows by its buffers only."""
    import cupy

    from ds4.engine import Engine
    from ds4.model.gpu_decode import KernelDecoder
    from ds4.model.gpu_weights import LAYER_MATRICES

    eng = Engine.open(model_dir("tiny"), backend="cupy")
    banks = eng.model.weights.experts
    expert_bytes = sum(bank.nbytes for bank in banks)
    assert all(bank.stacked[0].dtype == cupy.uint16 for bank in banks)  # tiny is bf16-exact
    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()
    decoder = KernelDecoder.from_model(eng.model)
    grown = pool.used_bytes() - before
    for i, (t, bank) in enumerate(zip(decoder.layers, banks)):
        assert t["experts.gate_up"].data.ptr == bank.stacked[0].data.ptr
        assert t["experts.down"].data.ptr == bank.stacked[1].data.ptr
        for name in LAYER_MATRICES:
            held = eng.model.weights.layer(i)[name]
            assert held.dtype == cupy.uint16 and t[name].data.ptr == held.data.ptr, name
    assert decoder.top["head"].data.ptr == eng.model.weights["lm_head.weight"].data.ptr
    rounded = lambda a: -(-a.nbytes // 512) * 512  # noqa: E731  (the pool's allocation unit)
    own = [a for t in decoder.layers for k, a in t.items() if not k.startswith("experts.")]
    own += list(decoder.top.values()) + list(decoder.buf.values())
    engine_ptrs = {a.data.ptr for a in eng.model.weights.tensors.values()}
    own = {a.data.ptr: a for a in own if a.data.ptr not in engine_ptrs}.values()
    # + gemv tables (one set per member row of a batch graph) and the member tables
    own_bytes = sum(rounded(a) for a in own) + (256 << 10)
    assert grown < own_bytes + expert_bytes // 2, (grown, own_bytes, expert_bytes)
    assert eng.memory_report()["weight_bytes"] >= expert_bytes
