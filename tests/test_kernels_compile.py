"""Every CUDA source in ds4/kernels/ compiles for sm_90 (H100/H200) with nvcc, so a kernel that
does not build never lands. Runs on CPU machines; skipped where nvcc is absent."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ds4.backend import KERNEL_DIR
from ds4.kernels import ARCH, PDL_FAMILIES

SOURCES = sorted(KERNEL_DIR.glob("*.cu"))
FAMILIES = {"norm", "rope", "attention", "compressor", "indexer", "moe", "sampling", "gemv",
            "hyper_connection", "packed"}


def test_every_family_has_a_source():
    assert FAMILIES <= {p.stem for p in SOURCES}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_kernel_compiles_for_sm90(source: Path, tmp_path: Path):
    cubin = tmp_path / (source.stem + ".cubin")
    proc = subprocess.run(
        ["nvcc", f"-arch={ARCH.get(source.stem, ('sm_90',))[0]}", "--cubin", "-std=c++17",
         "-I", str(KERNEL_DIR), "-Xptxas", "-warn-spills", "-o", str(cubin), str(source)],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert cubin.stat().st_size > 0
    # Local-memory spills make a decode kernel several times slower; treat them as a failure.
    assert "spill" not in proc.stderr.lower(), proc.stderr


# Every family but the sm_90a ones builds for the GPUs before Hopper too (the CuPy backend takes
# compute capability 8.0 and newer): sm_80 (A100; an RTX 30xx's sm_86 runs its code), where the
# programmatic-launch wait compiles to nothing, bf16x2 products take fma and E4M3 codes their bit
# moves; and sm_89 (RTX 40xx), with the e4m3x2 conversion but no mul.bf16x2, for the row
# kernels that use both.
PRE_HOPPER = [(p.stem, "sm_80") for p in SOURCES if p.stem not in ARCH] + [("rows", "sm_89")]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("family,arch", PRE_HOPPER, ids=lambda v: v)
def test_family_compiles_before_hopper(family: str, arch: str, tmp_path: Path):
    proc = subprocess.run(
        ["nvcc", f"-arch={arch}", "--cubin", "-std=c++17", "-I", str(KERNEL_DIR), "-o",
         str(tmp_path / f"{family}.cubin"), str(KERNEL_DIR / f"{family}.cu")],
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr


def test_shared_helpers_are_defined_once():
    """The helpers live in common.cuh, which every family includes, not in copies per file."""
    header = (KERNEL_DIR / "common.cuh").read_text()
    for source in SOURCES:
        text = source.read_text()
        assert '#include "common.cuh"' in text, source.name
        for helper in ("T warp_sum(", "float widen(", "struct Pack<float>", "#define INFINITY"):
            assert helper not in text, f"{source.name} defines {helper} again"
            assert helper in header
        # (nor a copy for another type: warp_sum and block_reduce take any)
        again = re.findall(r"__device__[^;{(]*\b(warp_sum|block_sum|block_reduce)\w*\(", text)
        assert not again, f"{source.name} defines {again} again"


def kernel_texts(source: Path) -> list[tuple[str, str]]:
    """(name, text up to the next kernel) of every extern "C" __global__ in a source."""
    text = source.read_text()
    starts = [m.start() for m in re.finditer(r'extern "C" __global__', text)] + [len(text)]
    out = []
    for a, b in zip(starts, starts[1:]):
        head = re.sub(r"__launch_bounds__\([^)]*\)|\\\n", "", text[a:b])
        out.append((re.search(r"void\s+([\w#]+)", head).group(1), text[a:b]))
    return out


@pytest.mark.parametrize("family", sorted(PDL_FAMILIES))
def test_every_programmatically_launched_kernel_waits_for_its_inputs(family):
    """launch() captures these families with programmatic dependent launch (ds4/kernels/pdl.py):
    a kernel among them that never runs wait_inputs() could read its inputs before the kernel
    that writes them is done. Each kernel waits itself or through matvec_group (rows_many's
    matvec_table calls it), which waits once its first weights are loading."""
    source = KERNEL_DIR / f"{family}.cu"
    kernels = kernel_texts(source)
    assert kernels
    for name, text in kernels:
        waits = any(w in text for w in ("wait_inputs();", "matvec_group<", "matvec_table<"))
        assert waits, f"{source.name}: {name}"
    if family == "rows":
        assert "wait_inputs();" in (KERNEL_DIR / "rows.cuh").read_text()


def test_compile_ahead_builds_every_family_side_by_side_and_names_failures(monkeypatch):
    """ds4.kernels.compile_ahead (Engine.open on the GPU): one compile per family, in parallel
    threads, each on the caller's device first; a family that fails is named, not raised."""
    import threading

    import ds4.kernels as K

    lock, state = threading.Lock(), {"now": 0, "most": 0, "built": [], "device": 0}
    started = threading.Barrier(2, timeout=10)

    class Module:
        def __init__(self, family):
            self.family = family

        def compile(self):
            with lock:
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
                state["built"].append(self.family)
            if self.family in ("attention", "norm"):
                started.wait()  # returns only when both run at the same time
            with lock:
                state["now"] -= 1
            if self.family == "rope":
                raise RuntimeError("NVRTC rejected the source")

    def use_device():
        with lock:
            state["device"] += 1

    monkeypatch.setattr(K, "_module", Module)
    monkeypatch.setattr(K, "builds_here", lambda family: True)
    failed = K.compile_ahead(workers=4, use_device=use_device)()
    assert failed == ["rope"]
    assert sorted(state["built"]) == sorted(p.stem for p in SOURCES)
    assert state["device"] == len(SOURCES) and state["most"] >= 2


