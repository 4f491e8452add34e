"""Speculative decoding inside continuous batching (models/generation/spec_decode): n-gram drafts
verified in the step's ragged forward.

Invariants (tiny float32 checkpoint, exact token equality): greedy output with speculation ==
without, in batches, with preemption, prefix caching on and off, chunked prefill and
cancellation; seeded sampled output too (one uniform per emitted token); block accounting returns
to all-free. The accept rule (sample at every position, accept while the sample equals the draft)
is the rejection sampler for a point-mass draft: checked by chi-square against the target
distribution, in isolation and through the engine. Rows with penalties, a grammar or logprobs never
speculate. Config by name.
"""

from __future__ import annotations

import argparse
import json
import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_serving.models.decoder.kv_cache import kv_bytes_per_token
from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from mlx_serving.models.loader import load
from mlx_serving.models.seeded_checkpoint import write_checkpoint
from mlx_serving.models.generation.logits import RowInput, make_chain, sample_batch
from mlx_serving.models.generation.spec_decode import (NgramProposer, Odds, SpecState, Speculator, StepCosts, accepted,
                                                       draft_lengths)
from mlx_serving.models.generation.spec_decode.adaptive import ALPHA
from mlx_serving.models.generation.spec_decode.choice import expected_tokens
from mlx_serving.models.generation.spec_decode.cost import ROW_PRIOR
from mlx_serving.models.text_generation import GenerationOptions

from engine_runs import run_to_end as _run

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random 10-token phrase (drafts find matches in them and in the
    loops the tiny model falls into)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = [int(x) for x in rng.integers(0, 1000, 10)]
        out.append((base * 3 + base[: i % 7])[: 20 + 3 * i])
    return out


def _all_free(engine: Engine) -> None:
    s = engine.kv_stats()
    pool = engine.scheduler.kv.pool
    assert s.blocks_used == 0 and s.blocks_free == s.blocks_total
    assert all(pool.refcount(b) == 0 for b in range(pool.num_blocks + 1))


def _eager(state, **config) -> Engine:
    """An engine whose speculating rows propose at every decode step (no evidence needed)."""
    engine = Engine(state, EngineConfig.of(speculative_config=SPEC, **config))
    assert engine.speculator is not None
    engine.speculator.eager = True
    return engine


def _pair(state, prompts, params, cancel=None, **config) -> tuple[dict, dict, Engine]:
    plain = Engine(state, EngineConfig.of(**config))
    spec = _eager(state, **config)
    a, b = _run(plain, prompts, params, cancel), _run(spec, prompts, params, cancel)
    _all_free(plain)
    _all_free(spec)
    return a, b, spec


@pytest.mark.parametrize("caching, chunk", [(True, 512), (False, 7)])
def test_greedy_is_token_identical_in_batches_with_preemption(tiny32, caching, chunk):
    """12 prompts on 4 rows and 12 blocks: sequences are preempted and recomputed mid-speculation;
    every token equals decoding without speculation, drafts were verified and accepted."""
    prompts = _prompts(12)
    params = [SamplingParams(max_new_tokens=30 + i) for i in range(12)]
    budget = kv_bytes_per_token(tiny32) * 16 * 12
    a, b, spec = _pair(tiny32, prompts, params, max_batch=4, max_len=128, prefill_chunk=chunk,
                       kv_cache_bytes=budget, prefix_caching=caching)
    assert a == b
    stats = spec.spec_decode_stats()
    assert stats["spec_decode_num_drafts"] > 10 and stats["spec_decode_num_accepted_tokens"] > 10
    assert spec.kv_stats().preemptions > 0


def test_native_verify_is_the_decode_step_token_for_token(tiny):
    """On the native CPU path (4-bit weights) a verify row runs as one-token rows of the decode
    step: greedy output equals decoding without speculation, token for token, in batches."""
    prompts = _prompts(8, seed=3)
    params = [SamplingParams(max_new_tokens=40 + i) for i in range(8)]
    a, b, spec = _pair(tiny, prompts, params, max_batch=4, max_len=128, prefill_chunk=16)
    assert spec.decode_backend.verifies_as_rows  # the native step, not the multi-token forward
    assert a == b
    stats = spec.spec_decode_stats()
    assert stats["spec_decode_num_drafts"] > 10 and stats["spec_decode_num_accepted_tokens"] > 0


