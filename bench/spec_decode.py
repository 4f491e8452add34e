"""Speculative decoding (n-gram prompt lookup) on vs off with the real default model (issue 41).

Model: SmolLM2-135M-Instruct (``default_checkpoint()``), greedy, chat template, stopping at EOS or
``--max-new`` (128) tokens. Workloads:

- ``grounded``: input-grounded requests: rewrite or edit a given passage or code block, answer
  with quotes from a given text (the output copies spans of the prompt);
- ``chat``: open-ended chat questions (drafts rarely match: rows then do not propose, since a row
  speculates only where its measured acceptance pays for the measured cost of a verify step,
  docs/generation.md).

Each workload runs at 1 stream (its first 4 prompts one at a time; decode tok/s per request = (tokens - 1)
/ (last token - first token), median over requests) and at 8 streams (its 8 prompts added together, ``--prompts`` fewer;
aggregate tok/s = tokens / (last token - first add)). Two engines are built once (speculation off,
and on with ``--speculative-config``), both ``max_batch`` 8; rounds alternate off / on
(``--rounds``, 3) and the figures are medians over rounds, ratios on / off. The outputs of the two
engines are compared token for token (greedy speculation is exact; on the float16 CPU path a verify
span's logits can differ from a decode row's in the last bits, so a near-tie can flip: counted).
The machine's load (``os.getloadavg``) is recorded before, after each regime of each round and
after: it is shared, so read the ratios, and the load-proof one: tokens per second of process CPU
time over both stream counts (``<workload>_cpu``; the CPU time of all the process's threads, the
decode pool's brief spinning included). Per workload (the "on" engine's counters over its runs):
the acceptance rate (accepted / draft tokens), drafts, and the histogram of the draft length k
the speculator chose per decoding row and step (``k_chosen[k]``, k = 0: plain); and the step costs
the engine measured (``step_costs_ms``: "plain"/"verify" by one-token rows); and per regime the
steps that ran a forward (``<workload>_steps_<regime>``). ``--row-cost C`` gives the "on" engine
step costs instead (10 + C * n for n one-token rows, 1 more when verifying, frozen): what it would
choose were rows that cheap (read the steps and chosen k; the wall clock still runs today's rows).

Run: ``PYTHONPATH=src .venv/bin/python bench/spec_decode.py [--rounds 3] [--max-new 128]`` (writes
bench/results/spec_decode.json or ``--out``); ``--method draft_model [--draft PATH]`` measures
draft-model speculation instead (default draft: the target itself).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

PASSAGE = (
    "The lighthouse stood at the edge of the northern cliffs for more than two hundred years. Every night the "
    "keeper climbed the spiral stairs, trimmed the wick and polished the great lens until it shone. Ships that "
    "passed in the winter storms trusted its beam to guide them away from the rocks below. When the keeper grew "
    "old, his daughter took over the work, and she kept the light burning through the worst winter the village "
    "had ever seen.")
CODE = (
    "def average(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n"
    "def median(values):\n    ordered = sorted(values)\n    middle = len(ordered) // 2\n"
    "    if len(ordered) % 2 == 0:\n        return (ordered[middle - 1] + ordered[middle]) / 2\n"
    "    return ordered[middle]\n\n"
    "def variance(values):\n    mean = average(values)\n    return sum((v - mean) ** 2 for v in values) / len(values)\n")

GROUNDED = [
    f"Rewrite the following passage, replacing the word 'keeper' with 'guardian'. Keep everything else the same.\n\n{PASSAGE}",
    f"Rename the function 'average' to 'mean_of' everywhere in this code and return the full code.\n\n```python\n{CODE}```",
    f"Copy the following passage exactly, but in the past perfect tense where possible.\n\n{PASSAGE}",
    f"Add a docstring to each function in this code and return the complete code.\n\n```python\n{CODE}```",
    f"Quote the sentences of this text that mention the winter, word for word.\n\n{PASSAGE}",
    f"Repeat this code exactly, adding type hints to every function.\n\n```python\n{CODE}```",
    f"Correct any errors in this passage and return it in full.\n\n{PASSAGE}",
    f"Return this code unchanged except that 'values' is renamed to 'xs'.\n\n```python\n{CODE}```",
]
CHAT = [
    "Tell me a short story about a dragon who learns to bake bread.",
    "What are some good habits for staying healthy while working from home?",
    "Explain why the sky looks blue, in simple words.",
    "Write a poem about autumn in a small town.",
    "What should I consider when choosing my first programming language?",
    "Describe an ideal weekend trip to the mountains.",
    "Give me three ideas for a birthday party for a ten-year-old.",
    "Why do people enjoy listening to music?",
]


def _engine(state, spec: str | None):
    from mlx_serving.models.generation import Engine, EngineConfig

    return Engine(state, EngineConfig.of(max_batch=8, max_len=1024, speculative_config=spec))


def _run(engine, prompts: list[list[int]], params) -> tuple[list[list[int]], list[list[float]], float]:
    """Add every prompt, step until done: (tokens, per-token host times, add time) per request."""
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add(i, p, params)
    tokens: list[list[int]] = [[] for _ in prompts]
    times: list[list[float]] = [[] for _ in prompts]
    while engine.num_active:
        events = engine.step()
        now = time.perf_counter()
        for ev in events:
            tokens[ev.seq_id].append(ev.token_id)
            times[ev.seq_id].append(now)
    return tokens, times, t0


def _single(engine, prompts, params) -> tuple[float, list[list[int]]]:
    rates, outs = [], []
    for p in prompts:
        tokens, times, _ = _run(engine, [p], params)
        if len(tokens[0]) > 1:
            rates.append((len(tokens[0]) - 1) / (times[0][-1] - times[0][0]))
        outs.append(tokens[0])
    return statistics.median(rates), outs


def _batch(engine, prompts, params) -> tuple[float, list[list[int]]]:
    tokens, times, t0 = _run(engine, prompts, params)
    return sum(map(len, tokens)) / (max(t[-1] for t in times) - t0), tokens


def _give_costs(engine, row_cost: float) -> None:
    """Freeze ``engine``'s step costs at 10 + ``row_cost`` * n for n one-token rows (up to 8 rows of
    k + 1), 1 more for a verifying step."""
    from mlx_serving.models.generation.spec_decode import StepCosts

    spec = engine.speculator
    top = 8 * (spec.config.num_speculative_tokens + 1)
    spec.costs = StepCosts({(v, rows): 10 + row_cost * rows + v for v in (False, True) for rows in range(1, top + 1)},
                           frozen=True)


def _steps(engine) -> int:
    """Steps that ran a forward so far."""
    return int(engine.iteration_tokens.stats()["iteration_tokens_count"])


def _counters(engine) -> list[int]:
    """The "on" engine's draft tokens, accepted tokens, drafts and chosen-k counts, flat."""
    st = engine.speculator.stats
    return [st.num_draft_tokens, st.num_accepted_tokens, st.num_drafts, *st.k_chosen]


