"""Every code block in README.md and docs/*.md runs as written.

- ```python blocks of one file run in order, in one namespace (a tutorial reads top to bottom),
  in a fresh interpreter, as ``__main__`` (as a pasted script would).
- ```sh / ```bash blocks run with bash (``set -e``) from the repository root, the venv's bin
  first on PATH. README.md's two install commands are what CI itself runs (.ci/run), so they are
  not repeated here.
- ```text blocks are output or diagrams and are not run.
- Nothing is substituted: the examples name the default model (SmolLM2-135M-Instruct, real
  weights) or write the seeded checkpoint they need themselves. The default model comes from a
  private cache directory whose ``packages`` folder is the shared cache's (fetched once per
  machine by the ``smollm2_gguf`` fixture), as is its ``native`` folder (the CPU kernels, built
  once: the ``private_cache`` fixture); what the docs write there (conversions, seeded
  checkpoints) is dropped after the test.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
_LANGS = {"python", "sh", "bash", "text"}
_RUNNER = r'''
import sys
namespace = {"__name__": "__main__"}
for i, source in enumerate(sys.argv[1:]):
    exec(compile(source, f"<block {i + 1}>", "exec"), namespace)
'''


def blocks(path: Path) -> list[tuple[str, str]]:
    """``(language, source)`` of every fenced block of a Markdown file."""
    return [(m.group(1), m.group(2)) for m in _FENCE.finditer(path.read_text())]


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


@pytest.fixture(scope="module")
def doc_env(tmp_path_factory: pytest.TempPathFactory, private_cache) -> dict[str, str]:
    cache = private_cache(tmp_path_factory.mktemp("cache"))
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "MLX_SERVING_CACHE": str(cache), "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "examples"), os.environ.get("PYTHONPATH")]))}


def test_the_suites_ray_caps_reach_the_pages(doc_env: dict[str, str]):
    """tests/conftest.py's Ray Serve health-check caps are in the pages' environment (the Ray a page
    starts, its Serve controller included, inherits it: a healthy proxy on busy cores stays up)."""
    caps = {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_PROXY_")}
    assert len(caps) == 3 and all(doc_env[k] == v for k, v in caps.items())


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_every_block_is_tagged(path: Path):
    untagged = [src.splitlines()[0] if src else "" for lang, src in blocks(path) if lang not in _LANGS]
    assert not untagged, f"tag each block with one of {sorted(_LANGS)}; untagged blocks start with {untagged}"


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_no_placeholder_checkpoints(path: Path):
    """A block runs as written: no ``path/to/...`` stands for a checkpoint the reader must supply."""
    placeholders = [src.splitlines()[0] for lang, src in blocks(path) if lang != "text" and "path/to/" in src]
    assert not placeholders, f"blocks that name a placeholder path start with {placeholders}"


#: A page's blocks run in one subprocess of bounded work (the default model; server.md starts four
#: servers, distributed.md Ray and Serve); this cap only ends a hang, so it leaves room for cores
#: shared with other work.
_PAGE_S = 540


@pytest.mark.timeout(_PAGE_S + 60)
@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_python_blocks_run(path: Path, doc_env: dict[str, str], tmp_path: Path):
    sources = [src for lang, src in blocks(path) if lang == "python"]
    if not sources:
        pytest.skip("no python blocks")
    done = subprocess.run([sys.executable, "-c", _RUNNER, *sources], cwd=tmp_path, env=doc_env,
                          capture_output=True, text=True, timeout=_PAGE_S)
    assert done.returncode == 0, f"{path.name}:\n{done.stderr[-4000:]}"


@pytest.mark.timeout(_PAGE_S + 60)
@pytest.mark.parametrize("path", DOCS[1:], ids=_ids(DOCS[1:]))
def test_shell_blocks_run(path: Path, doc_env: dict[str, str]):
    sources = [src for lang, src in blocks(path) if lang in ("sh", "bash")]
    if not sources:
        pytest.skip("no shell blocks")
    for source in sources:
        done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + source], cwd=ROOT, env=doc_env,
                              capture_output=True, text=True, timeout=_PAGE_S)
        assert done.returncode == 0, f"{path.name}:\n{source}\n{done.stderr[-4000:]}"


_TEST_REF = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`((?:, `::\w+`)*)")


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_named_tests_exist(path: Path):
    """Every ``tests/...py::name`` (and each ``::name`` after it) a doc cites is a real test."""
    missing = []
    for file, name, more in _TEST_REF.findall(path.read_text()):
        source = ROOT / file
        if not source.is_file():
            missing.append(file)
            continue
        text = source.read_text()
        for test in [name, *re.findall(r"::(\w+)", more)]:
            if test and not re.search(rf"^(async )?def {test}\b", text, re.M):
                missing.append(f"{file}::{test}")
    assert not missing, missing
