"""Draft-model speculation (models/generation/spec_decode/draft.py): a second model with the
target's tokenizer proposes k tokens per speculating row through its own paged KV.

Invariants: a model as its own draft accepts every greedy draft (the mechanics: the draft's KV
follows the target's accepted prefix), greedy output equals decoding without speculation in
batches next to rows that do not speculate, with preemption, prefix hits and cancellation, and the
draft's blocks return to all-free with the target's; sampled rows are verified by the general
rejection rule (accept with min(1, p/q), resample from norm(max(0, p - q))): the emitted tokens
have the target's distribution (chi-square, in isolation and through the engine with a draft that
differs from the target) and seeded output is reproducible. Bad drafts are refused by name.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_serving.models.decoder.kv_cache import kv_bytes_per_token
from mlx_serving.models.decoder.layers import State
from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from mlx_serving.models.generation.logits import RowInput, make_chain
from mlx_serving.models.generation.spec_decode.draft import DraftModelError
from mlx_serving.models.generation.spec_decode.verify import chain_probs, rejection_tokens
from mlx_serving.models.loader import load
from mlx_serving.models.seeded_checkpoint import write_checkpoint
from mlx_serving.models import text_generation
from mlx_serving.models.text_generation import GenerationOptions

from engine_runs import run_to_end as _run

_SMALL_VOCAB = {"vocab_size": 512}  # the sampled tests sort the vocabulary at every position


def _spec(model: Path | str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def small_ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A float32 tiny target of a 512-token vocabulary (seed 0) and a draft of the same shape
    with other weights (seed 1)."""
    root = tmp_path_factory.mktemp("draft")
    target, draft = (write_checkpoint(root / f"s{seed}", "tiny", seed, quantized=False, dtype="float32",
                                      config_overrides=_SMALL_VOCAB) for seed in (0, 1))
    return target, draft


@pytest.fixture(scope="module")
def small(small_ckpts: tuple[Path, Path]) -> State:
    return load(small_ckpts[0])


def _prompts(n: int, seed: int = 0, vocab: int = 1000) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(0, vocab, 12 + 5 * i)] for i in range(n)]


def _all_free(engine: Engine) -> None:
    """The target's and the draft's blocks all returned."""
    assert engine.kv_stats().blocks_used == 0
    assert engine.speculator is not None and engine.speculator.draft_model is not None
    draft = engine.speculator.draft_model
    assert draft.num_rows == 0 and draft.kv.stats().blocks_used == 0
    assert draft.kv.pool.available == draft.kv.pool.num_blocks


@pytest.mark.parametrize("caching", [True, False])
def test_self_draft_greedy_accepts_every_draft_next_to_plain_rows(tiny32, tiny32_ckpt, caching):
    """tiny32 as its own draft, 8 prompts (two sharing a prefix) on 4 rows and a small pool: rows
    are preempted and recomputed, one row asks logprobs (it never speculates) and one is
    cancelled; every token equals decoding without speculation and every draft is accepted."""
    prompts = _prompts(7) + [_prompts(7)[6]]
    params = [SamplingParams(max_new_tokens=30 + i, logprobs=1 if i == 2 else None) for i in range(8)]
    config = dict(max_batch=4, max_len=128, prefix_caching=caching,
                  kv_cache_bytes=kv_bytes_per_token(tiny32) * 16 * 12)
    spec_config = dict(config, kv_cache_bytes=2 * config["kv_cache_bytes"])  # the budget holds both pools
    cancel = {4: 7}
    plain = _run(Engine(tiny32, EngineConfig.of(**config)), prompts, params, cancel)
    engine = Engine(tiny32, EngineConfig.of(speculative_config=_spec(tiny32_ckpt), **spec_config))
    assert engine.kv_stats().blocks_total == 12 and engine.speculator.draft_model.kv.pool.num_blocks == 12
    assert _run(engine, prompts, params, cancel) == plain
    stats = engine.spec_decode_stats()
    assert stats["spec_decode_num_drafts"] > 20
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    assert engine.kv_stats().preemptions > 0
    _all_free(engine)


