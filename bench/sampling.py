"""Per-step cost of sampling options (issue 14): a batch of 32 rows with mixed options vs all-greedy.

Regimes (``--rows`` 32 rows each):

- ``greedy``: every row default (argmax only; the pre-issue-14 greedy path);
- ``top_p``: every row ``temperature=0.8, top_p=0.95`` (the pre-issue-14 sampled path: a sort of
  the whole vocabulary per row);
- ``mixed``: rows cycling through 8 option sets (greedy; top-p; top-k; min-p; the three
  penalties; logit_bias + min_tokens; logprobs 5; top-k + top-p + min-p + frequency penalty +
  logprobs 2), so 4 rows use top-p without top-k;
- ``json`` (engine part only): every row greedy under a structured-output constraint
  (llguidance through ``models/text_generation/_structured.py``, the Qwen3 tokenizer): a JSON
  object whose one string property has at least 200 characters, so no row ends early. Its steps
  are not pipelined (each lands the previous step's tokens before masking).

Parts:

- ``sampler``: :func:`models.generation.logits.sample_batch` alone on random float32 logits of
  ``(rows, 151,936)`` (the Qwen3 vocabulary), penalty state included; median ms per call
  (evaluated) over ``--reps`` calls, regimes interleaved;
- ``engine``: ``Engine.step`` on a checkpoint (``--preset`` tiny: the 4-bit tiny test
  checkpoint, or 0.6b: ``seeded_checkpoint("seeded:qwen3-0.6b")``, seeded-random 0.6B shape; both have the 151,936
  vocabulary) with ``rows`` sequences of ``--prompt`` random tokens, ``--max-new`` new tokens each
  (EOS ignored), all added at once; median wall ms of the steps in which every row decodes (the
  step time of the pipelined engine: the device's step plus the host's work), regimes interleaved
  over ``--rounds`` fresh engines; ``per_token_ms``: step time / rows.

Run: ``.venv/bin/python bench/sampling.py [--preset tiny|0.6b] [--parts sampler,engine]`` (writes
bench/results/sampling_<preset>.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
REGIMES = ("greedy", "top_p", "mixed")


def params_for(regime: str, rows: int, max_new: int) -> list:
    from mlx_serving.models.generation.sampling import SamplingParams as P

    mixed = [P(), P(temperature=0.8, top_p=0.95), P(temperature=1.0, top_k=50), P(temperature=0.7, min_p=0.05),
             P(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
             P(temperature=1.0, logit_bias={5: 2.0, 7: -3.0}, min_tokens=4, eos_token_ids=(1,)),
             P(logprobs=5), P(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, frequency_penalty=0.3, logprobs=2)]
    base = {"greedy": [P()], "top_p": [P(temperature=0.8, top_p=0.95)], "mixed": mixed}[regime]
    return [_with(base[i % len(base)], max_new, seed=i) for i in range(rows)]


def _with(p, max_new: int, seed: int):
    from dataclasses import replace
    return replace(p, max_new_tokens=max_new, seed=seed, min_tokens=min(p.min_tokens, max_new))


def sampler_part(args: argparse.Namespace) -> dict:
    import mlx.core as mx

    from mlx_serving.models.generation.logits import RowInput, TokenHistory, make_chain, sample_batch

    vocab, rows = 151_936, args.rows
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(rows, vocab)).astype(np.float32) * 3)
    history = TokenHistory(rows, vocab)
    for i in range(rows):
        history.reset(i, rng.integers(0, vocab, 64), rng.integers(0, vocab, 16).tolist())
    mx.eval(logits, *history.arrays())
    batches = {r: [RowInput(make_chain(p, vocab), i, 2, None, np.random.default_rng(i))
                   for i, p in enumerate(params_for(r, rows, 16))] for r in REGIMES}
    times: dict[str, list[float]] = {r: [] for r in REGIMES}
    for _ in range(args.reps):
        for r in REGIMES:
            t = time.perf_counter()
            out = sample_batch(logits, batches[r], history)
            mx.eval(out.tokens, *out.pending, *history.arrays())
            times[r].append((time.perf_counter() - t) * 1e3)
    return {r: {"ms_p50": round(float(np.median(v)), 1), "ms_min": round(min(v), 1)} for r, v in times.items()}


def json_rows(state, rows: int, max_new: int) -> tuple[list, object]:
    """Greedy rows constrained to a JSON object with a long string, and the constraint factory."""
    from mlx_serving.models.generation.sampling import SamplingParams
    from mlx_serving.models.text_generation._structured import compile_response_format, constraint_factory
    from mlx_serving.tokenization import Tokenizer

    tokenizer = Tokenizer.qwen3()
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 200}}, "required": ["text"]}
    grammar = compile_response_format({"type": "json_schema", "json_schema": {"name": "long", "schema": schema}})
    params = SamplingParams(max_new_tokens=max_new, grammar=grammar, eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)))
    return [params] * rows, constraint_factory(tokenizer, state.config.vocab_size)


def engine_part(args: argparse.Namespace, ckpt: Path) -> dict:
    from mlx_serving.models.generation import Engine, EngineConfig
    from mlx_serving.models.loader import load

    state = load(ckpt)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 150_000, args.prompt).tolist() for _ in range(args.rows)]
    regimes = {r: (params_for(r, args.rows, args.max_new), None) for r in REGIMES}
    regimes["json"] = json_rows(state, args.rows, args.max_new)
    times: dict[str, list[float]] = {r: [] for r in regimes}
    for _ in range(args.rounds):
        for r, (params, factory) in regimes.items():
            max_len = -(-(args.prompt + args.max_new) // 16) * 16  # whole KV blocks: all rows fit at once
            engine = Engine(state, EngineConfig.of(max_batch=args.rows, max_len=max_len, prefill_chunk=512),
                            constraint_factory=factory)
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                engine.add(i, prompt, p)
            while engine.num_active:
                t = time.perf_counter()
                events = engine.step()
                if len(events) == args.rows == engine.num_active:  # all rows decoding
                    times[r].append((time.perf_counter() - t) * 1e3)
    return {r: {"step_ms_p50": round(float(np.median(v)), 1), "per_token_ms": round(float(np.median(v)) / args.rows, 2),
                "steps": len(v)} for r, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", choices=["tiny", "0.6b"])
    ap.add_argument("--parts", default="sampler,engine")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    parts = args.parts.split(",")
    doc: dict = {"command": " ".join(["python", "bench/sampling.py"] + sys.argv[1:]), "args": vars(args),
                 "machine": {"platform": platform.platform(), "processor": platform.processor(),
                             "python": platform.python_version()}}
    if "sampler" in parts:
        doc["sampler"] = sampler_part(args)
        print(json.dumps({"sampler": doc["sampler"]}), flush=True)
    if "engine" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            if args.preset == "tiny":
                from mlx_serving.models.seeded_checkpoint import write_checkpoint
                ckpt = write_checkpoint(Path(tmp) / "tiny", "tiny", seed=0)
            else:
                from mlx_serving.models.sources import seeded_checkpoint
                ckpt = seeded_checkpoint("seeded:qwen3-0.6b")
            doc["engine"] = engine_part(args, ckpt)
        print(json.dumps({"engine": doc["engine"]}), flush=True)
    summary = {}
    for part, key in (("sampler", "ms_p50"), ("engine", "step_ms_p50")):
        if part in doc:
            g = doc[part]["greedy"][key]
            summary[part] = {r: round(v[key] / g, 2) for r, v in doc[part].items() if r != "greedy"}
    doc["over_greedy"] = summary
    path = ROOT / "bench" / "results" / f"sampling_{args.preset}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
