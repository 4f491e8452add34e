"""Engine sampling options and outputs on the tiny float32 checkpoint: rows with different
options batched equal each alone (exact), min_tokens, logit_bias, penalties, logprobs against a
plain forward, constraints (a hand-written TokenConstraint), and n > 1 sharing the prompt's prefill."""

from __future__ import annotations

import math

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlx_serving.models.generation import Engine, EngineConfig
from mlx_serving.models.generation.events import FinishReason, SeqEvent
from mlx_serving.models.generation.sampling import SamplingParams
from mlx_serving.models.decoder.kv_cache import kv_bytes_per_token
from paged import fresh
from mlx_serving.models.decoder.layers import forward


def _prompt(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 151000, n)]


MIXED = [  # (prompt, params): every option, in rows that differ
    (_prompt(11, 6), SamplingParams(max_new_tokens=8)),
    (_prompt(12, 19), SamplingParams(max_new_tokens=7, temperature=0.9, top_k=20, seed=1, logprobs=2)),
    (_prompt(13, 3), SamplingParams(max_new_tokens=9, temperature=1.2, top_p=0.8, min_p=0.05, seed=2)),
    (_prompt(14, 11), SamplingParams(max_new_tokens=6, repetition_penalty=1.5, presence_penalty=0.5,
                                     frequency_penalty=0.3, logprobs=0)),
    (_prompt(15, 8), SamplingParams(max_new_tokens=8, temperature=0.7, logit_bias={5: 3.0, 9: -4.0},
                                    min_tokens=4, eos_token_ids=(5,), seed=3)),
    (_prompt(16, 25), SamplingParams(max_new_tokens=10, temperature=1.5, frequency_penalty=1.0, top_k=50,
                                     top_p=0.9, seed=4, logprobs=5)),
]


def run(engine: Engine, requests, arrivals: list[int] | None = None, max_steps: int = 400) -> dict[int, list[SeqEvent]]:
    """Add request i at step ``arrivals[i]`` (default all at 0) and step until all finish."""
    arrivals = arrivals or [0] * len(requests)
    out: dict[int, list[SeqEvent]] = {i: [] for i in range(len(requests))}
    for step in range(max_steps):
        for i, a in enumerate(arrivals):
            if a == step:
                engine.add(i, *requests[i])
        if step > max(arrivals) and not engine.num_active:
            return out
        for ev in engine.step():
            assert not out[ev.seq_id] or out[ev.seq_id][-1].finish_reason is None
            out[ev.seq_id].append(ev)
    raise AssertionError("engine did not finish")


def tokens(events: list[SeqEvent]) -> list[int]:
    return [e.token_id for e in events]


@pytest.fixture(scope="module")
def solo(tiny32) -> list[list[SeqEvent]]:
    return [run(Engine(tiny32, EngineConfig.of(max_batch=1, max_len=64)), [r])[0] for r in MIXED]


@pytest.mark.parametrize("max_batch, chunk, arrivals", [(8, 512, None), (3, 5, [0, 2, 2, 0, 5, 1])])
def test_mixed_options_batched_equal_solo(tiny32, solo, max_batch, chunk, arrivals) -> None:
    out = run(Engine(tiny32, EngineConfig.of(max_batch=max_batch, max_len=64, prefill_chunk=chunk)), MIXED, arrivals)
    for i, ref in enumerate(solo):
        assert tokens(out[i]) == tokens(ref), f"request {i}"
        assert [(e.logprob, e.top_logprobs) for e in out[i]] == [(e.logprob, e.top_logprobs) for e in ref]
        assert out[i][-1].finish_reason is not None


def test_logprobs_only_when_asked(solo) -> None:
    for (_, p), events in zip(MIXED, solo):
        for e in events:
            if p.logprobs is None:
                assert e.logprob is None and e.top_logprobs is None
            else:
                assert e.logprob <= 0 and len(e.top_logprobs) == p.logprobs
                values = [v for _, v in e.top_logprobs]
                assert values == sorted(values, reverse=True)


def _last_logits(state, ids: list[int]) -> np.ndarray:
    """A plain dense forward over ``ids``: the last position's float32 logits (V,)."""
    n = len(ids)
    z = mx.zeros((1,), dtype=mx.int32)
    kv = fresh(state, n + 1)
    rows = kv.rows(mx.array([ids], dtype=mx.int32), z, mx.array([n], dtype=mx.int32), n,
                   mx.array([n - 1], dtype=mx.int32), dense=True)
    return np.array(forward(state, kv.cache, rows)[0]).astype(np.float64)