@pytest.mark.timeout(600)  # the real model decodes ~40 steps here: minutes on a shared 2-core machine
def test_smollm2_as_its_own_draft_accepts_greedy_drafts(smollm2_dir):
    """The default model (real weights) drafting for itself: ~100% of greedy drafts accepted, the
    same tokens as without speculation, next to a row that does not speculate."""
    state = load(smollm2_dir)
    prompts = [[1, 504, 3458, 282, 4649, 314, 216, 33, 30, 30, 28, 216, 34, 30, 30, 28], [1, 2, 3, 4, 5, 6, 7]]
    params = [SamplingParams(max_new_tokens=16), SamplingParams(max_new_tokens=8, presence_penalty=0.5)]
    config = dict(max_batch=2, max_len=64)
    plain = _run(Engine(state, EngineConfig.of(**config)), prompts, params)
    engine = Engine(state, EngineConfig.of(speculative_config=_spec(smollm2_dir), **config))
    assert _run(engine, prompts, params) == plain
    stats = engine.spec_decode_stats()
    assert stats["spec_decode_num_drafts"] >= 2
    assert stats["spec_decode_num_accepted_tokens"] >= 0.95 * stats["spec_decode_num_draft_tokens"]
    _all_free(engine)


def _biased(seeds: range) -> list[SamplingParams]:
    bias = {5: 6.0, 6: 5.5, 7: 5.0, 8: 5.5}  # most mass on 5..8, the rest spread: q differs from p
    return [SamplingParams(max_new_tokens=6, temperature=1.0, logit_bias=bias, seed=s) for s in seeds]


def test_sampled_rows_reproduce_by_seed(small, small_ckpts):
    prompts = _prompts(6, seed=3, vocab=512)
    params = [SamplingParams(max_new_tokens=12, temperature=t, top_k=k, seed=i)
              for i, (t, k) in enumerate([(1.0, 0), (0.7, 20), (1.3, 0), (0.9, 5), (0.0, 0), (1.0, 0)])]
    config = EngineConfig.of(max_batch=4, max_len=96, speculative_config=_spec(small_ckpts[1]))
    runs = [_run(Engine(small, config), prompts, params) for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 6


def test_engine_sampled_distribution_matches_plain_decoding_with_another_draft(small, small_ckpts):
    """A draft with other weights (q != p): the tokens emitted at positions 1-5 have the
    distribution of plain decoding (two-sample chi-square, different seeds on each side), and
    drafts were both accepted and rejected."""
    base = [5, 6, 7, 8] * 4
    counts = []
    for spec, seeds in ((None, range(0, 150)), (_spec(small_ckpts[1]), range(1000, 1150))):
        engine = Engine(small, EngineConfig.of(max_batch=50, max_len=32, speculative_config=spec))
        out = _run(engine, [base] * len(seeds), _biased(seeds))
        tokens = np.concatenate([v[1:] for v in out.values()])
        counts.append([(tokens == t).sum() for t in (5, 6, 7, 8)] + [(~np.isin(tokens, base)).sum()])
        if spec is not None:
            stats = engine.spec_decode_stats()
            assert 50 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
            _all_free(engine)
    table = np.array(counts, dtype=float)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    keep = expected > 0
    assert float((((table - expected) ** 2)[keep] / expected[keep]).sum()) < 18.47  # 4 dof, 99.9%


def _chi2_ok(observed: np.ndarray, expected: np.ndarray) -> bool:
    """Pearson's chi-square below its 99.9% quantile (Wilson-Hilferty approximation)."""
    keep = expected > 0
    stat = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    df = int(keep.sum()) - 1
    return stat < df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3


def _target(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The chain's distribution computed here in numpy (temperature, top-k, then the nucleus)."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p[np.argsort(-p)[top_k:]] = 0
    p /= p.sum()
    order = np.argsort(-p)
    p[order[np.searchsorted(np.cumsum(p[order]), top_p) + 1 :]] = 0
    return p / p.sum()


def test_rejection_rule_preserves_the_target_distribution():
    """p and q: one chain (temperature, top-k, top-p) on two different logit vectors; 20,000
    positions, each with a draft drawn from q: the accept rate is sum(min(p, q)) and the emitted
    tokens are distributed as p (chi-square)."""
    params = SamplingParams(max_new_tokens=2, temperature=0.8, top_k=6, top_p=0.95, seed=0)
    rows = [RowInput(make_chain(params, 8))]
    target = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], dtype=np.float32)
    draft = np.array([0.0, 1.0, 2.5, 0.5, 1.0, -0.5, 0.3, 0.0], dtype=np.float32)
    p = np.array(chain_probs(mx.array(target[None]), rows))[0]
    q = np.array(chain_probs(mx.array(draft[None]), rows))[0]
    assert np.allclose(p, _target(target, 0.8, 6, 0.95), atol=1e-6) and abs(q.sum() - 1) < 1e-6
    n = 20_000
    rng = np.random.default_rng(5)
    d = rng.choice(8, size=n, p=q / q.sum()).astype(np.int32)
    out = np.array(rejection_tokens(mx.array(np.tile(p, (n + 1, 1))), mx.array(np.tile(q, (n, 1))), d, rng))[:n]
    rate = float(np.minimum(p, q).sum())
    assert abs(np.mean(out == d) - rate) < 4 * math.sqrt(rate * (1 - rate) / n)
    assert _chi2_ok(np.bincount(out, minlength=8).astype(float), n * p)


