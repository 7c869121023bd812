"""Expert parallel on the GPU: the kernels' side (moe_localize, rows_moe skipping the picks
another rank holds) against their twins, and the engine through a real NCCL communicator:
one rank on one GPU (`gpus=1`: every broadcast and all-reduce runs, inside the decode graph
too) gives the one-GPU engine's tokens and logits, on the tiny model and on the tiny model as
a packed FP8 + FP4 checkpoint; two ranks where two GPUs exist."""

from __future__ import annotations

import os

import numpy as np
import pytest
from test_batch_engine import packed_tiny
from test_expert_group import greedy
from test_kernels_rows_moe import picks, small_moe

from ds4.backend import cuda_available
from ds4.kernels import moe as M
from ds4.kernels import rows_moe as RM
from ds4.kernels import rows_moe_twin as RMT
from ds4.model.expert_group import local_maps, owner_table
from ds4.model.packed import FP4, FP8, on_device

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")]
TOL = 1e-5


def device_count() -> int:
    import cupy as cp

    return cp.cuda.runtime.getDeviceCount()


def test_localize_equals_its_twin():
    import cupy as cp

    maps = local_maps(owner_table(1, 256, 3), 1)[0]
    idx = np.random.default_rng(1).integers(0, 256, (8, 6)).astype(np.int32)
    out = cp.zeros((8, 6), cp.int32)
    M.moe_localize(cp.asarray(maps), cp.asarray(idx), out)
    want = np.zeros((8, 6), np.int32)
    assert np.array_equal(out.get(), M.moe_localize_numpy(maps, idx, want))


@pytest.mark.parametrize("fmt,shared_fmt", [(FP4, FP8), ("bf16", "bf16")])
def test_the_ranks_parts_sum_to_the_whole_moe(fmt, shared_fmt):
    """Each rank's rows_moe over its local picks (-1: elsewhere) equals its twin, and the
    parts (the shared expert on rank 0 only) sum to one MoE over every expert."""
    import cupy as cp

    rng = np.random.default_rng(5)
    experts, inter, hidden, batch, k = 8, 128, 256, 5, 3
    gu, down, shared = small_moe(rng, fmt, experts, inter, hidden, shared_fmt)
    idx, wts = picks(rng, batch, k, experts)
    x = rng.standard_normal((batch, hidden), dtype=np.float32)
    dev = [on_device(cp, m) if hasattr(m, "codes") else cp.asarray(m) for m in
           (gu, down, *shared)]
    owners = owner_table(1, experts, 2)
    whole, total = cp.zeros((batch, hidden), cp.float32), cp.zeros((batch, hidden), cp.float32)
    run = RM.moe_scratch(cp, batch, k, inter, hidden, inter)
    RM.moe(dev[0], dev[1], cp.asarray(idx), cp.asarray(wts), cp.asarray(x), run, whole, batch,
           inter, 7.0, tuple(dev[2:]))
    for rank in (0, 1):
        mine = np.nonzero(owners[0] == rank)[0]
        local = local_maps(owners, rank)[0][idx]
        part = cp.zeros((batch, hidden), cp.float32)
        sh = tuple(dev[2:]) if rank == 0 else None
        RM.moe(dev[0][cp.asarray(mine)],
               dev[1][cp.asarray(mine)], cp.asarray(local), cp.asarray(wts), cp.asarray(x),
               run, part, batch, inter, 7.0, sh)
        want = np.zeros((batch, hidden), np.float32)
        RMT.moe_numpy(gu[mine], down[mine], local, wts, x, None, want, batch, inter, 7.0,
                     shared if rank == 0 else None)
        assert np.allclose(part.get(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        total += part
    scale = float(cp.abs(whole).max())
    assert float(cp.abs(total - whole).max()) <= 1e-5 * scale


@pytest.fixture(scope="module", params=["tiny", "tiny-packed"])
def model_dir(request, tmp_path_factory):
    from ds4.engine import default_model_dir

    if request.param == "tiny":
        return default_model_dir()
    return packed_tiny(tmp_path_factory.mktemp("official"))


def opened(model_dir, **kw):
    from ds4.engine import Engine

    return Engine.open(model_dir, backend="cupy", prefill_chunk=16, **kw)


@pytest.fixture(scope="module")
def reference(model_dir):
    e = opened(model_dir)
    yield greedy(e)
    e.close()


@pytest.mark.parametrize("gpus", [1, 2])
def test_nccl_group_gives_one_gpus_tokens(model_dir, reference, gpus):
    if gpus > device_count():
        pytest.skip(f"needs {gpus} GPUs")
    want, ref = reference
    e = opened(model_dir, gpus=gpus)
    try:
        got, logits = greedy(e)
        decoder = e.model.kernel_decoder.decoder
        assert decoder.shard is not None and decoder.graphs  # the graph ran the group's side
        assert got == want
        assert np.abs(logits - ref).max() <= TOL * np.abs(ref).max()
        assert e.memory_report()["gpus"] == gpus
        assert os.environ["NCCL_NVLS_ENABLE"] == "0"  # NVLink multicast off where NCCL runs
    finally:
        e.close()
