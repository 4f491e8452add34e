"""Token samplers and per-request sampling parameters.

- ``greedy``: argmax.
- ``top_p_gpu``: nucleus (top-p) sampling on device. Keep the smallest set of tokens,
  in order of decreasing probability, whose total probability reaches ``top_p``
  (the token that crosses ``top_p`` is kept), renormalize, sample
  (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration").
- ``top_p_cpu``: the same nucleus, computed with numpy on the host.

Randomness: each request owns a ``numpy.random.Generator`` seeded from its ``seed``;
each sampled token consumes exactly one uniform draw from it, so a request's tokens do
not depend on its batchmates. ``temperature == 0`` means greedy for every sampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import mlx.core as mx
import numpy as np

__all__ = ["SAMPLERS", "SamplingParams", "greedy", "top_p_cpu", "top_p_gpu"]

Sampler = Literal["greedy", "top_p_cpu", "top_p_gpu"]
SAMPLERS: tuple[str, ...] = ("greedy", "top_p_cpu", "top_p_gpu")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation options.

    ``max_new_tokens`` >= 1 (EOS counted); ``sampler`` one of :data:`SAMPLERS`;
    ``temperature`` >= 0 (0 = greedy); ``top_p`` in (0, 1]; ``seed`` for reproducible
    sampling (None: fresh entropy); ``eos_token_ids``: generation stops after any of them.
    Raises ValueError on construction for any value out of range.
    """

    max_new_tokens: int = 100
    sampler: Sampler = "greedy"
    temperature: float = 0.95
    top_p: float = 0.9
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))

    @property
    def is_greedy(self) -> bool:
        """True when tokens are the argmax (greedy sampler or temperature 0)."""
        return self.sampler == "greedy" or self.temperature == 0


def greedy(logits: mx.array) -> mx.array:
    """``(B, V)`` logits -> ``(B,)`` int32 argmax."""
    return mx.argmax(logits, axis=-1).astype(mx.int32)


def top_p_gpu(logits: mx.array, temperature: mx.array, top_p: mx.array, u: mx.array) -> mx.array:
    """Nucleus sampling on device.

    ``logits`` (B, V); ``temperature``, ``top_p``, ``u`` (B,) float32 with
    temperature > 0 and ``u`` uniform in [0, 1). Returns (B,) int32 token ids: the
    first sorted token whose cumulative probability exceeds ``u`` times the nucleus mass.
    """
    probs = mx.softmax(logits.astype(mx.float32) / temperature[:, None], axis=-1)
    order = mx.argsort(-probs, axis=-1)
    sorted_p = mx.take_along_axis(probs, order, axis=-1)
    cum = mx.cumsum(sorted_p, axis=-1)
    keep = (cum - sorted_p) < top_p[:, None]  # mass before the token is below top_p
    n_keep = keep.sum(axis=-1)
    mass = mx.take_along_axis(cum, (n_keep - 1)[:, None], axis=-1)[:, 0]
    k = ((cum < (u * mass)[:, None]) & keep).sum(axis=-1)
    k = mx.minimum(k, n_keep - 1)
    return mx.take_along_axis(order, k[:, None], axis=-1)[:, 0].astype(mx.int32)


def top_p_cpu(logits: np.ndarray, temperature: float, top_p: float, u: float) -> int:
    """Nucleus sampling on the host with numpy: ``logits`` (V,) float, ``u`` in [0, 1).

    Same rule as :func:`top_p_gpu`; returns the token id.
    """
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    sp = p[order]
    cum = np.cumsum(sp)
    n_keep = int(np.count_nonzero(cum - sp < top_p))
    k = int(np.searchsorted(cum[:n_keep], u * cum[n_keep - 1], side="right"))
    return int(order[min(k, n_keep - 1)])