def test_prefix_hits_and_shared_prompts_stay_identical(tiny32):
    """n completions of one prompt (prefix hits, blocks shared) next to other rows."""
    prompts = [_prompts(1, seed=3)[0]] * 4 + _prompts(3, seed=4)
    params = [SamplingParams(max_new_tokens=24)] * 7
    a, b, spec = _pair(tiny32, prompts, params, max_batch=7, max_len=96)
    assert a == b
    assert spec.kv_stats().prefix_hits >= 3 and spec.spec_decode_stats()["spec_decode_num_accepted_tokens"] > 0


def test_seeded_sampling_is_identical_with_every_exact_option(tiny32):
    """Sampled rows (temperature, top-k, top-p, min-p, logit_bias, min_tokens) emit, seed for seed,
    what they emit without speculation: every emitted token is the sample plain decoding draws
    with the same uniform."""
    prompts = _prompts(8, seed=5)
    options = [dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=0.9, top_p=0.8),
               dict(temperature=1.2, min_p=0.2), dict(temperature=1.0),
               dict(temperature=0.8, min_tokens=20, eos_token_ids=(prompts[5][2],)),
               dict(min_tokens=25, eos_token_ids=(prompts[6][1],)),
               dict(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1)]
    params = [SamplingParams(max_new_tokens=28, seed=i, logit_bias={t: 7.0 for t in prompts[i][:4]}, **o)
              for i, o in enumerate(options)]  # the bias makes the prompt's phrase likely: drafts match
    a, b, spec = _pair(tiny32, prompts, params, max_batch=8, max_len=96)
    assert a == b
    assert spec.spec_decode_stats()["spec_decode_num_accepted_tokens"] > 5


def test_rows_that_cannot_be_exact_do_not_speculate(tiny32):
    """Penalties, logprobs and grammars would need per-position device state: such rows decode
    plainly next to speculating ones, and nothing changes."""
    prompts = _prompts(3, seed=6)
    params = [SamplingParams(max_new_tokens=20, repetition_penalty=1.3),
              SamplingParams(max_new_tokens=20, logprobs=2), SamplingParams(max_new_tokens=20)]
    plain, spec = Engine(tiny32, EngineConfig.of(max_batch=3, max_len=96)), _eager(tiny32, max_batch=3, max_len=96)
    assert spec.speculator is not None
    assert [spec.speculator.new_state(p) is None for p in params] == [True, True, False]
    assert spec.speculator.new_state(SamplingParams(grammar="{}")) is None
    assert _run(plain, prompts, params) == _run(spec, prompts, params)
    _all_free(spec)


def test_cancellation_mid_verify_frees_every_block(tiny32):
    prompts = _prompts(6, seed=7)
    params = [SamplingParams(max_new_tokens=40)] * 6
    cancel = {1: 6, 3: 9, 4: 14}
    a, b, _ = _pair(tiny32, prompts, params, cancel=cancel, max_batch=3, max_len=128)
    assert {i: v for i, v in a.items() if i not in cancel} == {i: v for i, v in b.items() if i not in cancel}
    for i in cancel:  # a cancelled row's tokens are a prefix of what it would have generated
        assert b.get(i, []) == a[i][: len(b.get(i, []))] or a.get(i, []) == b[i][: len(a.get(i, []))]


def test_max_new_tokens_and_eos_inside_an_accepted_draft(tiny32):
    """A verify never emits past max_new_tokens, and an EOS among accepted tokens ends the row
    there (the rest is dropped), as without speculation."""
    prompts = _prompts(4, seed=8)
    plain = _run(Engine(tiny32, EngineConfig.of(max_batch=4, max_len=96)), prompts,
                 [SamplingParams(max_new_tokens=30)] * 4)
    eos = [(plain[i][20],) for i in range(4)]  # a token that occurs late in each output
    params = [SamplingParams(max_new_tokens=7 + i, eos_token_ids=eos[i] if i % 2 else ()) for i in range(4)]
    a, b, _ = _pair(tiny32, prompts, params, max_batch=4, max_len=96)
    assert a == b and all(len(b[i]) <= 7 + i for i in range(4))


# ---- the accept rule is the rejection sampler of a point-mass draft -------------------------


def _chi2_ok(observed: np.ndarray, expected: np.ndarray) -> bool:
    """Pearson's chi-square below its 99.9% quantile (Wilson-Hilferty approximation)."""
    keep = expected > 0
    stat = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.09  # the 99.9% normal quantile
    return stat < df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("draft", [0, 3, 5])
