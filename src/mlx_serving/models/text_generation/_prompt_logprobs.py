"""Prompt log-probabilities (vLLM's ``prompt_logprobs``; OpenAI completions' ``echo`` with
``logprobs``): a teacher-forced, cache-free causal forward over one prompt.

Runs on the serving's executor thread (``_backend.GenerationBackend.admit``), outside the engine:
the decoder's :func:`~..decoder.layers.hidden_states` (no KV cache), the model's head and a
float32 log-softmax, per row (a row's values never depend on its batchmates).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ..decoder.layers import State, hidden_states
from ._events import PromptToken

__all__ = ["prompt_logprobs"]

#: Positions whose logits are materialized at once: bounds the float32 ``(positions, vocab)``
#: array (256 x 151,936 x 4 bytes = 156 MB for Qwen3's vocabulary).
_CHUNK = 256


def prompt_logprobs(state: State, ids: Sequence[int], top: int) -> tuple[PromptToken, ...]:
    """Log-probabilities of ``ids[1:]`` (``len(ids) - 1`` :class:`PromptToken`; none for one
    token), each from the logits at the position before it, with ``top`` (an int in [0, 20])
    alternatives. The head's logits (activation dtype) are log-softmaxed in float32, unprocessed
    (no penalty, bias or mask applies to a prompt). Blocks until computed (evaluates the graph)."""
    if len(ids) < 2:
        return ()
    h = hidden_states(state, mx.array([list(ids)], dtype=mx.int32))[0, :-1]
    mx.eval(h)
    out: list[PromptToken] = []
    for start in range(0, h.shape[0], _CHUNK):
        targets = list(ids[start + 1: start + 1 + _CHUNK])
        out += _chunk(state, h[start: start + len(targets)], targets, top)
    return tuple(out)


def _chunk(state: State, h: mx.array, targets: list[int], top: int) -> list[PromptToken]:
    """The entries of hidden states ``h`` ``(n, hidden)`` predicting ``targets`` (n ids)."""
    logits = state.lm_head(h).astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, mx.array(targets, dtype=mx.int32)[:, None], axis=-1)[:, 0]
    if top == 0:
        return [PromptToken(t, v, ()) for t, v in zip(targets, np.array(chosen).tolist())]
    k = min(top, lp.shape[-1])
    part = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(lp, part, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    ids_, vals = mx.take_along_axis(part, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
    mx.eval(chosen, ids_, vals)
    tops = [tuple((t, v) for t, v in zip(i_row, v_row) if v != -np.inf)
            for i_row, v_row in zip(np.array(ids_).tolist(), np.array(vals).tolist())]
    return [PromptToken(t, v, tp) for t, v, tp in zip(targets, np.array(chosen).tolist(), tops)]