def _per_workload(deltas: list[int]) -> dict:
    drafted, accepted, drafts, *ks = deltas
    return {"acceptance_rate": accepted / max(1, drafted), "drafts": drafts, "draft_tokens": drafted,
            "accepted_tokens": accepted, "k_chosen": ks}


def _draft_config(args: argparse.Namespace) -> str:
    """``--speculative-config``, or with ``--method draft_model`` the draft-model config of
    ``--draft`` (None: the default model drafting for itself, a mechanics check) with k from
    ``--speculative-config``."""
    if args.method != "draft_model":
        return args.speculative_config
    from mlx_serving.models.sources import default_checkpoint

    k = json.loads(args.speculative_config).get("num_speculative_tokens", 4)
    return json.dumps({"method": "draft_model", "model": args.draft or str(default_checkpoint()),
                       "num_speculative_tokens": k})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload: the batch's streams (the "
                                                         "single-stream runs take the first min(4, this))")
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                                                    '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    ap.add_argument("--method", choices=("ngram", "draft_model"), default="ngram",
                    help="draft_model: --draft proposes (overrides --speculative-config, _draft_config)")
    ap.add_argument("--draft", help="the draft model of --method draft_model (default: the target itself)")
    ap.add_argument("--row-cost", type=float, help="give the speculator step costs instead of measuring them: "
                    "10 + ROW_COST * n for n one-token rows, 1 more for a verifying step (what-if: read the "
                    "steps and chosen k, not the wall clock)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "spec_decode.json"))
    args = ap.parse_args()
    args.speculative_config = _draft_config(args)

    from mlx_serving.models.generation import SamplingParams
    from mlx_serving.models.loader import load
    from mlx_serving.models.sources import default_checkpoint
    from mlx_serving.tokenization import Tokenizer

    ckpt = default_checkpoint()
    state, tok = load(ckpt), Tokenizer.from_dir(ckpt)
    assert tok.chat_template is not None

    def encode(text: str) -> list[int]:
        return tok.encode(tok.chat_template.apply([{"role": "user", "content": text}]), parse_special=True)

    params = SamplingParams(max_new_tokens=args.max_new, eos_token_ids=tuple(sorted(tok.eos_token_ids)))
    work = {"grounded": [encode(t) for t in GROUNDED[: args.prompts]], "chat": [encode(t) for t in CHAT[: args.prompts]]}
    n = args.prompts
    engines = {"off": _engine(state, None), "on": _engine(state, args.speculative_config)}
    if args.row_cost is not None:
        _give_costs(engines["on"], args.row_cost)
    load_before = os.getloadavg()
    figures: dict[str, list[float]] = {}
    loads: list[float] = []  # 1-minute load average after each regime of each round
    outputs: dict[str, dict[str, list[list[int]]]] = {"off": {}, "on": {}}
    spec_by_work: dict[str, list[int]] = {}
    for rnd in range(args.rounds):
        for regime in ("off", "on") if rnd % 2 == 0 else ("on", "off"):
            engine = engines[regime]
            for name, prompts in work.items():
                before, cpu, steps = _counters(engines["on"]), time.process_time(), _steps(engine)
                one, outs1 = _single(engine, prompts[:4], params)
                many, outs8 = _batch(engine, prompts, params)
                figures.setdefault(f"{name}_cpu_{regime}", []).append(
                    sum(map(len, outs1 + outs8)) / (time.process_time() - cpu))
                figures.setdefault(f"{name}_steps_{regime}", []).append(_steps(engine) - steps)
                delta = [a - b for a, b in zip(_counters(engines["on"]), before)]
                spec_by_work[name] = [a + b for a, b in zip(spec_by_work.get(name, [0] * len(delta)), delta)]
                figures.setdefault(f"{name}_1_{regime}", []).append(one)
                figures.setdefault(f"{name}_{n}_{regime}", []).append(many)
                outputs[regime][name] = outs1 + outs8
            loads.append(os.getloadavg()[0])
            print(rnd, regime, {k: round(v[-1], 1) for k, v in figures.items() if k.endswith(regime)},
                  f"load {loads[-1]:.1f}", flush=True)
    med = {k: statistics.median(v) for k, v in figures.items()}
    ratios = {f"{w}_{s}": med[f"{w}_{s}_on"] / med[f"{w}_{s}_off"] for w in work for s in (1, n, "cpu")}
    same = {w: sum(a == b for a, b in zip(outputs["off"][w], outputs["on"][w])) / len(outputs["off"][w])
            for w in work}
    spec = engines["on"].spec_decode_stats()
    costs = engines["on"].speculator.costs.table
    result = {"model": str(ckpt), "rounds": args.rounds, "max_new": args.max_new,
              "speculative_config": json.loads(args.speculative_config),
              "tok_per_s_median": med, "ratios_on_over_off": ratios, "identical_outputs": same,
              "acceptance_rate": spec["spec_decode_num_accepted_tokens"] / max(1, spec["spec_decode_num_draft_tokens"]),
              "spec_decode_stats": spec, "k_chosen": engines["on"].speculator.stats.k_chosen,
              "per_workload": {w: _per_workload(d) for w, d in spec_by_work.items()},
              "step_costs_ms": {f"{'verify' if v else 'plain'}_{n}": round(t * 1e3, 2) for (v, n), t in sorted(costs.items())},
              "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
              "loadavg_1min_per_regime": loads,
              "cpu_count": os.cpu_count()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("ratios_on_over_off", "identical_outputs", "acceptance_rate", "per_workload",
                                             "step_costs_ms", "loadavg_before", "loadavg_after")}, indent=2))


if __name__ == "__main__":
    main()
