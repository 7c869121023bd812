"""Programmatic dependent launch (PDL): a kernel launched this way may be scheduled while the
kernel before it on the stream is still finishing, so its blocks start (and stream their
weights) in the other's tail instead of after it.

The kernel must execute common.cuh's `wait_inputs()` before it touches memory that an earlier
kernel writes or reads (PTX griddepcontrol.wait: the earlier grid has completed and its writes
are visible), and every block must reach it, so that this grid's completion still implies the
earlier one's for the kernel after it. The families whose kernels all do are PDL_FAMILIES in
ds4/kernels/__init__.py; its `launch` sends only those through here, only while a stream is
capturing a CUDA graph (replay is where launch gaps count) and only on compute capability 9.0
or later. CuPy has no cuLaunchKernelEx binding, so this
calls the driver through ctypes with CuPy's CUfunction and stream handles.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("count", ctypes.c_uint)]


CTYPE = {np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.int64): ctypes.c_int64,
         np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
         np.dtype(np.float32): ctypes.c_float}


@functools.cache
def _driver():
    """The CUDA driver library with cuLaunchKernelEx's signature."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                     ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    return lib


def launch_after(function, grid, block, args, shared: int, stream: int) -> None:
    """Launch CuPy Function `function` (its .ptr is the CUfunction) on `stream` with the
    programmatic serialization attribute; args are NumPy scalars as the kernel takes them."""
    values = [CTYPE[np.asarray(a).dtype](np.asarray(a).item()) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    attr = LaunchAttribute(PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    grid, block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    config = LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared,
                          stream, ctypes.pointer(attr), 1)
    status = _driver().cuLaunchKernelEx(ctypes.byref(config), function.ptr, params, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status}")
