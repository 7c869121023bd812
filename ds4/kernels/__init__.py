"""RawKernel CUDA sources for the hot decode ops, their launchers and NumPy twins.

Each family module (gemv, norm, rope, hyper_connection, attention, compressor, indexer, moe,
sampling) exposes `op(...)`, which launches the CUDA kernel on CuPy arrays, and `op_numpy(...)`
with the same signature, the NumPy twin the GPU tests compare against. Launchers allocate
nothing: outputs are passed in, so a decode step made of them can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import os
import time
import zlib
from pathlib import Path

import numpy as np

from ds4.backend import KERNEL_DIR, load_module
from ds4.kernels import pdl, timeline

NULL = np.uint64(0)  # a null device pointer as a kernel argument


def compile_options(kernel_dir: Path = KERNEL_DIR) -> tuple[str, ...]:
    """NVRTC options of every family: C++17, the kernel directory on the include path, and the
    headers' checksum as a define, since CuPy's compile cache keys on source and options only
    and would otherwise keep a module built against an older header. (kernel_dir: another
    copy of the sources, as tools/bench_sources.py builds its base from.)"""
    headers = sorted(kernel_dir.glob("*.cuh"))  # common.cuh (every family) and shared cores
    digest = zlib.crc32(b"".join(p.read_bytes() for p in headers))
    stamps = ("-DDS4_TIMELINE",) if timeline.enabled() else ()  # (timeline.py)
    return ("--std=c++17", f"-I{kernel_dir}", f"-DDS4_HEADERS={digest}", *stamps)


# Families built for one architecture's own instructions (sm_90a: Hopper's wgmma), which run on
# that compute capability alone; their launchers check `builds_here` before using them.
ARCH = {"grouped_wg": ("sm_90a", "90")}


# DS4_CUDA_ARCH=80 (say) builds every family's code paths for that compute capability
# (common.cuh's DS4_ARCH) on the device at hand, and launches as there: how the pre-Hopper paths
# (no PDL, no wgmma, no cvt from e4m3x2, no mul.bf16x2) run on a Hopper in the gpu tests.
# DS4_SHARED_KB likewise caps the shared memory a block may ask for, as a smaller GPU's (99 KB
# on an RTX 30xx / 40xx).
FORCED_ARCH = os.environ.get("DS4_CUDA_ARCH", "")


def builds_here(family: str) -> bool:
    """True when the current CUDA device runs what `family` is built for (every family but the
    ones in ARCH; those only on their own compute capability)."""
    if family not in ARCH:
        return True
    return build_capability() == ARCH[family][1]


def build_capability(device: int | None = None) -> str:
    """The compute capability the families are built for, as CuPy spells it ("90": 9.0): the
    device's (default: the current one), or DS4_CUDA_ARCH's."""
    if FORCED_ARCH:
        return FORCED_ARCH
    import cupy

    return _capability(cupy.cuda.runtime.getDevice() if device is None else device)


@functools.cache
def _capability(device: int) -> str:
    """Compute capability of a CUDA device as CuPy spells it ("90": 9.0)."""
    import cupy

    return cupy.cuda.Device(device).compute_capability


def family_options(family: str, kernel_dir: Path = KERNEL_DIR) -> tuple[str, ...]:
    """compile_options plus the family's architecture (ARCH, or DS4_CUDA_ARCH's paths)."""
    arch = ((f"-arch={ARCH[family][0]}",) if family in ARCH
            else (f"-DDS4_ARCH={FORCED_ARCH}0",) if FORCED_ARCH else ())
    return compile_options(kernel_dir) + arch


@functools.cache
def _module(family: str):
    module = load_module(family, options=family_options(family))
    if timeline.enabled():
        timeline.attach(module)
    return module


def kernel(family: str, name: str):
    """The compiled cupy.RawKernel `name` from ds4/kernels/<family>.cu (compiled once)."""
    return _module(family).get_function(name)


def compile_ahead(workers: int = 8, use_device=None):
    """Start compiling every kernel family in background threads and return join(timeout),
    which waits for them (at most timeout seconds in all) and names the families that failed
    or are still building (their first launch raises or builds, as it would without this).
    NVRTC releases the GIL, so the families build side by side, and the engine can load
    weights meanwhile: no request pays for a compile later, and CuPy's disk cache turns the
    next start's compile into a load. use_device() runs first in each thread (default: the
    caller's CUDA device)."""
    from concurrent.futures import ThreadPoolExecutor

    if use_device is None:
        import cupy

        device = cupy.cuda.runtime.getDevice()
        use_device = cupy.cuda.Device(device).use

    def build(family: str) -> None:
        use_device()
        _module(family).compile()

    families = sorted(p.stem for p in KERNEL_DIR.glob("*.cu") if builds_here(p.stem))
    pool = ThreadPoolExecutor(max_workers=max(1, min(workers, len(families))),
                              thread_name_prefix="ds4-nvrtc")
    futures = {family: pool.submit(build, family) for family in families}
    pool.shutdown(wait=False)

    def join(timeout: float = 900.0) -> list[str]:
        deadline, failed = time.monotonic() + timeout, []
        for family, done in futures.items():
            try:
                if done.exception(timeout=max(0.0, deadline - time.monotonic())) is not None:
                    failed.append(family)
            except TimeoutError:  # still building: its first launch waits for it instead
                failed.append(family)
        return failed

    return join


