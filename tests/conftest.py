"""Fixtures shared by every test folder: seeded random Qwen3 checkpoints (session-scoped)."""

from __future__ import annotations

from pathlib import Path

import os

import pytest
from hypothesis import settings

# CI runs the property tests on a fixed sequence of examples (a red run is reproducible and
# never depends on the draw); HYPOTHESIS_PROFILE=explore draws fresh examples every run.
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

from mlx_serving.models.seeded_checkpoint import write_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3 in the mlx-community 4-bit layout (bf16 scales), seed 0."""
    return write_checkpoint(tmp_path_factory.mktemp("qwen3") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny32_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3, dense float32 weights (exact parity), seed 0."""
    return write_checkpoint(tmp_path_factory.mktemp("qwen3") / "tiny32", "tiny", seed=0,
                            quantized=False, dtype="float32")