@pytest.mark.parametrize("capability,built", [("90", True), ("80", False), ("100", False)])
def test_sm90a_families_build_on_compute_capability_9_0_only(monkeypatch, capability, built):
    """grouped_wg's wgmma runs on sm_90a code, which no other device runs: compile_ahead leaves
    it out elsewhere (and the launchers keep to grouped.cu's kernels there)."""
    import sys
    import types

    import ds4.kernels as K

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: 0)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(K, "_capability", lambda device: capability)
    built_families: list = []

    class Module:
        def __init__(self, family):
            built_families.append(family)

        def compile(self):
            pass

    monkeypatch.setattr(K, "_module", Module)
    assert K.compile_ahead(workers=2, use_device=lambda: None)() == []
    assert ("grouped_wg" in built_families) is built and "grouped" in built_families
    assert K.builds_here("grouped") and K.builds_here("grouped_wg") is built


def test_compile_ahead_join_gives_up_on_a_family_that_does_not_finish(monkeypatch):
    """join(timeout) names a family still building instead of holding Engine.open forever."""
    import threading

    import ds4.kernels as K

    release = threading.Event()

    class Module:
        def __init__(self, family):
            self.family = family

        def compile(self):
            if self.family == "norm":
                release.wait(10)

    monkeypatch.setattr(K, "_module", Module)
    monkeypatch.setattr(K, "builds_here", lambda family: True)
    join = K.compile_ahead(workers=4, use_device=lambda: None)
    try:
        assert join(timeout=0.5) == ["norm"]
    finally:
        release.set()
    assert join() == []


@pytest.mark.parametrize("batch,blocks,capacity", [(8, 33, 528), (8, 33, 232), (3, 9, 9),
                                                   (1, 65, 65), (8, 65, 100)])
def test_hc_unit_launches_only_members_whose_blocks_are_all_resident(batch, blocks, capacity):
    """hc_unit's blocks of a member spin until all of them have met, so a launch may hold only
    as many members as the device keeps resident at once: every member once, in order, each
    launch within the capacity, and no more launches than that needs."""
    from ds4.kernels.hyper_connection import member_groups

    groups = member_groups(batch, blocks, capacity)
    assert [m for m0, m1 in groups for m in range(m0, m1)] == list(range(batch))
    assert all((m1 - m0) * blocks <= capacity for m0, m1 in groups)
    assert len(groups) == -(-batch // (capacity // blocks))
    with pytest.raises(AssertionError):
        member_groups(batch, capacity + 1, capacity)


def test_persistent_grids_and_hc_unit_size_themselves_by_the_devices_limits(monkeypatch):
    """Every launcher that needs its blocks resident at once asks one helper, which divides
    an SM's registers, threads and shared memory among the kernel's blocks (the H200's limits
    here, kernels faked: no GPU needed)."""
    from types import SimpleNamespace

    from ds4 import kernels
    from ds4.kernels import hyper_connection, packed, placed, rows_moe

    monkeypatch.setattr(kernels, "device_limits", lambda: (132, 65536, 2048))
    fake = SimpleNamespace(num_regs=64, shared_size_bytes=2740)
    heavy = SimpleNamespace(num_regs=125, shared_size_bytes=8192)
    monkeypatch.setattr(hyper_connection, "kernel", lambda family, name: fake)
    monkeypatch.setattr(rows_moe, "kernel", lambda family, name: heavy)
    monkeypatch.setattr(packed, "kernel", lambda family, name: fake)
    monkeypatch.setattr(placed, "_kernel", lambda name: heavy)
    cached = (hyper_connection.unit_capacity, rows_moe.resident_blocks, packed.resident_blocks,
              placed._resident_blocks)
    for f in cached:
        f.cache_clear()
    try:
        assert hyper_connection.unit_capacity() == 4 * 132  # registers: 65536 / (64 * 256)
        assert rows_moe.resident_blocks("k") == 2 * 132  # 128 registers a thread
        assert packed.resident_blocks("k", 0) == 4 * 132
        assert packed.resident_blocks("k", 100 * 1024) == 2 * 132  # shared memory binds
        assert placed._resident_blocks("k", 0) == 2 * 132
    finally:
        for f in cached:
            f.cache_clear()