def test_accept_rule_preserves_the_target_distribution(draft):
    """At a fixed context with target p (temperature, top-k and top-p applied): the draft is
    accepted with probability p(draft) and the emitted token is distributed as p, whatever the
    draft (chi-square over 20,000 draws)."""
    logits = mx.array([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    params = SamplingParams(max_new_tokens=2, temperature=0.8, top_k=6, top_p=0.95, seed=0)
    chain = make_chain(params, 8)
    n = 20_000
    rng = np.random.default_rng(11)
    rows = [RowInput(chain, 0, 0, None, rng) for _ in range(n)]
    samples = np.array(sample_batch(mx.repeat(logits, n, axis=0), rows).tokens)
    emitted = np.array([s if accepted(np.array([draft]), np.array([s, s])) else s for s in samples])
    acc = np.mean([accepted(np.array([draft]), np.array([s, 0])) for s in samples])
    z = np.array(logits[0]) / 0.8
    p = np.exp(z - z.max())
    p[np.argsort(-p)[6:]] = 0  # top-k 6
    p /= p.sum()
    order = np.argsort(-p)
    cum = np.cumsum(p[order])
    p[order[np.searchsorted(cum, 0.95) + 1:]] = 0  # the nucleus keeps the token crossing 0.95
    p /= p.sum()
    assert abs(acc - p[draft]) < 4 * math.sqrt(p[draft] * (1 - p[draft]) / n) + 1e-9
    assert _chi2_ok(np.bincount(emitted, minlength=8).astype(float), n * p)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory: pytest.TempPathFactory):
    """The tiny float32 checkpoint with a 512-token vocabulary: a sampled position costs ~300x
    less than over Qwen's 151,936 tokens, so the distribution test affords many draws."""
    return load(write_checkpoint(tmp_path_factory.mktemp("qwen3") / "v512", "tiny", seed=0, quantized=False,
                                 dtype="float32", config_overrides={"vocab_size": 512}))


def test_engine_sampled_distribution_matches_plain_decoding(small_vocab):
    """Through the engine, different seeds on each side: the 1,920 tokens emitted at positions
    1-60 of 32 rows (about half from accepted drafts, the rest after rejections) have the
    distribution of plain decoding (two-sample chi-square over the two tokens logit_bias makes
    likely and the rest)."""
    base = [5] * 12
    bias = {5: 23.0, 6: 24.5, 7: 22.5}  # here p(5) ~ 0.8, p(7) ~ 0.19: drafts of 5s, often rejected
    counts = []
    for on, seeds in ((False, range(0, 32)), (True, range(1000, 1032))):
        config = dict(max_batch=32, max_len=80)
        engine = _eager(small_vocab, **config) if on else Engine(small_vocab, EngineConfig.of(**config))
        params = [SamplingParams(max_new_tokens=61, temperature=1.0, logit_bias=bias, seed=s) for s in seeds]
        out = _run(engine, [base] * len(params), params)
        tokens = np.concatenate([v[1:] for v in out.values()])
        counts.append(np.array([(tokens == 5).sum(), (tokens == 7).sum(), (~np.isin(tokens, [5, 7])).sum()]))
        if on:
            stats = engine.spec_decode_stats()
            assert stats["spec_decode_num_accepted_tokens"] > 500
            assert stats["spec_decode_num_drafts"] - stats["spec_decode_num_accepted_tokens_per_pos_0"] > 100
    table = np.array(counts, dtype=float)
    assert table.sum() == 2 * 32 * 60 and table[:, 2].min() >= 5
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    assert stat < 13.82  # chi-square, 2 degrees of freedom, 99.9%


# ---- parts ----------------------------------------------------------------------------------


def test_ngram_proposer_takes_the_longest_match_with_room():
    p = NgramProposer(2, 3)
    t = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4], dtype=np.int32)
    assert p.propose(t, 2).tolist() == [7, 8]  # "2 3 4": the latest earlier occurrence
    assert p.propose(t, 9).tolist() == [5, 9, 2, 3, 4, 7, 8, 2, 3]  # none has 9 after it: the earliest
    assert p.propose(np.array([1, 2, 3, 1, 9], dtype=np.int32), 3).size == 0  # "1 9" never occurred
    assert NgramProposer(1, 1).propose(np.array([1, 2, 3, 1], dtype=np.int32), 3).tolist() == [2, 3, 1]
    assert p.propose(t, 0).size == 0
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(3, 2)