def test_logprobs_equal_log_softmax_of_a_plain_forward(tiny32) -> None:
    prompt = _prompt(21, 9)
    events = run(Engine(tiny32, EngineConfig.of(max_batch=2, max_len=64)), [(prompt, SamplingParams(max_new_tokens=4,
                                                                                                    logprobs=5))])[0]
    ids = list(prompt)
    for e in events:
        z = _last_logits(tiny32, ids)
        ref = z - (np.log(np.exp(z - z.max()).sum()) + z.max())
        assert e.token_id == int(np.argmax(z))
        assert e.logprob == pytest.approx(ref[e.token_id], abs=2e-4)
        assert [t for t, _ in e.top_logprobs] == list(np.argsort(-ref)[:5])
        assert [v for _, v in e.top_logprobs] == pytest.approx(np.sort(ref)[::-1][:5], abs=2e-4)
        ids.append(e.token_id)


def test_min_tokens_suppresses_eos(tiny32) -> None:
    prompt = _prompt(31, 7)
    solo = EngineConfig.of(max_batch=1, max_len=64)
    greedy = tokens(run(Engine(tiny32, solo), [(prompt, SamplingParams(max_new_tokens=6))])[0])
    eos = greedy[0]  # the model's first greedy token, declared EOS
    stop = run(Engine(tiny32, solo), [(prompt, SamplingParams(max_new_tokens=6, eos_token_ids=(eos,)))])[0]
    assert tokens(stop) == [eos] and stop[-1].finish_reason == FinishReason.STOP
    late = run(Engine(tiny32, solo), [(prompt, SamplingParams(max_new_tokens=6, eos_token_ids=(eos,),
                                                               min_tokens=3))])[0]
    assert eos not in tokens(late)[:3] and len(late) >= 3


def test_logit_bias_forces_a_token(tiny32) -> None:
    reqs = [(_prompt(41, 5), SamplingParams(max_new_tokens=5, logit_bias={777: 100.0})),
            (_prompt(42, 9), SamplingParams(max_new_tokens=5, temperature=1.0, seed=1, logit_bias={777: 100.0}))]
    out = run(Engine(tiny32, EngineConfig.of(max_batch=2, max_len=64)), reqs)
    assert tokens(out[0]) == [777] * 5 and tokens(out[1]) == [777] * 5


def test_penalties_follow_their_formulas_on_the_model_logits(tiny32) -> None:
    """Greedy with every penalty: each token is the argmax, and its logprob the log_softmax, of a
    plain forward's logits penalized in numpy (repetition over prompt + output, HF; presence and
    frequency over the output, OpenAI)."""
    prompt = _prompt(52, 8) + [777, 777]
    p = SamplingParams(max_new_tokens=6, repetition_penalty=1.7, presence_penalty=1.5, frequency_penalty=0.9,
                       logit_bias={777: 4.0}, logprobs=1)
    events = run(Engine(tiny32, EngineConfig.of(max_batch=2, max_len=64)), [(prompt, p)])[0]
    ids: list[int] = list(prompt)
    for e in events:
        z = _last_logits(tiny32, ids)
        z[777] += 4.0
        counts = np.bincount(ids[len(prompt):], minlength=z.size)
        seen = np.bincount(ids, minlength=z.size) > 0
        z = np.where(seen, np.where(z > 0, z / 1.7, z * 1.7), z) - 1.5 * (counts > 0) - 0.9 * counts
        ref = z - (np.log(np.exp(z - z.max()).sum()) + z.max())
        assert e.token_id == int(np.argmax(z))
        assert e.logprob == pytest.approx(ref[e.token_id], abs=2e-4)
        ids.append(e.token_id)


def test_penalties_change_output_as_expected(tiny32) -> None:
    """A token forced by a bias repeats; a frequency penalty (growing with its count) ends the run
    of repeats; a huge repetition penalty makes every token new (not in the prompt or output)."""
    prompt = _prompt(51, 6)
    bias = {777: 20.0}

    def gen(p: SamplingParams, ids: list[int] = prompt) -> list[int]:
        return tokens(run(Engine(tiny32, EngineConfig.of(max_batch=1, max_len=64)), [(ids, p)])[0])

    assert gen(SamplingParams(max_new_tokens=10, logit_bias=bias)) == [777] * 10
    pen = gen(SamplingParams(max_new_tokens=10, logit_bias=bias, frequency_penalty=2.0))
    assert pen[:3] == [777] * 3 and 3 <= pen.count(777) < 10
    assert gen(SamplingParams(max_new_tokens=1, logit_bias=bias), prompt + [777]) == [777]
    fresh = gen(SamplingParams(max_new_tokens=8, logit_bias={777: 5.0}, repetition_penalty=1e6), prompt + [777])
    assert 777 not in fresh and len(set(fresh)) == 8 and not set(fresh) & set(prompt)


