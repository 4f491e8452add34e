"""N-gram prompt lookup (vLLM's ``ngram`` method; Saxena 2023, "Prompt Lookup Decoding"): the
draft for a row is what followed the latest earlier occurrence of its last n tokens in its own
prompt and output that is followed by k tokens (else the earliest, which is followed by the most),
for the longest n in ``[min_n, max_n]`` that occurs."""

from __future__ import annotations

import numpy as np

__all__ = ["NgramProposer"]

_EMPTY = np.zeros(0, dtype=np.int32)


class NgramProposer:
    """Prompt lookup with n-grams of ``min_n`` to ``max_n`` tokens (1 <= min_n <= max_n)."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: np.ndarray, k: int) -> np.ndarray:
        """Up to ``k`` draft tokens (``(d,) int32``, d <= k; empty when no n-gram of the tail of
        ``tokens`` ``(L,) int32`` occurs earlier in it, or ``k`` < 1): the tokens after the latest
        earlier occurrence of the longest matching tail that has ``k`` after it (else after the
        earliest one). One pass over ``tokens`` (this runs for a row's drafts and shadow drafts at
        its steps: at every landed token of a row whose drafts fail), then one vectorized pass over
        the earlier occurrences of its last token (each one's matching tail length, all n at once)."""
        size, top = len(tokens), min(self.max_n, len(tokens) - 1)
        if k < 1 or top < self.min_n:
            return _EMPTY
        ends = np.flatnonzero(tokens[: size - 1] == tokens[size - 1])  # where an occurrence may end
        if not ends.size:
            return _EMPTY
        back = np.arange(top)
        at = ends[None, :] - back[:, None]  # (top, E): where each occurrence's tail token i lies
        same = (at >= 0) & (tokens[np.maximum(at, 0)] == tokens[size - 1 - back, None])
        match = same.cumprod(axis=0).sum(axis=0)  # each occurrence's matching tail length, up to top
        n = int(match.max())
        if n < self.min_n:
            return _EMPTY
        hits = ends[match >= n] - (n - 1)  # the longest matches' starts, in order
        full = hits[hits + n + k <= size]
        start = int(full[-1] if full.size else hits[0]) + n
        return np.asarray(tokens[start : start + k], dtype=np.int32)
