"""Access to the data files shipped inside the package (``tokenization/data/``)."""

from __future__ import annotations

from pathlib import Path

_DATA_DIR = Path(__file__).resolve().parent / "data"


def data_path(name: str) -> Path:
    """Path of the shipped data file ``name`` (a bare file name, e.g.
    ``"config.qwen3-0.6b-mlx-4bit.json"``).

    Shipped files: ``tokenizer.json.gz``, ``tokenizer_config.json``, ``generation_config.json``,
    ``config.qwen3-0.6b-mlx-4bit.json`` (the reference ``config.json`` of a Qwen3-0.6B MLX 4-bit
    checkpoint) and ``PROVENANCE.md`` (where each file comes from).

    Raises:
        FileNotFoundError: ``name`` is not a shipped file (the message lists the shipped ones).
    """
    path = _DATA_DIR / name
    if Path(name).name != name or not path.is_file():
        shipped = sorted(p.name for p in _DATA_DIR.iterdir() if p.is_file())
        raise FileNotFoundError(f"no shipped data file {name!r}; shipped files: {shipped}")
    return path