def test_chain_probs_follow_min_p_and_stay_a_distribution():
    params = SamplingParams(max_new_tokens=2, temperature=1.0, min_p=0.3)
    x = mx.array([[3.0, 2.5, 1.0, 0.0, -1.0]])
    p = np.array(chain_probs(x, [RowInput(make_chain(params, 5))]))[0]
    e = np.exp(np.array([3.0, 2.5, 1.0, 0.0, -1.0]) - 3.0)
    e[e < 0.3 * e.max()] = 0
    assert np.allclose(p, e / e.sum(), atol=1e-6)
    with pytest.raises(ValueError, match="sampled rows"):
        chain_probs(x, [RowInput(make_chain(SamplingParams(max_new_tokens=2), 5))])


# ---- configuration and refusals -------------------------------------------------------------


def test_config_needs_a_model_for_draft_model_and_none_for_ngram_and_the_flag_carries_it():
    assert SpeculativeConfig.parse(json.dumps(_spec("m"))) == SpeculativeConfig("draft_model", 4, model="m")
    assert GenerationOptions(speculative_config=_spec("m")).engine.speculative.model == "m"
    from mlx_serving.server._cli import add_engine_arguments, engine_options

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, rows=True)
    args = parser.parse_args(["--speculative-config", json.dumps(_spec("m", 3))])
    assert GenerationOptions(**engine_options(args)).engine.speculative == SpeculativeConfig("draft_model", 3, model="m")
    with pytest.raises(ValueError, match="^model must be the draft model's name"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="^model must be None for method 'ngram'"):
        EngineConfig.of(speculative_config={"method": "ngram", "model": "m"})


def test_a_draft_that_cannot_load_is_refused_by_name(tiny32, tmp_path):
    with pytest.raises(DraftModelError, match=r"^speculative_config.model .* cannot be loaded"):
        Engine(tiny32, EngineConfig.of(max_len=64, speculative_config=_spec(tmp_path / "missing")))


def test_a_draft_with_another_tokenizer_is_refused_by_name(tiny32, tiny32_ckpt, small_ckpts, tmp_path):
    with pytest.raises(DraftModelError, match=r"^speculative_config.model .* vocabulary of 512 tokens"):
        Engine(tiny32, EngineConfig.of(max_len=64, speculative_config=_spec(small_ckpts[0])))
    other = shutil.copytree(tiny32_ckpt, tmp_path / "other")
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab[first + "x"] = vocab.pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(DraftModelError, match=r"^speculative_config.model .* different tokenizer"):
        Engine(tiny32, EngineConfig.of(max_len=64, speculative_config=_spec(other)))


def test_close_mid_speculation_frees_the_draft_pool(small, small_ckpts):
    engine = Engine(small, EngineConfig.of(max_batch=3, max_len=64, speculative_config=_spec(small_ckpts[0])))
    for i, p in enumerate(_prompts(3, seed=9, vocab=512)):
        engine.add(i, p, SamplingParams(max_new_tokens=30))
    for _ in range(6):
        engine.step()
    draft = engine.speculator.draft_model
    assert draft.num_rows == 3 and draft.kv.stats().blocks_used > 0
    engine.close()
    assert draft.num_rows == 0 and draft.kv.stats().blocks_used == 0 and not draft.cache.keys


def test_the_cli_refuses_a_draft_it_cannot_find_by_name(tiny32_ckpt, tmp_path, capsys):
    """A draft model that does not resolve is refused when the serving is built, in the caller:
    the CLI says which field in one line and exits 2 (not a backend error on the first request)."""
    from mlx_serving.cli import main

    spec = json.dumps({"method": "draft_model", "model": str(tmp_path / "missing"), "num_speculative_tokens": 3})
    with pytest.raises(DraftModelError, match=r"^speculative_config.model .* cannot be loaded"):
        text_generation.from_mlx4bit(tiny32_ckpt, speculative_config=spec)
    assert main(["generate", "--model", str(tiny32_ckpt), "--max-new-tokens", "2", "--raw",
                 "--speculative-config", spec, "hi"]) == 2
    assert "error: speculative_config.model" in capsys.readouterr().err
