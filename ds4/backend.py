"""Array-module choice (NumPy or CuPy), device detection and kernel-source loading."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import cupy

    Array = np.ndarray | cupy.ndarray  # an array of either backend
else:
    Array = np.ndarray  # the name only annotates; CuPy need not be importable to run on NumPy

KERNEL_DIR = Path(__file__).parent / "kernels"


MIN_CAPABILITY = 80  # the kernels' tensor-core mma and cp.async: A100, RTX 30xx and newer


def gpu_capability() -> str:
    """The current CUDA device's compute capability as CuPy spells it ("90": 9.0), or "" where
    CuPy does not import or sees no device."""
    try:
        import cupy

        return cupy.cuda.Device().compute_capability if cupy.cuda.runtime.getDeviceCount() else ""
    except Exception:  # ImportError, CUDARuntimeError: no usable GPU here
        return ""


def cuda_available() -> bool:
    """True when CuPy imports and its current CUDA device runs the kernels (compute capability
    8.0 or newer); an older GPU is left to NumPy."""
    cc = gpu_capability()
    return bool(cc) and int(cc) >= MIN_CAPABILITY


@dataclass(frozen=True)
class Backend:
    """The array module a model runs on, plus its name."""

    name: str  # "numpy" | "cupy"
    xp: ModuleType

    @property
    def is_gpu(self) -> bool:
        """True on the CuPy backend."""
        return self.name == "cupy"

    def asarray(self, a, dtype=None):
        """Move a host array onto this backend."""
        return self.xp.asarray(a, dtype=dtype)

    def to_numpy(self, a) -> np.ndarray:
        """Bring an array of this backend back to host NumPy."""
        if self.is_gpu:
            return self.xp.asnumpy(a)
        return np.asarray(a)


def describe(backend: Backend) -> str:
    """Where the model runs, for the server's start line: the GPU's name, or NumPy and, where
    a CUDA device was passed over for being too old, why."""
    if backend.is_gpu:
        cupy = backend.xp
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
        name = props["name"]
        return f"on {name.decode() if isinstance(name, bytes) else name} (CuPy)"
    cc = gpu_capability()
    if cc and int(cc) < MIN_CAPABILITY:
        return (f"on NumPy: the GPU's compute capability {cc[:-1]}.{cc[-1]} is older than the "
                f"kernels' {MIN_CAPABILITY // 10}.0")
    return "on NumPy"


def get_backend(name: str = "auto") -> Backend:
    """Resolve "auto" | "numpy" | "cupy" to a Backend; "cupy" without a GPU is an error."""
    if name not in ("auto", "numpy", "cupy"):
        raise ValueError(f"backend must be auto, numpy or cupy, not {name!r}")
    if name == "auto":
        name = "cupy" if cuda_available() else "numpy"
    if name == "cupy":
        if not cuda_available():
            raise RuntimeError("backend 'cupy' needs CuPy and a CUDA device of compute "
                               "capability 8.0 or newer (A100, RTX 30xx, H100); none found")
        import cupy

        return Backend("cupy", cupy)
    return Backend("numpy", np)


def kernel_source(name: str) -> str:
    """Text of ds4/kernels/<name>.cu."""
    return (KERNEL_DIR / f"{name}.cu").read_text()


def load_module(name: str, options: tuple[str, ...] = ("--std=c++17",)):
    """Compile ds4/kernels/<name>.cu as a cupy.RawModule (GPU only)."""
    import cupy

    return cupy.RawModule(code=kernel_source(name), options=options)