def test_penalty_counts_survive_preemption(tiny32) -> None:
    """A pool of few blocks preempts penalized sequences; they recompute with the same counts."""
    reqs = [(_prompt(60 + i, 12), SamplingParams(max_new_tokens=20, frequency_penalty=1.5, presence_penalty=0.5,
                                                 repetition_penalty=1.2, temperature=0.8, seed=i)) for i in range(4)]
    alone = [tokens(run(Engine(tiny32, EngineConfig.of(max_batch=1, max_len=64)), [r])[0]) for r in reqs]
    engine = Engine(tiny32, EngineConfig.of(max_batch=4, max_len=64, block_size=4,
                                            kv_cache_bytes=_bytes_for_blocks(tiny32, 4, 22)))
    out = run(engine, reqs)
    assert engine.kv_stats().preemptions > 0
    assert [tokens(out[i]) for i in range(4)] == alone


def _bytes_for_blocks(state, block_size: int, blocks: int) -> int:
    return kv_bytes_per_token(state) * block_size * (blocks + 1)


def test_seeded_request_independent_of_batchmates(tiny32) -> None:
    p = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=40, min_p=0.02, seed=77)
    ref = tokens(run(Engine(tiny32, EngineConfig.of(max_batch=1, max_len=64)), [(_prompt(70, 10), p)])[0])
    others = [(_prompt(71 + i, 4 + i), replace(p, seed=None)) for i in range(3)]
    out = run(Engine(tiny32, EngineConfig.of(max_batch=4, max_len=64)), others + [(_prompt(70, 10), p)],
              arrivals=[0, 1, 0, 3])
    assert tokens(out[3]) == ref


# ---- constraints (a real TokenConstraint, hand-written) ---------------------------------------

VOCAB = 151936


class Script:
    """Allows exactly ``tokens`` in order, then (with ``eos``) only the EOS ids, else it is
    complete. Grammar spec: ``"script:<id>,<id>,..."``."""

    def __init__(self, tokens: list[int], eos: tuple[int, ...]):
        self.tokens, self.eos, self.accepted = tokens, eos, []

    def allowed(self) -> np.ndarray:
        mask = np.zeros(VOCAB, dtype=bool)
        i = len(self.accepted)
        mask[self.tokens[i] if i < len(self.tokens) else list(self.eos)] = True
        return mask

    def accept(self, token_id: int) -> None:
        assert self.allowed()[token_id], f"token {token_id} was not allowed"
        self.accepted.append(token_id)

    def is_stopped(self) -> bool:
        return len(self.accepted) >= len(self.tokens) and not self.eos


