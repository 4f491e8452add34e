"""``IterationTokens``: how many tokens each engine step computed (prefill chunk tokens + one per
decode row), as a histogram with vLLM v1's ``iteration_tokens_total`` buckets.

The counts reach the serving's stats (``ServingStats.backend``) as cumulative buckets named
``iteration_tokens_le_<bound>`` (``+Inf`` last) with ``iteration_tokens_sum`` and
``iteration_tokens_count``; summing them over partitions or workers keeps them a histogram.
"""

from __future__ import annotations

from bisect import bisect_left

__all__ = ["ITERATION_TOKEN_BUCKETS", "IterationTokens"]

#: Upper bounds (tokens) of vLLM v1's ``vllm:iteration_tokens_total`` (vllm/v1/metrics/loggers.py).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class IterationTokens:
    """Tokens per step: ``observe(n)`` once per step that ran a forward."""

    def __init__(self) -> None:
        self._counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)  # the last: above every bound
        self._sum = 0

    def observe(self, tokens: int) -> None:
        """Count one step that computed ``tokens`` (>= 1) tokens."""
        self._counts[bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
        self._sum += tokens

    def stats(self) -> dict[str, float]:
        """Cumulative buckets ``iteration_tokens_le_<bound>`` / ``iteration_tokens_le_+Inf``, and
        ``iteration_tokens_sum`` (tokens) / ``iteration_tokens_count`` (steps)."""
        out: dict[str, float] = {}
        running = 0
        for bound, count in zip((*map(str, ITERATION_TOKEN_BUCKETS), "+Inf"), self._counts):
            running += count
            out[f"iteration_tokens_le_{bound}"] = running
        out["iteration_tokens_sum"], out["iteration_tokens_count"] = self._sum, running
        return out
