"""Fixtures of the model tests: the tiny checkpoints (tests/conftest.py) loaded once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_serving.models.decoder.layers import State
from mlx_serving.models.loader import load
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