def _ngram_by_definition(min_n: int, max_n: int, t: list[int], k: int) -> list[int]:
    """The n-gram draft as the proposer's docstring defines it, by brute force."""
    if k < 1:
        return []
    for n in range(min(max_n, len(t) - 1), min_n - 1, -1):
        starts = [s for s in range(len(t) - n) if t[s : s + n] == t[len(t) - n :]]  # each followed by a token
        if starts:
            roomy = [s for s in starts if s + n + k <= len(t)]
            start = (roomy[-1] if roomy else starts[0]) + n
            return t[start : start + k]
    return []


def test_ngram_proposer_matches_its_definition_on_random_streams():
    """Small vocabularies (many repeats, overlapping occurrences), every n range and k, short and
    empty streams: the vectorized lookup gives the brute-force draft, int32."""
    rng = np.random.default_rng(7)
    for _ in range(3000):
        lo, hi = sorted(int(x) for x in rng.integers(1, 6, 2))
        t = rng.integers(0, int(rng.integers(1, 5)), int(rng.integers(0, 30))).astype(np.int32)
        k = int(rng.integers(0, 6))
        draft = NgramProposer(lo, hi).propose(t, k)
        assert draft.dtype == np.int32
        assert draft.tolist() == _ngram_by_definition(lo, hi, t.tolist(), k), (lo, hi, t.tolist(), k)


def test_adaptive_state_learns_from_shadow_drafts_and_verifies():
    """A row's alpha (hits / (hits + misses + 1)) starts at 0 and follows shadow outcomes (landed
    plain tokens against the draft a verify would have checked) and real ones; reach follows
    whether the proposer had a draft."""
    s = SpecState(4)
    assert s.alpha == 0 and s.reach == 1 and not s.tick()
    s.shadow = np.array([7, 8, 9, 1], dtype=np.int32)
    assert [s.witness(t) for t in (7, 8)] == [False, False]  # matching: the draft is still pending
    assert s.witness(5)  # differs at the third position: 2 accepted, one miss, a new shadow draft is due
    assert (s.hits, s.misses, s.alpha) == (2, 1, 0.5) and s.shadow.size == 0 and s.witness(3)
    s.shadow = np.array([1, 2], dtype=np.int32)
    assert [s.witness(t) for t in (1, 2, 6)] == [False, False, True]  # the whole draft, then the bonus token
    keep = 1 - ALPHA
    assert (s.hits, s.misses) == (2 * keep + 2, keep)
    s.no_draft()
    assert s.reach == 1 - ALPHA and s.odds() == Odds(1 - ALPHA, s.alpha, 4)
    s.observe(3, 0)
    assert s.hits == (2 * keep + 2) * keep and s.misses == keep * keep + 1
    s.go = True
    assert s.tick() and not s.tick()  # a pick is for one step


def _linear(plain: float, per_row: float, sync: float, rows: int = 64) -> StepCosts:
    """Step costs plain + per_row * n, a verifying step sync more, frozen."""
    table = {(v, n): plain + per_row * n + sync * v for v in (False, True) for n in range(1, rows + 1)}
    return StepCosts(table, frozen=True)


def test_draft_lengths_maximise_expected_tokens_per_second():
    """The choice is a pure function of the step costs and the rows' odds: k where a verify's
    expected tokens per second beat the plain step's, k = 0 where they do not (drafts that fail,
    or rows as costly as today's native CPU rows), longer drafts for rows more likely accepted."""
    copying, chatting = Odds(1.0, 0.9, 4), Odds(0.5, 0.2, 4)
    cheap = _linear(10.0, 1.0, 1.0)  # a row adds a tenth of a step: the packed GEMM's hope
    assert draft_lengths([copying], cheap) == [4]
    assert draft_lengths([chatting], cheap) == [0]  # 1 + 0.1 tokens for 2 more units of 11: no
    assert draft_lengths([copying, chatting, None], cheap) == [4, 0, 0]
    proportional = _linear(0.0, 10.0, 2.0)  # k + 1 rows cost k + 1 one-row steps (issue 41's figures)
    assert draft_lengths([copying], proportional) == [0] and draft_lengths([Odds(1.0, 0.99, 4)], proportional) == [0]
    middle = _linear(10.0, 4.0, 2.0)  # the best k of a high-alpha row is short: tokens fall off by alpha^j
    k = draft_lengths([Odds(1.0, 0.7, 4)], middle)[0]
    rate = [expected_tokens(Odds(1.0, 0.7, 4), j) / (10 + 4 * (j + 1) + 2 * (j > 0)) for j in range(5)]
    assert 0 < k < 4 and rate[k] == max(rate)
    assert draft_lengths([copying], StepCosts()) == [0]  # nothing measured yet
    assert draft_lengths([Odds(1.0, 0.0, 4), Odds(0.0, 0.9, 4)], cheap) == [0, 0]