@functools.cache
def device_limits() -> tuple[int, int, int]:
    """(SMs, registers per SM, threads per SM) of the current device (cudaDeviceAttr codes 16,
    82 and 39)."""
    import cupy

    runtime, device = cupy.cuda.runtime, cupy.cuda.runtime.getDevice()
    return tuple(runtime.deviceGetAttribute(code, device) for code in (16, 82, 39))


@functools.cache
def shared_limits() -> tuple[int, int]:
    """(bytes of shared memory one block may ask for, bytes an SM gives its blocks) on the
    current device (cudaDeviceAttr codes 97 and 81, less the 1 KB the SM keeps: 227 KB each on a
    Hopper, 163 on an A100, 99 on an RTX 30xx / 40xx), capped by DS4_SHARED_KB."""
    try:
        import cupy

        runtime, device = cupy.cuda.runtime, cupy.cuda.runtime.getDevice()
        block, sm = (runtime.deviceGetAttribute(code, device) for code in (97, 81))
    except Exception:  # no device: host-side plans (the CPU tests') take a Hopper's
        block, sm = 227 * 1024, 228 * 1024
    cap = int(os.environ.get("DS4_SHARED_KB", "0")) * 1024 or block
    return min(block, cap), min(sm - 1024, cap)


def resident_blocks(k, threads: int, shared: int = 0) -> int:
    """Blocks of compiled kernel k (threads each, `shared` bytes of dynamic shared memory) that
    the GPU holds at once, by registers, threads and shared memory per SM: the size of a
    persistent grid, or the most blocks of a launch whose blocks wait on one another."""
    sms, regs_per_sm, threads_per_sm = device_limits()
    regs = -(-max(k.num_regs, 1) // 8) * 8  # allocated per warp in units of 256
    by_shared = shared_limits()[1] // (shared + k.shared_size_bytes + 1024)
    return sms * max(1, min(regs_per_sm // (regs * threads), by_shared, threads_per_sm // threads))


def ptr(a) -> np.uint64:
    """Device pointer of a CuPy array (or NULL for None), as a kernel argument."""
    return NULL if a is None else np.uint64(a.data.ptr)


def i32(v: int) -> np.int32:
    """A kernel's int argument."""
    return np.int32(v)


def f32(v: float) -> np.float32:
    """A kernel's float argument."""
    return np.float32(v)


# Families whose every kernel waits for its inputs as ds4/kernels/pdl.py requires (a CPU test
# checks the sources), so a graph capture launches them programmatically after the kernel before
# them; the prefill families (packed, grouped, chunk_attention) launch plainly.
PDL_FAMILIES = frozenset({"attention", "compressor", "hyper_connection", "hc_unit", "indexer",
                          "moe", "norm", "quant", "rope", "rows", "rows_moe", "sampling", "split",
                          "gemv", "mtp", "placed"})
PDL = os.environ.get("DS4_PDL", "1") != "0"  # DS4_PDL=0: plain launches in graphs too


@functools.cache
def _pdl_device(device: int) -> bool:
    """Programmatic dependent launch needs compute capability 9.0 (Hopper) or later, in the
    device and in the code (wait_inputs compiles to nothing before sm_90)."""
    return int(build_capability(device)) >= 90


def launch(family: str, name: str, grid, block, args, shared: int = 0) -> None:
    """Launch one kernel on the current stream; shared is dynamic shared memory in bytes (past
    48 KB with the kernel's static shared memory, the kernel must be allowed it first)."""
    k = kernel(family, name)
    past_default = shared and shared + k.shared_size_bytes > 48 * 1024
    if past_default and k.max_dynamic_shared_size_bytes < shared:
        k.max_dynamic_shared_size_bytes = shared
    if PDL and family in PDL_FAMILIES:
        import cupy

        stream = cupy.cuda.get_current_stream()
        if stream.is_capturing() and _pdl_device(cupy.cuda.runtime.getDevice()):
            if timeline.enabled():
                timeline.record(name, grid, block)
            pdl.launch_after(k.kernel, grid, block, args, shared, stream.ptr)
            return
    k(tuple(grid), tuple(block), tuple(args), shared_mem=shared)


def widen(w, xp=np):
    """Weights as float32: bf16 words (uint16) widened as the kernels do (exact); fp32 as is."""
    w = xp.asarray(w)
    if w.dtype == xp.uint16:
        return (w.astype(xp.uint32) << 16).view(xp.float32)
    return w.astype(xp.float32, copy=False)


def exact_bf16(w, xp=np):
    """bf16 words of w when every value is exactly a bf16 value (no rounding), else None."""
    bits = xp.ascontiguousarray(w, dtype=xp.float32).view(xp.uint32)
    if bool((bits & 0xFFFF).any()):
        return None
    return (bits >> 16).astype(xp.uint16)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 to bf16 words (round to nearest even), the weight format kernels read."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + 0x7FFF + ((u >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)