class Subset:
    """Allows the tokens of a fixed set at every step; never complete. Spec: ``"subset:<lo>:<hi>"``
    (ids in [lo, hi))."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi, self.accepted = lo, hi, []

    def allowed(self) -> np.ndarray:
        mask = np.zeros(VOCAB, dtype=bool)
        mask[self.lo : self.hi] = True
        return mask

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)

    def is_stopped(self) -> bool:
        return False


made: list[Script | Subset] = []


def factory(grammar: str, eos: tuple[int, ...]) -> Script | Subset:
    kind, _, arg = grammar.partition(":")
    if kind == "script":
        c: Script | Subset = Script([int(t) for t in arg.split(",")], eos)
    elif kind == "subset":
        c = Subset(*map(int, arg.split(":")))
    else:
        raise ValueError(f"grammar: unknown kind {kind!r}")
    made.append(c)
    return c


def test_constrained_rows_follow_their_masks_in_a_mixed_batch(tiny32, solo) -> None:
    reqs = list(MIXED) + [
        (_prompt(81, 5), SamplingParams(max_new_tokens=10, grammar="script:5,6,7,8")),
        (_prompt(82, 7), SamplingParams(max_new_tokens=10, temperature=1.0, seed=5, eos_token_ids=(2,),
                                        grammar="script:9,10")),
        (_prompt(83, 4), SamplingParams(max_new_tokens=6, temperature=1.3, seed=6, grammar="subset:1000:1010",
                                        logprobs=2)),
    ]
    made.clear()
    out = run(Engine(tiny32, EngineConfig.of(max_batch=4, max_len=64, prefill_chunk=6), constraint_factory=factory),
              reqs, [0, 1, 0, 2, 3, 0, 1, 0, 4])
    for i, ref in enumerate(solo):  # unconstrained rows are unchanged by their constrained batchmates
        assert tokens(out[i]) == tokens(ref), f"request {i}"
    n = len(MIXED)
    assert tokens(out[n]) == [5, 6, 7, 8] and out[n][-1].finish_reason == FinishReason.STOP  # is_stopped()
    assert tokens(out[n + 1]) == [9, 10, 2] and out[n + 1][-1].finish_reason == FinishReason.STOP  # EOS
    sub = out[n + 2]
    assert len(sub) == 6 and all(1000 <= t < 1010 for t in tokens(sub)) and len(set(tokens(sub))) > 1
    assert all(e.logprob > -30 and all(1000 <= t < 1010 for t, _ in e.top_logprobs) for e in sub)
    assert [c.accepted for c in made] == [[9, 10, 2], [5, 6, 7, 8], tokens(sub)]  # in add order


def test_blocked_tokens_are_never_among_the_top_logprobs(tiny32) -> None:
    """3 tokens allowed, 5 alternatives asked: the 3 allowed ones, finite, and nothing masked."""
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=2, grammar="subset:1000:1003", logprobs=5)
    events = run(Engine(tiny32, EngineConfig.of(max_batch=2, max_len=64), constraint_factory=factory), [(_prompt(84, 5), params)])[0]
    assert len(events) == 4
    for e in events:
        assert sorted(t for t, _ in e.top_logprobs) == [1000, 1001, 1002]
        assert all(math.isfinite(v) and v <= 0 for _, v in e.top_logprobs)


def test_grammar_needs_a_factory_and_bad_grammars_raise_in_add(tiny32) -> None:
    with pytest.raises(ValueError, match="constraint_factory"):
        Engine(tiny32, EngineConfig.of(max_batch=2, max_len=128)).add(0, [1, 2], SamplingParams(grammar="script:1"))
    engine = Engine(tiny32, EngineConfig.of(max_batch=2, max_len=128), constraint_factory=factory)
    with pytest.raises(ValueError, match="grammar"):
        engine.add(0, [1, 2], SamplingParams(grammar="nope"))
    assert engine.num_active == 0


# ---- n > 1: completions of one prompt prefill it once -------------------------------------------

@pytest.mark.parametrize("chunk", [512, 16])
def test_n_completions_share_one_prefill(tiny32, chunk) -> None:
    prompt = _prompt(91, 40)  # 2 full blocks of 16 reusable (the last token is always recomputed)
    reqs = [(prompt, SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=s, logprobs=1))
            for s in (10, 11, 12, 13)]
    alone = [run(Engine(tiny32, EngineConfig.of(max_batch=1, max_len=64)), [r])[0] for r in reqs]
    engine = Engine(tiny32, EngineConfig.of(max_batch=4, max_len=64, prefill_chunk=chunk))
    out = run(engine, reqs)
    for i in range(4):
        assert [(e.token_id, e.logprob) for e in out[i]] == [(e.token_id, e.logprob) for e in alone[i]]
    stats = engine.kv_stats()
    assert (stats.prefix_queries, stats.prefix_hits, stats.prefix_hit_tokens) == (4, 3, 3 * 32)
    assert stats.prefix_query_tokens - stats.prefix_hit_tokens == 40 + 3 * 8  # prefill tokens computed
    assert len({tuple(tokens(out[i])) for i in range(4)}) > 1  # their own seeds


def test_without_prefix_caching_each_completion_prefills(tiny32) -> None:
    reqs = [(_prompt(91, 40), SamplingParams(max_new_tokens=2, temperature=1.0, seed=s)) for s in range(3)]
    engine = Engine(tiny32, EngineConfig.of(max_batch=4, max_len=64, prefix_caching=False))
    run(engine, reqs)
    assert engine.kv_stats().prefix_hit_tokens == 0


def test_constrained_sequences_survive_preemption(tiny32) -> None:
    script = list(range(300, 316))
    reqs = [(_prompt(95 + i, 10), SamplingParams(max_new_tokens=20, temperature=1.0, seed=i,
                                                 grammar="subset:500:520" if i % 2 else "script:" + ",".join(map(str, script))))
            for i in range(4)]
    made.clear()
    alone = [tokens(run(Engine(tiny32, EngineConfig.of(max_batch=1, max_len=64), constraint_factory=factory),
                        [r])[0]) for r in reqs]
    engine = Engine(tiny32, EngineConfig.of(max_batch=4, max_len=64, block_size=4,
                                            kv_cache_bytes=_bytes_for_blocks(tiny32, 4, 20)),
                    constraint_factory=factory)
    out = run(engine, reqs)
    assert engine.kv_stats().preemptions > 0
    assert [tokens(out[i]) for i in range(4)] == alone
    assert alone[0] == script and all(500 <= t < 520 for t in alone[1])
