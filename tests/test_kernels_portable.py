"""The kernels on GPUs before Hopper (ds4/kernels/__init__.py's DS4_CUDA_ARCH): built as sm_80
PTX and run on this GPU, the row and packed products take their pre-Hopper paths (a fused
multiply-add of -0 for mul.bf16x2, bit moves and an f16 multiply for the e4m3x2 conversion, no
programmatic launch) and must give the very bits of the native build; a smaller GPU's shared
memory turns the staged x, the grouped tiles and the fused chunk attention down or off. The
whole gpu suite also runs under DS4_CUDA_ARCH=80 DS4_SHARED_KB=99 (docs/TESTING.md)."""

from __future__ import annotations

import numpy as np
import pytest
from test_kernels_rows import device_case, fp8_matrix, gpu_test

import ds4.kernels as K
from ds4.backend import cuda_available
from ds4.kernels import chunk_attention as CA
from ds4.kernels import grouped as G
from ds4.kernels import packed as P
from ds4.kernels import rows as R


def rebuild(monkeypatch, arch: str) -> None:
    """Build the families for `arch` ("" = the device's own) from the next launch on."""
    monkeypatch.setattr(K, "FORCED_ARCH", arch)
    K._module.cache_clear()
    K._pdl_device.cache_clear()


@pytest.fixture
def native_after(monkeypatch):
    """The device's own builds again after the test (the module cache is process-wide)."""
    yield
    rebuild(monkeypatch, "")


def limits(monkeypatch, kb: int) -> None:
    """This GPU seen as one whose blocks take at most kb KB of shared memory."""
    monkeypatch.setattr(K, "shared_limits", lambda: (kb * 1024, kb * 1024))
    for module in (R, CA, G):
        monkeypatch.setattr(module, "shared_limits", K.shared_limits)


@gpu_test
@pytest.mark.parametrize("name", ["q_b", "o_a", "shared_down", "ragged_fp8", "expert_w1",
                                  "odd_fp4", "router"])
def test_row_products_built_for_sm80_keep_every_bit(name, monkeypatch, native_after):
    import cupy as cp

    _, w, x, group = device_case(cp, name, seed=3)
    xd, rows = cp.asarray(x), w.shape[0]
    out = {}
    for arch in ("", "80"):
        rebuild(monkeypatch, arch)
        for batch in (1, 5):
            y = cp.zeros((batch, rows), cp.float32)
            R.matvec(w, xd[:batch], y, batch, rows_per_group=group)
            out[arch, batch] = y.get()
    for batch in (1, 5):
        assert np.array_equal(out["", batch], out["80", batch]), (name, batch)


@gpu_test
def test_packed_fp8_gemv_built_for_sm80_keeps_every_bit(monkeypatch, native_after):
    import cupy as cp

    rng = np.random.default_rng(4)
    w = fp8_matrix(rng, (256, 1024))
    x = cp.asarray(rng.standard_normal(1024, dtype=np.float32))
    codes, scale = cp.asarray(w.codes), cp.asarray(w.scale)
    out = {}
    for arch in ("", "80"):
        rebuild(monkeypatch, arch)
        y = cp.zeros(256, cp.float32)
        P.gemv_fp8(codes, scale, 128, x, y)
        out[arch] = y.get()
    assert np.array_equal(out[""], out["80"])


def test_a_smaller_gpus_shared_memory_turns_the_big_blocks_down(monkeypatch):
    """On a host without a device the plans take a Hopper's limits; an A100's 163 KB and an
    RTX 40xx's 99 KB shrink the staged x, the grouped tiles and the fused attention."""
    hopper = (R.stage_limit("fp8h", (1, 4)), R.stage_limit("fp8h", (1, 8)),
              G.most_mt("fp4"), CA.kernel_fits(512))
    assert hopper == (96 * 1024, 200 * 1024, 4, True)
    limits(monkeypatch, 163)
    a100 = (R.stage_limit("fp8h", (1, 4)), R.stage_limit("fp8h", (1, 8)), G.most_mt("fp4"),
            CA.kernel_fits(512), CA.kernel_fits(512, parts=1), CA.kernel_fits(128))
    assert a100[0] < 96 * 1024 and a100[1] < 163 * 1024
    assert a100[2:] == (2, False, True, True)
    limits(monkeypatch, 99)
    assert G.most_mt("fp4") == 0 and G.most_mt("fp8") == 0 and not CA.kernel_fits(512, 1)
    assert R.stage_limit("fp8h", (1, 8)) < 99 * 1024 and CA.kernel_fits(128)


@pytest.mark.skipif(cuda_available(), reason="this machine has a GPU")
def test_without_a_device_the_limits_are_a_hoppers():
    assert K.shared_limits() == (227 * 1024, 227 * 1024)  # the old constant's


def fake_cupy(monkeypatch, capability: str) -> None:
    """A CuPy whose one device has this compute capability (no GPU needed)."""
    import sys
    import types

    device = types.SimpleNamespace(compute_capability=capability)
    cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, getDevice=lambda: 0),
        Device=lambda *a: device)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    forget_capability()


def forget_capability() -> None:
    """Drop the cached compute capabilities (a fake CuPy's, or the real one's after it)."""
    K._capability.cache_clear()
    K._pdl_device.cache_clear()


@pytest.fixture
def real_capability_after():
    """The real device's compute capability read afresh after a test that faked it."""
    yield
    forget_capability()


@pytest.mark.parametrize("capability,gpu,pdl", [("75", False, False), ("80", True, False),
                                                ("89", True, False), ("90", True, True)])
def test_the_gpu_backend_takes_compute_capability_8_and_pdl_9(monkeypatch, capability, gpu, pdl,
                                                                real_capability_after):
    """A T4 (7.5) is left to NumPy, and `--backend cupy` says why; PDL only from Hopper on, and
    not for code built as for an older GPU (DS4_CUDA_ARCH)."""
    from ds4 import backend

    fake_cupy(monkeypatch, capability)
    assert backend.cuda_available() is gpu
    assert (backend.get_backend("auto").name == "cupy") is gpu
    if not gpu:
        with pytest.raises(RuntimeError, match="compute capability 8.0 or newer"):
            backend.get_backend("cupy")
    assert K._pdl_device(0) is pdl
    monkeypatch.setattr(K, "FORCED_ARCH", "80")
    K._pdl_device.cache_clear()
    assert K._pdl_device(0) is False and not K.builds_here("grouped_wg")


@pytest.mark.parametrize("capability,said", [
    ("75", "on NumPy: the GPU's compute capability 7.5 is older than the kernels' 8.0"),
    ("90", "on NumPy")])
def test_the_start_line_says_why_an_old_gpu_is_passed_over(monkeypatch, capability, said,
                                                           real_capability_after):
    """ds4-server's "model loaded" line ends with where the model runs (backend.describe)."""
    from ds4 import backend

    fake_cupy(monkeypatch, capability)
    assert backend.describe(backend.Backend("numpy", np)) == said
