"""Fixtures for the tokenization tests: the shipped Qwen3 tokenizer and, for parity checks,
transformers' tokenizer built offline from the same files (loaded once per session)."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from mlx_serving.tokenization import Tokenizer, data_path


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
