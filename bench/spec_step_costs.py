"""What a speculative verify step costs on the native CPU step, in CPU time (issue 41): the figures
that bound speculation's speed-up whatever the proposer, measured so that a busy machine moves
them little.

- ``step``: the native decode step (``decode_path="native"``, the engine's own cache: float16 KV)
  of n one-token rows at consecutive positions of one stream from ``--position`` (what a verify of
  k = n - 1 draft tokens runs: models/generation/model_runner.py ``_verify_as_rows``), the greedy
  argmax on MLX, the tokens on the host: process CPU ms per step (all threads: run it with
  ``OMP_NUM_THREADS=1`` for the work itself, free of the pool's spinning on a shared machine) and
  wall ms, medians over ``--rounds`` rounds of ``--reps`` steps per n, the n alternating. From
  them: ``row_cost`` = (cost(n) - cost(1)) / ((n - 1) * cost(1)), the cost of an extra row as a
  share of a one-row step, and ``cap[alpha]``: the most a verify can gain over plain decoding at
  draft-token acceptance alpha, max over k of (1 + alpha + ... + alpha^k) / (cost(k + 1) / cost(1))
  (every step a verify whose drafts always exist; host time not counted).
- ``host``: the engine's main-thread CPU per step (``time.thread_time``: the Python and MLX graph
  work that a verify step, which lands before the next is planned, adds to its wall time) and the
  process CPU per step, bench/spec_decode.py's grounded prompts one at a time and its chat prompts
  as 8 streams, ``--max-new`` tokens, speculation off and on (n-gram, its default config); the
  second of two passes (the first measures the step costs the speculator chooses by).

Where the step's CPU goes (products, attention, ...): ``perf record -F 999`` over this script's
``step`` part with one n (``--rows N``), ``perf report --no-children --sort sym``: the
``micro_vnni<MR, 4|8, ...>`` symbols are the 4-bit layer / 8-bit head products, ``run_kind`` /
``heads`` / ``values_part`` / ``softmax_weights`` (attend_simd.h, per instruction set) the
attention, ``quantize_*`` the activations' int8 rounding (docs/benchmarks.md, "Speculative
decoding: where a verify row's cost goes").

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/spec_step_costs.py`` (writes
bench/results/spec_step_costs.json or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import spec_decode  # noqa: E402  (the bench's prompts)

from mlx_serving.models.decoder import layers  # noqa: E402
from mlx_serving.models.decoder.attention import Rows  # noqa: E402
from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams  # noqa: E402
from mlx_serving.models.generation.sampling import greedy  # noqa: E402
from mlx_serving.models.loader import load  # noqa: E402
from mlx_serving.models.sources import default_checkpoint  # noqa: E402
from mlx_serving.tokenization import Tokenizer  # noqa: E402

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def _verify_step(engine: Engine, n: int, position: int) -> None:
    """One native step of ``n`` rows at positions ``position .. position + n - 1`` of one stream
    (blocks 1.. of the engine's cache), its argmax on the host."""
    runner = engine.runner
    width = -(-(position + n) // runner.cache.block_size)
    table = np.tile(np.arange(1, width + 1, dtype=np.int32), (n, 1))
    rows = Rows(mx.array(np.full((n, 1), 100, dtype=np.int32)), mx.array(np.arange(position, position + n, dtype=np.int32)),
                mx.ones((n,), dtype=mx.int32), position + n, mx.zeros((n,), dtype=mx.int32), mx.array(table),
                dense=n == 1)
    out = greedy(layers.forward(runner.state, runner.cache, rows, runner.decode_backend))
    mx.eval(out, *runner.cache.arrays())
    np.array(out)


def step_costs(engine: Engine, ns: list[int], position: int, reps: int, rounds: int) -> dict[str, dict[int, float]]:
    """Median process CPU and wall ms per verify step of each n in ``ns`` (rounds alternate the n)."""
    cpu: dict[int, list[float]] = {n: [] for n in ns}
    wall: dict[int, list[float]] = {n: [] for n in ns}
    for n in ns:  # first use of each shape outside the timing
        _verify_step(engine, n, position)
    for _ in range(rounds):
        for n in ns:
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(reps):
                _verify_step(engine, n, position)
            cpu[n].append((time.process_time() - c0) * 1e3 / reps)
            wall[n].append((time.perf_counter() - t0) * 1e3 / reps)
    return {"cpu_ms": {n: statistics.median(v) for n, v in cpu.items()},
            "wall_ms": {n: statistics.median(v) for n, v in wall.items()}}


def cap(cost: dict[int, float], alpha: float) -> tuple[float, int]:
    """The best gain over plain decoding of a verify of k drafts at acceptance ``alpha``, and its k,
    over the measured ``cost`` by rows (k + 1 rows; plain: 1)."""
    best = max((sum(alpha ** j for j in range(n)) * cost[1] / cost[n], n - 1) for n in cost)
    return round(best[0], 3), best[1]


def host_costs(state, tok: Tokenizer, max_new: int) -> dict[str, dict[str, float]]:
    """Main-thread and process CPU ms per engine step, speculation off / on: the grounded prompts one
    at a time (``grounded1``) and the chat prompts as 8 streams (``chat8``: drafts fail, so what
    speculation costs there is its own host work: shadow drafts, the choice)."""
    def encode(text: str) -> list[int]:
        assert tok.chat_template is not None
        return tok.encode(tok.chat_template.apply([{"role": "user", "content": text}]), parse_special=True)

    params = SamplingParams(max_new_tokens=max_new, eos_token_ids=tuple(sorted(tok.eos_token_ids)))
    workloads = {"grounded1": [[encode(t)] for t in spec_decode.GROUNDED[:4]],
                 "chat8": [[encode(t) for t in spec_decode.CHAT]]}
    out = {}
    for name, batches in workloads.items():
        for regime, spec in (("off", None), ("on", NGRAM)):
            engine = Engine(state, EngineConfig.of(max_batch=8, max_len=1024, speculative_config=spec))
            for batch in batches:  # first pass: the speculator's step costs
                spec_decode._run(engine, batch, params)
            steps0, th, pr = spec_decode._steps(engine), time.thread_time(), time.process_time()
            tokens = sum(len(t) for batch in batches for t in spec_decode._run(engine, batch, params)[0])
            steps = spec_decode._steps(engine) - steps0
            out[f"{name}_{regime}"] = {
                "steps": steps, "tokens": tokens,
                "main_thread_cpu_ms_per_step": round((time.thread_time() - th) * 1e3 / steps, 3),
                "process_cpu_ms_per_step": round((time.process_time() - pr) * 1e3 / steps, 3),
                "process_cpu_ms_per_token": round((time.process_time() - pr) * 1e3 / tokens, 3)}
            engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("step", "host", "both"), default="both")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8])
    ap.add_argument("--position", type=int, default=256, help="the first verify row's position (its prefix)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--alpha", type=float, nargs="+", default=[0.8, 0.92])
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "spec_step_costs.json"))
    args = ap.parse_args()
    ckpt = default_checkpoint()
    state = load(ckpt)
    result: dict[str, object] = {"model": str(ckpt), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                                 "cpu_count": os.cpu_count(), "loadavg_before": os.getloadavg()}
    if args.part in ("step", "both"):
        ns = sorted({1, *args.rows})
        engine = Engine(state, EngineConfig.of(max_batch=8, max_len=1024))
        costs = step_costs(engine, ns, args.position, args.reps, args.rounds)
        engine.close()
        c = costs["cpu_ms"]
        result["step"] = {"position": args.position, **costs,
                          "row_cost": {n: round((c[n] - c[1]) / ((n - 1) * c[1]), 3) for n in ns if n > 1},
                          "cap": {a: cap(c, a) for a in args.alpha}}
        print(json.dumps(result["step"], indent=1), flush=True)
    if args.part in ("host", "both"):
        result["host"] = host_costs(state, Tokenizer.from_dir(ckpt), args.max_new)
        print(json.dumps(result["host"], indent=1), flush=True)
    result["loadavg_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
