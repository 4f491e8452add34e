"""N-gram prompt lookup (vLLM's ``ngram`` method; Saxena 2023, "Prompt Lookup Decoding"): the
draft for a row is what followed the latest earlier occurrence of its last n tokens in its own
prompt and output that is followed by k tokens (else the earliest, which is followed by the most),
for the longest n in ``[min_n, max_n]`` that occurs."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

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
        earliest one)."""
        size = len(tokens)
        if k < 1:
            return _EMPTY
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            windows = sliding_window_view(tokens[: size - 1], n)  # occurrences followed by a token
            hits = np.flatnonzero((windows == tokens[size - n :]).all(axis=1))
            if hits.size:
                full = hits[hits + n + k <= size]
                start = int(full[-1] if full.size else hits[0]) + n
                return np.asarray(tokens[start : start + k], dtype=np.int32)
        return _EMPTY
