"""Native CPU kernels, built on first use for this machine's MLX and cached.

Two MLX primitives (C++ extension API, ``eval_cpu``) used on the CPU device, computing in float32:
:func:`quantized_matmul_cpu` for MLX's affine 4- and 8-bit matrices (the family layers' projections
and head; MLX's own ``mx.quantized_matmul`` is a scalar loop there) and :func:`paged_attention_cpu`,
causal GQA attention read through the paged KV cache's block table (MLX's CPU attention runs on a
reference BLAS): docs/benchmarks.md, "CPU". The sources (``*.cpp`` here) are compiled once into one
module with the C++ compiler (``$CXX``, else ``c++``) against
the installed MLX's headers and library and nanobind (the ``cpu`` extra), into
``cache_dir()/native/<key>`` (the key hashes the source, MLX's and nanobind's versions and the
Python ABI): 10-60 s on 2 cores, with one line on stderr. When it cannot be built or loaded
(no compiler, no nanobind, an MLX whose nanobind ABI differs), one line on stderr says why and the
callers use MLX's own operations; ``MLX_SERVING_NATIVE=0`` turns the kernels off (silently).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Protocol, runtime_checkable

import mlx.core as mx

from .._fetch import cache_dir

__all__ = ["PagedAttention", "QuantizedMatmul", "StoringAttention", "cpu_decode_module", "paged_attention_cpu",
           "quantized_matmul_cpu", "unavailable_reason"]

_DIR = Path(__file__).parent
_CPU_DECODER = _DIR.parent / "decoder" / "cpu"  # the CPU decode step's sources, built into the same module
_SOURCES = (_DIR / "module.cpp", _DIR / "quantized_matmul.cpp", _DIR / "paged_attention.cpp",
            _DIR / "attention_loops.cpp", _CPU_DECODER / "qdot.cpp", _CPU_DECODER / "decode_step.cpp",
            _CPU_DECODER / "qgemm.cpp", _CPU_DECODER / "prefill.cpp", _CPU_DECODER / "pack.cpp",
            _CPU_DECODER / "kv_store.cpp", _CPU_DECODER / "attend.cpp", _CPU_DECODER / "embed_rows.cpp")
_HEADERS = (_DIR / "kernels.h", _DIR / "attention_loops.h", _CPU_DECODER / "qdot.h", _CPU_DECODER / "decode_step.h",
            _CPU_DECODER / "pool.h", _CPU_DECODER / "qgemm.h", _CPU_DECODER / "prefill.h", _CPU_DECODER / "pack.h",
            _CPU_DECODER / "kv_store.h", _CPU_DECODER / "attend.h", _CPU_DECODER / "attend_simd.h", _CPU_DECODER / "embed_rows.h")
_MODULE = "_kernels"
_lock = threading.Lock()
_reason: list[str] = []


class QuantizedMatmul(Protocol):
    """``(x (..., K) float32, w (N, K * bits / 32) uint32, scales (N, K / G), biases (N, K / G)
    (both float32 or both float16), group_size, bits) -> (..., N) float32``: ``x @ dequantize(w).T``,
    each weight dequantized in float32."""

    def __call__(self, x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                 bits: int) -> mx.array: ...


class PagedAttention(Protocol):
    """``(q (B, H, T, D) float32, k (R, Hkv, D) float32, v (R, Hkv, D) float32 (or 16-bit), block_table (B, W)
    int32, start (B,) int32, n_valid (B,) int32, scale, block_size) -> (B, T, H, D) float32``: query
    ``j`` of row ``b`` (position ``start[b] + j``) attends to the keys at positions ``0..start[b] + j``,
    read at flat row ``block_table[b, p // block_size] * block_size + p % block_size``; head ``h``
    reads KV head ``h // (H // Hkv)``; queries ``j >= n_valid[b]`` are padding (zeros). Each query's
    result depends only on its own vector and its prefix (batch-invariant, bit for bit).

    A 16-bit cache (``kv_cache_dtype`` float16 / bfloat16): ``k`` and ``v`` in that dtype, widened
    to float32 as they are read. A quantized cache (``kv_cache_dtype`` int8 / int4): ``k`` and ``v`` in MLX's affine layout
    ``(R, Hkv, D * bits / 32)`` uint32 with ``k_scales`` / ``k_biases`` / ``v_scales`` / ``v_biases``
    ``(R, Hkv, D / group_size)`` float32, ``bits`` 4 or 8, ``group_size`` 32, 64 or 128: each block's
    rows are dequantized in float32 once per (row, KV head) and shared by its query tiles. ``threads`` > 0: the work
    runs on the native prefill's thread pool of that many threads (:mod:`models.decoder.cpu.prefill`)
    instead of OpenMP's (the same result). Raises ValueError for arguments of another dtype or shape."""

    def __call__(self, q: mx.array, k: mx.array, v: mx.array, block_table: mx.array, start: mx.array,
                 n_valid: mx.array, scale: float, block_size: int, *, k_scales: mx.array | None = None,
                 k_biases: mx.array | None = None, v_scales: mx.array | None = None,
                 v_biases: mx.array | None = None, group_size: int = 0, bits: int = 0,
                 threads: int = 0) -> mx.array: ...


@runtime_checkable
class StoringAttention(PagedAttention, Protocol):
    """A :class:`PagedAttention` that also stores the new K/V itself (the native prefill's,
    :mod:`models.decoder.cpu.prefill`): :meth:`store_and_attend`."""

    def store_and_attend(self, q: mx.array, new_k: mx.array, new_v: mx.array, rows: mx.array, cache: list[mx.array],
                         block_table: mx.array, start: mx.array, n_valid: mx.array, scale: float, block_size: int,
                         group_size: int = 0, bits: int = 0) -> list[mx.array]:
        """The new K/V ``new_k``, ``new_v`` ``(N, Hkv, D)`` float32 stored at the flat cache ``rows``
        ``(N,)`` int32 as the CPU decode step stores them (``kv_store.cpp``: the dtype's rounding,
        or Hadamard-rotated and quantized: bit for bit ``PagedKVCache.write``'s; a row given twice
        keeps the later token's), then the attention of ``q`` ``(B, H, T, D)`` over ``cache`` (one
        layer's ``[k, v]``, then ``[k scales, k biases, v scales, v biases]`` when quantized with
        ``bits`` / ``group_size``), a quantized cache's queries rotated into its basis and the
        output back out -> ``[(B, T, H, D) float32, *cache]``: the cache's arrays over the given
        ones' buffers, written in place, to store back. Raises ValueError as the attention, and for
        new K/V or rows of another shape or dtype."""


def unavailable_reason() -> str | None:
    """Why the native kernels are not in use (None when they are, or before the first attempt)."""
    return _reason[0] if _reason else None


def quantized_matmul_cpu() -> QuantizedMatmul | None:
    """The native CPU quantized matmul, built on first call (None when unavailable: see the module
    docstring; the reason is printed once and kept in :func:`unavailable_reason`)."""
    module = _load()
    return None if module is None else module.quantized_matmul


def paged_attention_cpu() -> PagedAttention | None:
    """The native CPU paged attention, built on first call (None when unavailable, as
    :func:`quantized_matmul_cpu`)."""
    module = _load()
    return None if module is None else module.paged_attention


@cache
def _load() -> ModuleType | None:
    if os.environ.get("MLX_SERVING_NATIVE", "1") == "0":
        _reason.append("MLX_SERVING_NATIVE=0")
        return None
    try:
        with _lock:
            module = _import(_build())
        _check(module)
        return module
    except Exception as exc:  # a compiler, ABI or import failure of any kind: fall back, say so once
        _reason.append(f"{type(exc).__name__}: {str(exc).strip()[-600:]}")
        print(f"mlx-serving: the native CPU kernels are not available ({_reason[0]}); using MLX's "
              "quantized_matmul (slower on the CPU)", file=sys.stderr, flush=True)
        return None


def _key() -> str:
    import nanobind

    parts = [*(path.read_bytes() for path in (*_SOURCES, *_HEADERS)), mx.__version__.encode(), nanobind.__version__.encode(),  # type: ignore[attr-defined]  # mlx stubs omit __version__
             (sysconfig.get_config_var("EXT_SUFFIX") or "").encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _build() -> Path:
    """The built extension module (compiled first when the cache lacks it)."""
    out = cache_dir() / "native" / _key()
    target = out / f"{_MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if target.is_file():
        return target
    out.mkdir(parents=True, exist_ok=True)
    print("mlx-serving: building the native CPU kernels once for this machine (10-60 s)...", file=sys.stderr,
          flush=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run(_command(built), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the compiler failed: {(done.stderr or done.stdout)[-1500:]}")
        os.replace(built, target)  # atomic: a concurrent build's result is as good
    return target


def _command(output: Path) -> list[str]:
    import nanobind

    mlx_dir = Path(mx.__file__).parent
    nb_dir = Path(nanobind.__file__).parent
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    return [cxx, "-O3", "-shared", "-fPIC", "-std=c++20", "-fvisibility=hidden", *_platform_flags(), "-DNB_DOMAIN=mlx",
            "-DNDEBUG", f"-I{sysconfig.get_paths()['include']}", f"-I{nb_dir / 'include'}",
            f"-I{nb_dir / 'ext' / 'robin_map' / 'include'}", f"-I{mlx_dir / 'include'}", f"-I{_DIR}",
            f"-I{_CPU_DECODER}", *(str(path) for path in _SOURCES), str(nb_dir / "src" / "nb_combined.cpp"),
            f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}", "-o", str(output)]


def _platform_flags() -> list[str]:
    """OpenMP where the compiler has it (GCC / LLVM clang on Linux); on macOS, Apple's clang has no
    ``-fopenmp`` (the kernels then run their loops on one thread) and a Python extension leaves
    the interpreter's symbols to load time (``-undefined dynamic_lookup``)."""
    return ["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else ["-fopenmp"]


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_MODULE, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(module: ModuleType) -> None:
    """One small product against MLX's own (the module must accept and return ``mx.array``); the
    attention is checked by the tests (tests/models/test_native_kernels.py)."""
    x = mx.arange(64, dtype=mx.float32).reshape(1, 64) / 64
    w, s, b = mx.quantize(mx.ones((8, 64)), group_size=32, bits=4)
    got = module.quantized_matmul(x, w, s, b, 32, 4)
    want = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=32, bits=4)
    if not mx.allclose(got, want, atol=1e-4).item():
        raise RuntimeError("the native kernel disagrees with mx.quantized_matmul")


def cpu_decode_module() -> ModuleType | None:
    """The built module when it is available (its ``make_decoder`` / ``decode_step`` are the CPU
    decode step of :mod:`models.decoder.cpu`, its ``int8_quantized_matmul`` the native prefill's
    int8 GEMM), None otherwise (as :func:`quantized_matmul_cpu`)."""
    return _load()
