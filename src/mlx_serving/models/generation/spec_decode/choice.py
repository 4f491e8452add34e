"""How many draft tokens each decoding row proposes at a step: the k that pays most.

A row with draft-token acceptance ``alpha`` (each draft token accepted with that probability while
the ones before it were: Leviathan et al. 2023) whose proposer has a draft with probability
``reach`` emits ``1 + reach * (alpha + alpha^2 + ... + alpha^k)`` tokens in expectation from a
verify of k draft tokens; the step of all decoding rows costs what :class:`~.cost.StepCosts`
estimates for its one-token rows (each verify row's k + 1) and whether it verifies. The choice
maximises the step's expected emitted tokens per second (adaptive draft length as in SpecDec++,
Huang et al. 2024, and vLLM's dynamic speculation, Liu et al. 2024, here on measured step costs):
for each total m of draft tokens the best split gives each of the m tokens to the row whose next
draft token adds most (the gains ``reach * alpha^j`` fall with j, so this is optimal); the best m
wins, m = 0 (every row plain) unless a verify beats it by :data:`MARGIN`.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from .cost import StepCosts

__all__ = ["MARGIN", "Odds", "draft_lengths", "expected_tokens"]

#: Least relative gain in expected tokens per second for a step to verify instead of decoding
#: plainly (estimates are noisy on a shared machine; a verify also adds latency).
MARGIN = 0.05


class Odds(NamedTuple):
    """A speculating row's outlook: ``reach``, the probability that its proposer has a draft;
    ``alpha``, a draft token's acceptance probability (0..1); ``k_max``, the most draft tokens."""

    reach: float
    alpha: float
    k_max: int


def expected_tokens(odds: Odds, k: int) -> float:
    """Expected tokens a row emits from a step with ``k`` draft tokens (1 for k = 0)."""
    return 1 + odds.reach * sum(odds.alpha ** j for j in range(1, k + 1))


def draft_lengths(rows: Sequence[Odds | None], costs: StepCosts) -> list[int]:
    """Draft tokens for each of a step's decoding ``rows`` (None: a row that never speculates),
    0 for a plain decode, maximising expected emitted tokens per second under ``costs``; all 0
    while no step cost is known."""
    ks = [0] * len(rows)
    plain = costs.estimate(len(rows), False) if any(o is not None for o in rows) else None
    if not plain:
        return ks
    gains = sorted(((o.reach * o.alpha ** j, i) for i, o in enumerate(rows) if o is not None and o.alpha > 0
                    and o.reach > 0 for j in range(1, o.k_max + 1)), key=lambda g: -g[0])
    verify = costs.curve(True)
    best, best_rate, tokens = 0, len(rows) / plain * (1 + MARGIN), float(len(rows))
    for m, (gain, _) in enumerate(gains, 1):
        tokens += gain
        cost = verify(len(rows) + m)
        if cost is not None and tokens / cost > best_rate:
            best, best_rate = m, tokens / cost
    for _, i in gains[:best]:
        ks[i] += 1
    return ks
