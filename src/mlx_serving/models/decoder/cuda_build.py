"""Build the decode kernels once per machine, not once per process or per shape (MLX's CUDA build).

``mx.fast.cuda_kernel`` compiles a kernel with NVRTC in every process, once per set of template
arguments, and never caches the result on disk (MLX's custom kernels skip its PTX cache): on an
H200 each build took ~1.3 s, and a kernel whose template held a row count or a split count was
built again for every padded decode shape, 3-4 s each (issue 37, bench/gpu_shape_builds.py). Here
each kernel's source is compiled by NVRTC (through ``ctypes``, the library MLX itself loaded) into
a cubin for this GPU, kept in ``cache_dir()/cuda/`` under a key hashing the source, the options,
NVRTC's version and the GPU architecture, and launched with ``mx.fast.precompiled_cuda_kernel``.
Sizes that vary per call (rows, splits, block-table width) are kernel arguments, so one cubin serves
every shape: a later process loads the file (milliseconds) and a new shape builds no kernel.

The cache is untrusted input: each cubin is stored beside its SHA-256 and a file that does not match
is compiled again. Files are written to a temporary name and renamed.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Sequence

import mlx.core as mx

__all__ = ["CudaKernel", "KernelBuildError", "compute_capability", "cubin"]

_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75  # CUdevice_attribute, CUDA driver API (cuda.h)
_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


class KernelBuildError(RuntimeError):
    """NVRTC could not be loaded or refused a kernel's source (the message holds its log)."""


@cache
def compute_capability() -> tuple[int, int]:
    """``(major, minor)`` of CUDA device 0, read from the CUDA driver (``cuDeviceGetAttribute``).
    Raises KernelBuildError without a driver."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise KernelBuildError(f"no CUDA driver: {e}") from None
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    ok = (driver.cuInit(0) == 0 and driver.cuDeviceGet(ctypes.byref(dev), 0) == 0
          and driver.cuDeviceGetAttribute(ctypes.byref(major), _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev) == 0
          and driver.cuDeviceGetAttribute(ctypes.byref(minor), _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev) == 0)
    if not ok:
        raise KernelBuildError("the CUDA driver did not report device 0's compute capability")
    return major.value, minor.value


@cache
def _nvrtc() -> ctypes.CDLL:
    """NVRTC: the copy this process already loaded (MLX's CUDA build links it), else by soname,
    else from an ``nvidia-cuda-nvrtc`` wheel on ``sys.path``."""
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libnvrtc.so" in line and "builtins" not in line})
    except OSError:
        pass
    wheels = [str(p) for root in sys.path for p in sorted(Path(root or ".").glob("nvidia/*/lib/libnvrtc.so*"))
              if "builtins" not in p.name]  # the nvidia-cuda-nvrtc wheels beside MLX's
    for name in [*paths, "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so", *wheels]:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    raise KernelBuildError("NVRTC (libnvrtc.so) is not loadable: MLX's CUDA build is needed")


def _check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        raise KernelBuildError(f"{what} failed: {lib.nvrtcGetErrorString(result).decode()}")


def _compile(source: str, name: str, arch: str) -> bytes:
    """NVRTC ``source`` for ``--gpu-architecture=arch`` (``sm_XY``: a cubin; ``compute_XY``: PTX)."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
        result = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if result != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, log)
            raise KernelBuildError(f"NVRTC refused kernel {name} ({arch}): {log.value.decode(errors='replace')}")
        kind = "CUBIN" if arch.startswith("sm_") else "PTX"
        size = ctypes.c_size_t()
        _check(lib, getattr(lib, f"nvrtcGet{kind}Size")(prog, ctypes.byref(size)), f"nvrtcGet{kind}Size")
        out = ctypes.create_string_buffer(size.value)
        _check(lib, getattr(lib, f"nvrtcGet{kind}")(prog, out), f"nvrtcGet{kind}")
        return out.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvrtc_version() -> str:
    lib = _nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return f"{major.value}.{minor.value}"


def _cache_root() -> Path:
    from .._fetch import cache_dir  # models/_fetch.py: $MLX_SERVING_CACHE, ...

    return cache_dir() / "cuda"


@cache
def cubin(source: str, name: str) -> bytes:
    """The compiled ``source`` (which defines ``extern "C" __global__ void name``) for CUDA device
    0: read from the cache when a verified copy is there, else compiled by NVRTC and stored. A
    cubin (``sm_XY``) where NVRTC targets this GPU, else PTX. Raises KernelBuildError."""
    major, minor = compute_capability()
    arch = f"sm_{major}{minor}"
    key = hashlib.sha256("\0".join([source, arch, _nvrtc_version(), "v1"]).encode()).hexdigest()[:32]
    path = _cache_root() / f"{name}-{key}.bin"
    cached = _read_verified(path)
    if cached is not None:
        return cached
    try:
        data = _compile(source, name, arch)
    except KernelBuildError:
        data = _compile(source, name, f"compute_{major}{minor}")  # an NVRTC older than this GPU: PTX
    _write(path, data)
    return data


def _read_verified(path: Path) -> bytes | None:
    try:
        data, digest = path.read_bytes(), path.with_suffix(".sha256").read_text().strip()
    except OSError:
        return None
    return data if hashlib.sha256(data).hexdigest() == digest else None


def _write(path: Path, data: bytes) -> None:
    """Store ``data`` and its digest by write-then-rename; a cache that cannot be written is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for target, blob in ((path, data), (path.with_suffix(".sha256"), hashlib.sha256(data).hexdigest().encode())):
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, target)
    except OSError:
        pass


@dataclass(frozen=True)
class CudaKernel:
    """One kernel: ``source`` defines ``extern "C" __global__ void name(inputs..., outputs...,
    scalars...)`` (array arguments as device pointers, then ``int`` / ``float`` scalars).
    Calling it launches the cached cubin through ``mx.fast.precompiled_cuda_kernel``; ``grid`` is
    in threads (as MLX's custom kernels count it)."""

    name: str
    source: str

    def __call__(self, inputs: Sequence[mx.array], output_shapes: Sequence[Sequence[int]],
                 output_dtypes: Sequence[mx.Dtype], scalars: Sequence[int | float], grid: tuple[int, int, int],
                 threadgroup: tuple[int, int, int], shared_memory: int = 0) -> list[mx.array]:
        return mx.fast.precompiled_cuda_kernel(
            name=self.name, compiled_source=cubin(self.source, self.name), inputs=list(inputs),
            output_shapes=[tuple(s) for s in output_shapes], output_dtypes=list(output_dtypes),
            scalars=list(scalars), grid=grid, threadgroup=threadgroup, shared_memory=shared_memory)
