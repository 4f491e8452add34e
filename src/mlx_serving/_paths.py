"""Containment of a model folder's files (checkpoints and tokenizers are untrusted input): a file
named by a checkpoint must resolve inside its folder, or, for a Hugging Face hub cache snapshot
(``<repo>/snapshots/<revision>/``, whose files are symlinks to ``<repo>/blobs/``), inside that
repository's ``blobs`` folder. A leaf module: it imports nothing of the package."""

from __future__ import annotations

from pathlib import Path

__all__ = ["allowed_roots", "resolves_inside"]


def allowed_roots(root: Path) -> list[Path]:
    """Where files of folder ``root`` may live: ``root`` resolved and, for a hub cache snapshot,
    its repository's ``blobs`` folder when that is a real directory inside the repository's folder,
    never a symlink (which could make any folder, ``/`` included, the "blobs").
    Raises OSError / RuntimeError (a symlink loop) when ``root`` cannot be resolved."""
    real = root.resolve()
    roots = [real]
    for d in {root.absolute(), real}:
        if d.parent.name == "snapshots":
            blobs = d.parent.parent.resolve() / "blobs"
            if not blobs.is_symlink() and blobs.is_dir():
                roots.append(blobs)
    return roots


def resolves_inside(path: Path, root: Path) -> tuple[bool, Path]:
    """``(inside, real)``: whether ``path`` resolves (symlinks followed) inside one of
    :func:`allowed_roots` of ``root``, and where it resolves to. Raises OSError / RuntimeError
    (a symlink loop) when either cannot be resolved."""
    real = path.resolve()
    return any(real == r or real.is_relative_to(r) for r in allowed_roots(root)), real
