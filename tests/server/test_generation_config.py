"""Sampling defaults of a request that names none (issue 40, item 4), as vLLM's
``--generation-config auto``: the model's generation_config.json, else OpenAI's (temperature 1,
top_p 1); ``--generation-config vllm`` ignores the file; ``--temperature`` / ``--top-p`` win. The
file is untrusted: a bad value is refused naming the file. Through a real ``serve`` subprocess: a
file saying greedy makes two requests agree; ignoring it (temperature 1) makes them differ."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from mlx_serving.models.text_generation._options import sampling_defaults
from mlx_serving.server._cli import OPENAI_SAMPLING, _sampling_defaults
from test_serve_cli import serve_process


def _with_config(ckpt: Path, tmp_path: Path, **config: object) -> Path:
    copy = tmp_path / "m"
    shutil.copytree(ckpt, copy)
    raw = json.loads((copy / "generation_config.json").read_text()) if (copy / "generation_config.json").exists() else {}
    (copy / "generation_config.json").write_text(json.dumps({**raw, **config}))
    return copy


def test_the_files_sampling_keys_are_read(tiny_ckpt: Path, tmp_path: Path):
    path = _with_config(tiny_ckpt, tmp_path, temperature=0.6, top_p=0.95, top_k=20, min_p=0, repetition_penalty=1.1,
                        do_sample=True, max_new_tokens=9)
    assert sampling_defaults(path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0,
                                       "repetition_penalty": 1.1}
    (path / "generation_config.json").write_text(json.dumps({"top_k": 0, "temperature": True}))
    assert sampling_defaults(path) == {}  # top_k 0 is off; a bool is no number
    (path / "generation_config.json").unlink()
    assert sampling_defaults(path) == {}


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_p": 7}, {"repetition_penalty": 0}])
def test_a_bad_value_is_refused_naming_the_file(tiny_ckpt: Path, tmp_path: Path, bad: dict):
    path = _with_config(tiny_ckpt, tmp_path, **bad)
    with pytest.raises(ValueError, match="generation_config.json"):
        sampling_defaults(path)


def test_flags_over_the_file_over_openai(tiny_ckpt: Path, tmp_path: Path):
    path = _with_config(tiny_ckpt, tmp_path, temperature=0.6, top_k=20)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20}))
    assert _sampling_defaults(path, {"max_len": 64}) == {"temperature": 0.6, "top_p": 1.0, "top_k": 20, "max_len": 64}
    assert _sampling_defaults(path, {"generation_config": "vllm"}) == OPENAI_SAMPLING
    assert _sampling_defaults(path, {"temperature": 0.0})["temperature"] == 0.0


def _two_completions(url: str) -> list[str]:
    body = {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True}
    return [httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"] for _ in range(2)]


def test_serve_takes_the_models_defaults(tiny_ckpt: Path, tmp_path: Path):
    path = _with_config(tiny_ckpt, tmp_path, temperature=0.0)
    with serve_process(path, "--max-len", "128", "--log-level", "warning") as (url, _):
        first, second = _two_completions(url)
        assert first == second  # the file says greedy
    with serve_process(path, "--max-len", "128", "--log-level", "warning", "--generation-config", "vllm") as (url, _):
        first, second = _two_completions(url)
        assert first != second  # temperature 1: 12 tokens of a random model never repeat
