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
from ds4.model import gpu_batch, gpu_decode, gpu_moe
from ds4.model.config import ModelConfig
from ds4.model.forward import Model
from ds4.model.state import SessionState
from ds4.model.weights import load_weights

FIXTURES = Path(__file__).parent / "fixtures"
TOL = 2e-4  # fp32 logits, same weights, different summation order


@pytest.fixture
def twins(monkeypatch):
    """Route every launcher the decoder calls to its NumPy twin (packed and quant too)."""
    return decoder_twins(monkeypatch)


def decoder_twins(monkeypatch, more: tuple = ()):
    """What the `twins` fixture does (the modules in `more` routed too); returns gpu_decode."""
    for mod in (attention, compressor, hyper_connection, indexer, moe, sampling, packed, quant,
                *more):
        for name in dir(mod):
            if name.endswith("_numpy") and hasattr(mod, name[:-6]):
                monkeypatch.setattr(mod, name[:-6], getattr(mod, name))
    monkeypatch.setattr(gpu_batch, "gemv", gemv.gemv_numpy)
    monkeypatch.setattr(gpu_batch, "gemv_many", gemv.gemv_many_numpy)
    monkeypatch.setattr(gpu_batch, "row_kernels", None)  # the seam's per-row fallback
    monkeypatch.setattr(gpu_decode, "rms_norm", norm.rms_norm_numpy)
    monkeypatch.setattr(gpu_decode, "rms_norm_rope", norm.rms_norm_rope_numpy)
    monkeypatch.setattr(gpu_decode, "rope_tail", rope.rope_tail_numpy)
    return gpu_decode


def open_model(model_dir: Path) -> Model:
    backend = get_backend("numpy")
    cfg = ModelConfig.from_dir(model_dir)
    return Model(cfg, load_weights(model_dir, cfg, backend.xp), backend, quantize=False)


def twin_step(decoder, state, token: int) -> np.ndarray:
    return decoder.decode(state, token)


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


def test_twin_batch_equals_single_steps(twins):
    """B = 1..5 sessions at different positions (CSA, HCA and sliding layers; windows close
    inside the batch) stepped together equal their single steps bitwise, through the member
    table and the strided batch launchers' twins; 3 and 5 run with idle members, the B=4 and
    B=8 sizes each across several member sets."""
    model = open_model(model_dir("tiny"))
    decoder = gpu_decode.KernelDecoder.from_model(model)
    rng = np.random.default_rng(7)
    lengths = [9, 14, 22, 31, 5]
    ids = [[0] + rng.integers(2, 50000, n + 8).tolist() for n in lengths]
    alone, together = ([SessionState(np, model.cfg, 128) for _ in lengths] for _ in range(2))
    for group in (alone, together):
        for s, seq, n in zip(group, ids, lengths):
            model.forward(s, seq[:n])
    for step in range(6):
        batch = [1, 2, 3, 4, 5, 3][step]  # a new member set each step
        members = list(range(step % 2, step % 2 + batch)) if batch < 5 else list(range(5))
        toks = [ids[m][together[m].n] for m in members]
        want = [decoder.decode(alone[m], t) for m, t in zip(members, toks)]
        got = decoder.decode_batch([together[m] for m in members], toks)
        for a, b in zip(want, got):
            assert np.array_equal(a, b)
    for a, b in zip(alone, together):
        assert a.n == b.n
        for la, lb in zip(a.layers, b.layers):
            assert np.array_equal(la.raw, lb.raw)
            for name, cs in la.compressors().items():
                assert np.array_equal(cs.rows, lb.compressors()[name].rows)


class _DeviceLike:
    """Stands in for a CuPy array: what MemberTable reads of one (size, address)."""

    def __init__(self, address: int, size: int = 1):
        self.size, self.data = size, type("Memory", (), {"ptr": address})()


def test_member_table_layout():
    """The member table holds positions and tokens as int32 in its first B words, then the
    address of slot s of layer l for member b at word B + (l * SLOTS + s) * B + b (what the
    kernels read as group[k * B + b]); absent arrays (sliding layers, HCA overlap) are 0; the
    last word holds the live member count (int32)."""
    from ds4.model.gpu_batch import GROUP, INDEXER, SLOTS, MemberTable

    cfg = ModelConfig.from_dir(model_dir("tiny"))
    states = [SessionState(np, cfg, 64) for _ in range(3)]
    for b, s in enumerate(states):
        s.n = 10 + b
        for i, ls in enumerate(s.layers):
            ls.raw = _DeviceLike(1000 * b + 10 * i)
            for j, cs in enumerate((ls.compressor, ls.indexer)):
                for k, name in enumerate(GROUP):
                    if cs is not None:
                        setattr(cs, name, _DeviceLike(1000 * b + 10 * i + 1 + 5 * j + k))
    table = MemberTable(np, cfg.num_hidden_layers, 4)
    table.fill(states + [states[0]], [7, 8, 9, 7])
    assert table.pos.tolist() == [10, 11, 12, 10] and table.tokens.tolist() == [7, 8, 9, 7]
    assert table.live.tolist() == [4]  # every member live unless told
    for b in range(4):
        for i, kind in enumerate(cfg.layer_types):
            for slot in range(SLOTS):
                got = int(table.host[4 + (i * SLOTS + slot) * 4 + b])
                cs = states[b % 3].layers[i].compressor if slot < INDEXER else \
                    states[b % 3].layers[i].indexer
                present = slot == 0 or (cs is not None and (
                    "overlap" not in GROUP[(slot - 1) % len(GROUP)] or cs.overlap))
                assert got == (1000 * (b % 3) + 10 * i + slot if present else 0), (b, i, slot)
    table.fill(states + [states[0]], [7, 8, 9, 7], live=3)  # the last word: live members
    assert table.live.tolist() == [3] and int(table.host[-1]) == 3
    assert table.host.size == 4 + cfg.num_hidden_layers * SLOTS * 4 + 1


