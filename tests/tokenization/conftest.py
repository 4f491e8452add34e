"""Fixtures for the tokenization tests: the shipped Qwen3 tokenizer and, for parity checks,
transformers' tokenizer built offline from the same files (loaded once per session); llama.cpp's
tokenizer test vocabularies (fetched once into the cache)."""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from mlx_serving.tokenization import Tokenizer, data_path

#: llama-cpp-python's sdist vendors llama.cpp (ggml-org/llama.cpp@0c1e57098 for 0.3.36) with its
#: tokenizer test vocabularies: models/ggml-vocab-<name>.gguf + .gguf.inp (texts) + .gguf.out (ids).
LLAMA_CPP_PYTHON = "0.3.36"
LLAMA_CPP_PYTHON_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"


@pytest.fixture(scope="session")
def qwen3() -> Tokenizer:
    return Tokenizer.qwen3()


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint-like directory with the plain tokenizer.json, as a model directory has."""
    root = tmp_path_factory.mktemp("qwen3_tokenizer")
    (root / "tokenizer.json").write_bytes(gzip.decompress(data_path("tokenizer.json.gz").read_bytes()))
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy(data_path(name), root / name)
    shutil.copy(data_path("config.qwen3-0.6b-mlx-4bit.json"), root / "config.json")
    return root


@pytest.fixture(scope="session")
def hf_tokenizer(qwen3_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(qwen3_dir), local_files_only=True)


def _cache_dir() -> Path:
    """``$MLX_SERVING_CACHE``, else ``$XDG_CACHE_HOME/mlx-serving``, else ``~/.cache/mlx-serving``."""
    if os.environ.get("MLX_SERVING_CACHE"):
        return Path(os.environ["MLX_SERVING_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx-serving"


def _fetch_sdist(dest: Path) -> Path:
    """``pip download`` the llama-cpp-python sdist (76 MB; pip's HTTP cache serves a repeat) into
    ``dest``, sha256-checked; skips the test when the registry cannot be reached."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
           "--retries", "1", "--timeout", "30",
           f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(dest)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        detail = (getattr(e, "stderr", None) or str(e)).strip().splitlines()[-1:] or [""]
        pytest.skip(f"cannot fetch llama-cpp-python=={LLAMA_CPP_PYTHON} (llama.cpp's tokenizer test "
                    f"vocabularies) with pip download: {detail[0][:200]}")
    archive = dest / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != LLAMA_CPP_PYTHON_SHA256:
        raise AssertionError(f"{archive.name}: sha256 {digest}, expected {LLAMA_CPP_PYTHON_SHA256}")
    return archive


@pytest.fixture(scope="session")
def llamacpp_vocabs() -> Path:
    """Directory of llama.cpp's test vocabularies (every ``ggml-vocab-<name>.gguf`` that has
    ``.inp`` / ``.out`` files, with them), extracted once from the sdist into
    ``<cache>/test-data/llama-cpp-python-<version>-vocab`` (``<cache>``: ``$MLX_SERVING_CACHE``, else
    ``$XDG_CACHE_HOME/mlx-serving``, else ``~/.cache/mlx-serving``); the sdist itself is not kept."""
    target = _cache_dir() / "test-data" / f"llama-cpp-python-{LLAMA_CPP_PYTHON}-vocab"
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        archive = _fetch_sdist(Path(tmp))
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/models/"
        with tarfile.open(archive) as tar:
            tested = [m.name[: -len(".inp")] for m in tar.getmembers()
                      if m.name.startswith(prefix + "ggml-vocab-") and m.name.endswith(".gguf.inp")]
            wanted = {name + ext for name in tested for ext in ("", ".inp", ".out")}
            members = [m for m in tar.getmembers() if m.isfile() and m.name in wanted]
            tar.extractall(tmp, members=members, filter="data")
        (Path(tmp) / prefix / ".complete").write_text("")
        try:
            os.replace(Path(tmp) / prefix, target)
        except OSError:  # another session renamed its complete copy first
            if not (target / ".complete").is_file():
                raise
    return target

