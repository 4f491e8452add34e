"""One generation request as the scheduler sees it (vLLM v1's ``Request``): what it asked for and
one pair of progress counters.

``num_tokens`` counts prompt + sampled tokens (a sampled token counts from the step that enqueued
it, before it reaches the host); ``num_computed_tokens`` counts the positions whose K/V is written
or enqueued. Everything else is derived: a request is *prefilling* while
``num_computed_tokens < prefill_end`` and *decoding* (one token per step) after, until it has
sampled ``max_new_tokens``. ``output`` holds the sampled tokens that have landed on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .logits import Chain
from .kv_cache_manager import SeqBlocks
from .protocol import TokenConstraint
from .sampling import SamplingParams
from .spec_decode.adaptive import SpecState

__all__ = ["Request"]


@dataclass(eq=False)
class Request:
    """An added sequence. ``prompt`` (P,) int32 token ids; ``chain``: the sampler chain built from
    ``params``; ``rng``: its generator; ``admitted``: ``time.perf_counter()`` seconds at add;
    ``constraint``: structured output (``params.grammar``), or None; ``priority``: lower first under
    the "priority" policy; ``arrival`` / ``order``: add and start counters (``order`` picks the
    newest running request for preemption); ``row``: its batch row while running, -1 while waiting;
    ``kv``: its block table; ``num_cached_tokens``: prompt tokens found in the prefix cache at its
    first start (None before); ``spec``: its speculation state (None: it never speculates)."""

    seq_id: int
    prompt: np.ndarray
    params: SamplingParams
    chain: Chain
    rng: np.random.Generator
    admitted: float
    constraint: TokenConstraint | None = None
    priority: int = 0
    arrival: int = 0
    order: int = 0
    row: int = -1
    num_computed_tokens: int = 0
    num_tokens: int = 0
    output: list[int] = field(default_factory=list)
    kv: SeqBlocks = field(default_factory=SeqBlocks)
    num_cached_tokens: int | None = None
    spec: SpecState | None = None
    finished: bool = False

    def __post_init__(self) -> None:
        self.num_tokens = self.num_tokens or len(self.prompt)

    @property
    def num_sampled(self) -> int:
        """Tokens sampled so far (landed or in flight)."""
        return self.num_tokens - len(self.prompt)

    @property
    def in_flight(self) -> bool:
        """A sampled token has not landed on the host yet."""
        return self.num_sampled > len(self.output)

    @property
    def prefill_end(self) -> int:
        """Positions to compute before decoding: the prompt; after a preemption every token but
        the last, which is then decoded (the step it feeds samples the next token, as it would
        have without the preemption)."""
        return self.num_tokens if self.num_sampled == 0 else self.num_tokens - 1

    @property
    def prefilling(self) -> bool:
        """Positions before :attr:`prefill_end` still lack their K/V."""
        return self.num_computed_tokens < self.prefill_end

    @property
    def decoding(self) -> bool:
        """Prefilled, with a sampled token to feed and fewer than ``max_new_tokens`` sampled."""
        return not self.prefilling and 1 <= self.num_sampled < self.params.max_new_tokens

    def tokens(self) -> np.ndarray:
        """Prompt + landed output, (P + len(output),) int32."""
        if not self.output:
            return self.prompt
        return np.concatenate([self.prompt, np.asarray(self.output, dtype=np.int32)])