def test_draft_lengths_split_the_tokens_by_marginal_gain():
    """Several rows: each further draft token goes to the row whose next token is likelier
    accepted; a batch of plain rows makes a verify's extra rows relatively cheap."""
    costs = _linear(10.0, 1.0, 1.0)
    ks = draft_lengths([Odds(1.0, 0.9, 4), Odds(1.0, 0.5, 4), Odds(1.0, 0.3, 4), None], costs)
    assert ks[0] == 4 and ks[0] >= ks[1] >= ks[2] and ks[3] == 0


def test_step_costs_measure_and_estimate_by_rows():
    """Moving averages per (verifying, rows); unmeasured rows between measured ones are linear,
    above them the measured slope (at least ROW_PRIOR of a row's share), below proportional; a
    verify with none measured is estimated from the plain steps; one stall moves an average
    little; frozen costs ignore measurements."""
    c = StepCosts()
    assert c.estimate(1, False) is None
    c.observe(1, False, 10.0)
    assert c.estimate(1, False) == 10.0 and c.estimate(3, True) == 10.0 + 2 * ROW_PRIOR * 10.0
    c.observe(1, False, 1000.0)  # a stall: counted as 4x the average
    assert c.estimate(1, False) == pytest.approx(10.0 + 0.2 * 30.0)
    c.observe(2, True, 20.0)
    c.observe(6, True, 40.0)
    assert c.estimate(4, True) == 30.0 and c.estimate(10, True) == 60.0 and c.estimate(1, True) == 10.0
    c.frozen = True
    c.observe(4, True, 1.0)
    assert c.estimate(4, True) == 30.0


def test_rows_propose_what_pays_and_count_their_choices():
    """The speculator sets each row's k and go from its odds and its costs, counts the chosen k
    (rows that never speculate are not counted); eager: k_max for every speculating row."""
    spec = Speculator(SpeculativeConfig(**SPEC))
    spec.costs = _linear(10.0, 1.0, 1.0)
    rows = [SpecState(4, hits=9.0), SpecState(4)]
    assert spec.choose([*rows, None]) and [(s.k, s.go) for s in rows] == [(4, True), (0, False)]
    assert spec.stats.k_chosen == [1, 0, 0, 0, 1]
    spec.eager = True
    assert spec.choose(rows) and all(s.go and s.k == 4 for s in rows)


def test_a_row_proposes_only_after_its_own_tokens_show_drafts_hold(tiny32):
    """Speculation on evidence, through the engine (step costs given: a row adds a tenth of a
    step): random prompts and sampled output (drafts would fail) verify nothing; a greedy row
    that logit_bias drives into repeating one token (drafts would hold) starts verifying after a
    few plain tokens, and its output is the one plain decoding gives."""
    rng = np.random.default_rng(9)
    prompts = [[int(x) for x in rng.permutation(5000)[:30]] for _ in range(4)]
    params = [SamplingParams(max_new_tokens=60, temperature=1.0, seed=i) for i in range(4)]
    engine = Engine(tiny32, EngineConfig.of(max_batch=4, max_len=128, speculative_config=SPEC))
    assert engine.speculator is not None
    engine.speculator.costs = _linear(10.0, 1.0, 1.0)
    _run(engine, prompts, params)
    assert engine.spec_decode_stats()["spec_decode_num_drafts"] == 0
    looping = [SamplingParams(max_new_tokens=40, logit_bias={77: 30.0})]
    plain = _run(Engine(tiny32, EngineConfig.of(max_batch=4, max_len=128)), prompts[:1], looping)
    assert _run(engine, prompts[:1], looping) == plain
    stats = engine.spec_decode_stats()
    assert stats["spec_decode_num_drafts"] >= 5 and stats["spec_decode_num_accepted_tokens"] >= 20


