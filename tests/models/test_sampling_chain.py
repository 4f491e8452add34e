"""The sampler chain (models/generation/logits.py) on a small fixed logit vector.

Distribution tests: each transform's empirical distribution over N = 20,000 seeded draws (one
batch of N identical rows, so a test takes milliseconds) is compared with the analytic one in
total variation (TV). Tolerance: for N iid draws from p, E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / N)
(Jensen), and one draw moves TV by at most 1/N, so by McDiarmid P(TV > E[TV] + t) <=
exp(-2 N t^2) = 1.3e-14 at t = 0.025. The draws are seeded: a pass is deterministic. Tokens the
analytic distribution excludes must never be drawn (exact).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_serving.models.generation.logits import RowInput, TokenHistory, make_chain, process, sample, sample_batch
from mlx_serving.models.generation.sampling import SamplingParams

Z = np.array([2.0, 1.5, 1.0, 0.6, 0.2, -0.4, -1.0, -3.0])  # fixed logits, V = 8
V = len(Z)
N = 20_000


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z[np.isfinite(z)].max())
    return e / e.sum()


def _draw(params: SamplingParams, z: np.ndarray = Z, history: TokenHistory | None = None,
          generated: int = 0, seed: int = 0) -> np.ndarray:
    """N draws of ``params`` on logits ``z`` (one batch of N rows): empirical frequencies (V,)."""
    chain = make_chain(params, V)
    rng = np.random.default_rng(seed)
    rows = [RowInput(chain, i, generated, None, rng) for i in range(N)]
    logits = mx.array(np.tile(z, (N, 1)).astype(np.float32))
    tokens = np.array(sample_batch(logits, rows, history).tokens)
    return np.bincount(tokens, minlength=V) / N


def _assert_matches(freq: np.ndarray, p: np.ndarray) -> None:
    bound = 0.5 * np.sqrt(p * (1 - p) / N).sum() + 0.025
    tv = 0.5 * np.abs(freq - p).sum()
    assert tv <= bound, f"TV {tv:.4f} > {bound:.4f}: {freq.round(4)} vs {p.round(4)}"
    assert (freq[p == 0] == 0).all(), "an excluded token was drawn"


def _nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """Holtzman et al.: the smallest prefix (decreasing p) whose mass reaches top_p, renormalized."""
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    keep[order[: int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1]] = True
    q = np.where(keep, p, 0)
    return q / q.sum()


def _top_k(p: np.ndarray, k: int) -> np.ndarray:
    q = np.where(p >= np.sort(p)[-k], p, 0)
    return q / q.sum()


def _min_p(p: np.ndarray, min_p: float) -> np.ndarray:
    q = np.where(p >= min_p * p.max(), p, 0)
    return q / q.sum()


def _history(prompt: list[int], generated: list[int]) -> TokenHistory:
    h = TokenHistory(1, V)
    h.reset(0, np.array(prompt), generated)
    h.counts = mx.broadcast_to(h.counts, (N, V))
    h.prompt = mx.broadcast_to(h.prompt, (N, V))
    return h


def test_temperature() -> None:
    _assert_matches(_draw(SamplingParams(temperature=0.7)), _softmax(Z / 0.7))
    _assert_matches(_draw(SamplingParams(temperature=2.5)), _softmax(Z / 2.5))


@pytest.mark.parametrize("k", [1, 3, 7, V])
def test_top_k(k: int) -> None:
    _assert_matches(_draw(SamplingParams(temperature=1.0, top_k=k)), _top_k(_softmax(Z), k))


@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.95])
def test_top_p(top_p: float) -> None:
    _assert_matches(_draw(SamplingParams(temperature=1.0, top_p=top_p)), _nucleus(_softmax(Z), top_p))


@pytest.mark.parametrize("min_p", [0.1, 0.4])
def test_min_p(min_p: float) -> None:
    _assert_matches(_draw(SamplingParams(temperature=1.0, min_p=min_p)), _min_p(_softmax(Z), min_p))


def test_filters_compose_in_vllm_order() -> None:
    """temperature -> top-k -> top-p over the renormalized top-k -> min-p."""
    p13 = _softmax(Z / 1.3)
    expected = _nucleus(_top_k(p13, 5), 0.75)
    _assert_matches(_draw(SamplingParams(temperature=1.3, top_k=5, top_p=0.75)), expected)
    assert (expected > 0).sum() == 3 and (_nucleus(p13, 0.75) > 0).sum() == 4  # renormalizing matters
    expected = _min_p(_nucleus(_top_k(p13, 5), 0.9), 0.4)
    _assert_matches(_draw(SamplingParams(temperature=1.3, top_k=5, top_p=0.9, min_p=0.4)), expected)
    assert (expected > 0).sum() == 3


def test_logit_bias() -> None:
    p = SamplingParams(temperature=1.0, logit_bias={7: 5.0, 0: -2.0})
    _assert_matches(_draw(p), _softmax(Z + np.eye(V)[7] * 5.0 - np.eye(V)[0] * 2.0))


def test_min_tokens_masks_eos_until_reached() -> None:
    p = SamplingParams(temperature=1.0, min_tokens=3, eos_token_ids=(0, 2))
    masked = Z.copy()
    masked[[0, 2]] = -np.inf
    _assert_matches(_draw(p, generated=2), _softmax(masked))
    _assert_matches(_draw(p, generated=3), _softmax(Z))


def test_repetition_penalty() -> None:
    """HF / mlx-lm: seen tokens (prompt or output): positive logits / penalty, negative x penalty."""
    z = Z.copy()
    z[4] = -0.2  # a seen negative logit
    seen = [0, 4, 6]
    ref = z.copy()
    ref[seen] = np.where(z[seen] > 0, z[seen] / 1.8, z[seen] * 1.8)
    p = SamplingParams(temperature=1.0, repetition_penalty=1.8)
    _assert_matches(_draw(p, z, _history(prompt=[0, 4], generated=[6])), _softmax(ref))


def test_presence_and_frequency_penalties() -> None:
    """OpenAI: logit - presence * [count > 0] - frequency * count, over generated tokens only."""
    counts = np.bincount([0, 0, 0, 1, 5], minlength=V)
    ref = Z - 0.8 * (counts > 0) - 0.5 * counts
    p = SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.5)
    _assert_matches(_draw(p, history=_history(prompt=[2, 3], generated=[0, 0, 0, 1, 5])), _softmax(ref))


def test_greedy_rows_take_argmax_of_processed_logits() -> None:
    rows = [RowInput(make_chain(SamplingParams(), V)),
            RowInput(make_chain(SamplingParams(logit_bias={5: 10.0}), V)),
            RowInput(make_chain(SamplingParams(min_tokens=1, eos_token_ids=(0,)), V))]
    tokens = sample(process(mx.array(np.tile(Z, (3, 1)).astype(np.float32)), rows), rows)
    assert np.array(tokens).tolist() == [0, 5, 1]


def _mixed_rows() -> list[SamplingParams]:
    return [SamplingParams(), SamplingParams(temperature=0.9, top_k=3, seed=1),
            SamplingParams(temperature=1.1, top_p=0.6, min_p=0.05, logit_bias={3: 1.5}),
            SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2, logprobs=3),
            SamplingParams(temperature=0.5, min_tokens=2, eos_token_ids=(0,), logprobs=0),
            SamplingParams(temperature=1.7, min_p=0.2, frequency_penalty=-0.5),
            SamplingParams(temperature=1.0, top_k=5, top_p=0.7, min_p=0.01, seed=2),
            SamplingParams(temperature=0.6, top_k=3, logprobs=1),
            SamplingParams(temperature=1.0, top_p=0.9, logprobs=3, logit_bias={0: -1.0})]


def test_rows_are_bit_identical_alone_and_batched() -> None:
    """Neutral values leave a row untouched: each row's token and logprobs alone equal the batch's."""
    params = _mixed_rows()
    z = np.random.default_rng(1).normal(size=(len(params), 64)).astype(np.float32) * 3
    history = TokenHistory(len(params), 64)
    for i in range(len(params)):
        history.reset(i, np.array([1, 2, i]), [3, 3, i + 10])
    u = np.random.default_rng(2).random(len(params))

    def run(idx: list[int]):
        rows = [RowInput(make_chain(params[i], 64), i, 1) for i in idx]
        x = process(mx.array(z[idx]), rows, history)
        sampled = [j for j, i in enumerate(idx) if not rows[j].chain.greedy]
        return np.array(x), np.array(sample(x, rows, u[[idx[j] for j in sampled]]))

    x_all, t_all = run(list(range(len(params))))
    for i in range(len(params)):
        x_one, t_one = run([i])
        assert np.array_equal(x_one[0], x_all[i]) and t_one[0] == t_all[i], f"row {i}"


def test_penalty_counts_are_updated_on_device_from_sampled_tokens() -> None:
    chain = make_chain(SamplingParams(frequency_penalty=0.6), V)
    history = TokenHistory(2, V)
    history.reset(1, np.array([7]), [])
    logits = mx.array(np.tile(Z, (1, 1)).astype(np.float32))
    seen = []
    for _ in range(4):  # the frequency penalty walks greedy decoding down the logits
        out = sample_batch(logits, [RowInput(chain, 1)], history)
        seen.append(int(out.tokens[0]))
    assert seen == [0, 1, 0, 2]
    assert np.array(history.counts[1]).tolist() == [2, 1, 1, 0, 0, 0, 0, 0]
    assert np.array(history.counts[0]).sum() == 0


def test_logprobs_are_log_softmax_of_processed_logits() -> None:
    params = SamplingParams(temperature=2.0, top_k=2, logit_bias={6: 4.0}, logprobs=4, seed=0)
    rows = [RowInput(make_chain(params, V), 0, 0, None, np.random.default_rng(0))]
    out = sample_batch(mx.array(Z[None].astype(np.float32)), rows)
    [(chosen, top)] = out.logprobs.to_host()
    z = Z + np.eye(V)[6] * 4.0
    ref = z - math.log(np.exp(z).sum())  # before temperature and top-k
    token = int(out.tokens[0])
    assert chosen == pytest.approx(ref[token], abs=1e-5)
    assert [t for t, _ in top] == list(np.argsort(-ref)[:4])
    assert [v for _, v in top] == pytest.approx(sorted(ref, reverse=True)[:4], abs=1e-5)


def test_stages_no_row_uses_add_no_work() -> None:
    rows = [RowInput(make_chain(SamplingParams(), V))] * 2
    logits = mx.array(np.tile(Z, (2, 1)).astype(np.float32)).astype(mx.bfloat16)
    assert process(logits, rows) is logits  # no cast, no processor
    out = sample_batch(logits, rows)
    assert out.logprobs is None and out.pending == []


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.5), SamplingParams(logit_bias={1: 2.0}),
                                    SamplingParams(min_tokens=2, eos_token_ids=(3,)), SamplingParams(logprobs=0),
                                    SamplingParams(repetition_penalty=1.1), SamplingParams(grammar="g")])
def test_only_a_plain_greedy_chain_is_argmax_only(params: SamplingParams) -> None:
    """The engine skips sample_batch for argmax_only chains: any stage must clear the flag."""
    assert make_chain(SamplingParams(), V).argmax_only
    assert not make_chain(params, V).argmax_only


def test_logit_bias_ids_are_checked_against_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        make_chain(SamplingParams(logit_bias={V: 1.0}), V)
