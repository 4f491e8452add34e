"""Verification of a draft against the target's samples at its span's positions.

A row's verify span feeds ``[last, d_1 .. d_k]``; the runner samples a token ``s_i`` at every
position ``i = 0..k`` with the row's own sampler chain (its processors and filters applied to the
target's logits there, its own uniform draws in order). Draft token ``d_{i+1}`` is accepted while
it equals ``s_i``; the row emits ``d_1 .. d_a`` and then ``s_a``. For an n-gram draft (a point
mass q at ``d``) this is exactly the rejection sampler of Leviathan et al. 2023 / Chen et al. 2023:
``d`` is accepted with probability ``min(1, p(d) / q(d)) = p(d)``, and on rejection the emitted
token is distributed as ``norm(max(0, p - q))`` = p without ``d``; the emitted tokens are the ones
plain decoding would sample with the same uniforms, so greedy output is token-identical and a seeded
sampled one is too.
"""

from __future__ import annotations

import numpy as np

__all__ = ["accepted"]


def accepted(draft: np.ndarray, sampled: np.ndarray) -> int:
    """How many leading draft tokens (``draft`` ``(k,)``) the samples ``sampled`` ``(k + 1,)``
    reproduce: the largest ``a`` with ``draft[:a] == sampled[:a]``; the row emits
    ``sampled[: a + 1]``."""
    miss = np.flatnonzero(np.asarray(draft) != np.asarray(sampled)[: len(draft)])
    return int(miss[0]) if miss.size else len(draft)