def test_the_engine_measures_its_steps_by_rows(tiny32):
    """The engine's timer fills the speculator's cost table: plain decode steps by their row
    count, verify steps (eager here; rows looping on one token: drafts found) by their one-token
    rows, prefill steps not at all."""
    engine = _eager(tiny32, max_batch=2, max_len=128)
    assert engine.speculator is not None
    engine.speculator.costs = costs = StepCosts()  # a replaced table is the one measured
    _run(engine, _prompts(2), [SamplingParams(max_new_tokens=16, logit_bias={77: 30.0})] * 2)
    table = costs.table
    assert table and all(t > 0 for t in table.values())
    assert any(v for v, _ in table) and max(n for _, n in table) <= 2 * (SPEC["num_speculative_tokens"] + 1)


@pytest.mark.parametrize("field, bad", [("model", "x"), ("method", "eagle"),
                                        ("num_speculative_tokens", 0), ("prompt_lookup_max", 0),
                                        ("prompt_lookup_min", True)])
def test_config_refuses_a_bad_field_by_name(field, bad):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SpeculativeConfig(**{field: bad})
    with pytest.raises(ValueError, match=f"^{field} must be"):
        EngineConfig.of(speculative_config={field: bad})


def test_config_parses_vllm_json_and_refuses_unknown_keys():
    config = SpeculativeConfig.parse(json.dumps(SPEC))
    assert config == SpeculativeConfig(**SPEC)
    assert EngineConfig.of(speculative_config=SPEC).speculative == config
    assert EngineConfig.of().speculative is None and SpeculativeConfig.parse(None) is None
    assert GenerationOptions(speculative_config=json.dumps(SPEC)).engine.speculative == config
    with pytest.raises(ValueError, match="prompt_lookup_min must be <="):
        SpeculativeConfig(prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(ValueError, match=r"unknown keys \['model_name'\]"):
        SpeculativeConfig.parse({"model_name": "x"})
    with pytest.raises(ValueError, match="speculative_config is not valid JSON"):
        GenerationOptions(speculative_config="{method: ngram}")
    with pytest.raises(ValueError, match="speculative_config must be"):
        SpeculativeConfig.parse(4)


def test_cli_flag_reaches_the_engine_config():
    from mlx_serving.server._cli import add_engine_arguments, engine_options

    p = argparse.ArgumentParser()
    add_engine_arguments(p, rows=True)
    args = p.parse_args(["--speculative-config", json.dumps(SPEC)])
    assert GenerationOptions(**engine_options(args)).engine.speculative == SpeculativeConfig(**SPEC)
    assert GenerationOptions(**engine_options(p.parse_args([]))).engine.speculative is None


def test_serving_stats_and_metrics_carry_the_spec_decode_counters(tiny32):
    """The text-generation backend reports the engine's counters; /metrics exports them under
    vLLM's names (per position labelled)."""
    from mlx_serving.models.text_generation._backend import GenerationBackend
    from mlx_serving.models.text_generation._inputs import Prompt
    from mlx_serving.serving import ServingStats
    from mlx_serving.server._metrics import Metrics

    backend = GenerationBackend(tiny32, GenerationOptions(max_new_tokens=30, max_len=96, max_batch=2,
                                                          speculative_config=SPEC))
    engine = backend.init("inline", None, 1)
    assert engine.speculator is not None
    engine.speculator.eager = True
    rows = [(i, Prompt(p, SamplingParams(30))) for i, p in enumerate(_prompts(12)[6:8])]
    assert backend.admit(engine, rows, 0) == []
    while backend.active(engine):
        backend.step(engine)
    stats = backend.stats(engine)
    assert stats["spec_decode_num_drafts"] > 0
    assert stats["spec_decode_num_accepted_tokens_per_pos_0"] <= stats["spec_decode_num_drafts"]
    served = ServingStats(0, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, backend=stats)
    text = Metrics(lambda: {"m": served}).exposition().decode()
    accepted_line = f'mlx_serving:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(stats["spec_decode_num_accepted_tokens"])}'
    assert accepted_line in text
    assert 'mlx_serving:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}' in text
    plain = ServingStats(0, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, backend={"seqs_running": 0})
    assert "spec_decode" not in Metrics(lambda: {"m": plain}).exposition().decode()  # speculation off: none

