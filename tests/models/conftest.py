"""Shared fixtures for the model tests: seeded random Qwen3 checkpoints (session-scoped)."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.qwen3 import State, load
from models.qwen3.checkpoint import write_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3 in the mlx-community 4-bit layout (bf16 scales), seed 0."""
    return write_checkpoint(tmp_path_factory.mktemp("qwen3") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny32_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3, dense float32 weights (exact parity), seed 0."""
    return write_checkpoint(tmp_path_factory.mktemp("qwen3") / "tiny32", "tiny", seed=0,
                            quantized=False, dtype="float32")


@pytest.fixture(scope="session")
def tiny(tiny_ckpt: Path) -> State:
    """The 4-bit tiny checkpoint, default compute dtype (float32 on the CPU)."""
    return load(tiny_ckpt)


@pytest.fixture(scope="session")
def tiny_bf16(tiny_ckpt: Path) -> State:
    """The 4-bit tiny checkpoint computing in its stored bfloat16 (as mlx-lm does)."""
    return load(tiny_ckpt, dtype="bfloat16")


@pytest.fixture(scope="session")
def tiny32(tiny32_ckpt: Path) -> State:
    return load(tiny32_ckpt)