@pytest.fixture
def row_twins(twins, monkeypatch):
    """The twins, with the shared matrices and experts through ds4/kernels/rows(_moe).py's twins."""
    from ds4.kernels import rows, rows_moe, rows_moe_twin

    for module, name in ((rows, "matvec"), (rows, "matvec_many")):
        monkeypatch.setattr(module, name, getattr(module, name + "_numpy"))
    monkeypatch.setattr(rows_moe, "moe", rows_moe_twin.moe_numpy)
    monkeypatch.setattr(gpu_batch, "row_kernels", rows)
    return twins


def test_twin_decode_through_row_kernels(row_twins):
    """With rows.py's matvec / matvec_many / moe (their twins) the decode equals the engine's
    forward within the hi + lo bf16 split of x (5e-4; measured 2.3e-4), and a batch of 3 its
    single steps (the twins' float64 sums may round differently by batch shape: within 1e-6 of
    the logits' scale)."""
    model = open_model(model_dir("tiny"))
    decoder = gpu_decode.KernelDecoder.from_model(model)
    assert decoder.moe_scratch is not None and all(decoder.row_moe)
    rng = np.random.default_rng(11)
    ids = [[0] + rng.integers(2, 50000, 20).tolist() for _ in range(3)]
    ref, alone, together = ([SessionState(np, model.cfg, 128) for _ in ids] for _ in range(3))
    for group in (ref, alone, together):
        for s, seq in zip(group, ids):
            model.forward(s, seq[:9 + 2 * len(group)])
    for _ in range(4):
        toks = [seq[s.n] for s, seq in zip(alone, ids)]
        want = [model.forward(s, [t]) for s, t in zip(ref, toks)]
        single = [decoder.decode(s, t) for s, t in zip(alone, toks)]
        batched = decoder.decode_batch(together, toks)
        for w, a, b in zip(want, single, batched):
            assert np.abs(a - w).max() < 5e-4 and int(np.argmax(a)) == int(np.argmax(w))
            assert np.abs(b - a).max() <= 1e-6 * np.abs(a).max()


def test_twin_batch_over_placed_experts_reads_live_members_and_counts_their_picks(
        row_twins, tmp_path, monkeypatch):
    """Half the experts placed in 'host' memory (RAM on NumPy) and read through rows_moe's twin:
    a batch of 3 (the B=4 graph with an idle member) gives its single steps' logits (within the
    twins' batch-shape rounding, as above) and exactly their placement counts, so the idle
    member's picks count nowhere."""
    from test_dummy import half_budget_gib, small_packed, write_config

    from ds4.engine import Engine

    # rows_moe's placed read (the decoder's default is per member: ds4/model/gpu_moe.py; its
    # per-member kernels have no NumPy twin, so the GPU tests cover that path)
    monkeypatch.setattr(gpu_moe, "ROWS_READ_PLACED", True)
    path = write_config(tmp_path / "m", small_packed())
    model = Engine.open(path, backend="numpy", load_format="dummy", seed=5,
                        gpu_memory_gib=half_budget_gib(small_packed())).model
    decoder = gpu_decode.KernelDecoder.from_model(model)
    assert all(getattr(t["experts.gate_up"], "placed", False) for t in decoder.layers)
    assert all(decoder.row_moe)
    placement, k, layers = model.weights.placement, model.cfg.num_experts_per_tok, 6
    rng = np.random.default_rng(12)
    ids = [[0] + rng.integers(2, 512, 12).tolist() for _ in range(3)]
    alone, together = ([SessionState(np, model.cfg, 64) for _ in ids] for _ in range(2))
    for group in (alone, together):
        for s, seq in zip(group, ids):
            model.forward(s, seq[:5])
    for _ in range(3):
        toks = [seq[s.n] for s, seq in zip(alone, ids)]
        placement.observe()
        single = [decoder.decode(s, t) for s, t in zip(alone, toks)]
        counted = placement.pending()
        placement.observe()
        batched = decoder.decode_batch(together, toks)
        assert np.array_equal(placement.pending(), counted)
        assert counted.sum() == 3 * k * layers
        for a, b in zip(single, batched):
            assert np.abs(b - a).max() <= 1e-6 * np.abs(a).max()
