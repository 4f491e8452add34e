"""Helpers of the family parity tests (test_llama.py, test_qwen2.py): mlx-lm's greedy ids and
logits beside ours, and checkpoint copies with an edited config.json."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from paged import fresh
from mlx_serving.models.decoder.layers import State, forward

#: a config field value that drops the field (:func:`copy_with_config`)
DROP = object()


def mlx_lm_greedy(model, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's greedy ids for ``prompt`` (``generate_step``), ``n`` new tokens."""
    from mlx_lm.generate import generate_step

    return [int(tok) for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def assert_logits_match(state: State, model, prompt: list[int], steps: int = 3, atol: float = 1e-4) -> None:
    """Prefill logits of ``prompt`` and then ``steps`` greedy decode steps' logits equal mlx-lm's
    ``model`` (its own KV cache) within ``atol``."""
    from mlx_lm.models.cache import make_prompt_cache

    kv, ref_cache = fresh(state, 64), make_prompt_cache(model)
    t = len(prompt)
    ours = forward(state, kv.cache, kv.rows(mx.array([prompt]), mx.array([0]), mx.array([t]), t,
                                            mx.array([t - 1]), dense=True))
    theirs = model(mx.array([prompt]), cache=ref_cache)[:, -1]
    np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=atol)
    nxt = int(mx.argmax(ours))
    for step in range(steps):
        ours = forward(state, kv.cache, kv.rows(mx.array([[nxt]]), mx.array([t + step]), mx.array([1]),
                                                t + step + 1, mx.array([0]), dense=True))
        theirs = model(mx.array([[nxt]]), cache=ref_cache)[:, -1]
        np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=atol)
        nxt = int(mx.argmax(ours))


def copy_with_config(src: Path, dst: Path, **fields: Any) -> Path:
    """``src``'s weights (hard links, no tokenizer) in ``dst`` with config.json's ``fields`` set
    (:data:`DROP` removes one)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("tokenizer*", "config.json"), copy_function=os.link)
    cfg = json.loads((src / "config.json").read_text())  # a new file: the weights are hard links
    for k, v in fields.items():
        if v is DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
