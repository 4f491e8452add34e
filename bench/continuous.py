"""Continuous batching vs whole-request (Nx-style) batching vs one at a time, on CPU (issue 7).

Workload: ``--requests`` (32) requests submitted at the same instant; prompt lengths drawn
uniformly from 4..200 tokens (one token per word of a fixed word list), ``max_new_tokens`` from
8..128, greedy, EOS as in the checkpoint; the tiny float32 Qwen3 checkpoint (seed 0) written by
``models.seeded_checkpoint.write_checkpoint``. Regimes, each on a fresh, warmed-up serving:

- continuous: ``models.text_generation.serving`` in process mode (rows join between decode steps
  and leave when done), ``max_batch`` = ``batch_size`` = 8 (as static) and 32 (all at once);
- static: Nx.Serving-style whole-request batches, a static ``Backend`` whose ``handle_batch``
  runs ``models.generation.generate`` on the batch's prompts with the batch's largest
  ``max_new_tokens`` (each row cut to its own), ``batch_size`` 8, ``batch_timeout`` 20 ms;
- sequential: the continuous serving fed one request at a time (each waits for the previous).

Each regime runs ``--repeats`` times, the order rotating per round (the 2 cores are shared with
other jobs whose load drifts); the median of each number is reported. Metrics: aggregate tok/s =
generated tokens / (last completion - submission); per-request latency (submission -> last item)
p50/p99, and TTFT (submission -> first item; static batches deliver everything at once, so their
TTFT is their latency). ``tok_per_cpu_s`` divides by this process's CPU time (all its threads)
instead of wall time: it moves less when other jobs share the cores. Executor ms per step/batch
is the serving's telemetry time per iterative step (admission + one engine step) or per static
batch; tokens per step/batch divides the generated tokens by their count. Ratios are
``regime / continuous (batch 8)``.

Run: ``.venv/bin/python bench/continuous.py`` (writes bench/results/continuous.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# bench/ holds scripts named like the packages (bench/tokenization.py): keep it off sys.path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import anyio  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlx_serving.models import text_generation  # noqa: E402
from mlx_serving.models.generation import generate  # noqa: E402
from mlx_serving.models.decoder.layers import State  # noqa: E402
from mlx_serving.models.loader import load  # noqa: E402
from mlx_serving.models.seeded_checkpoint import write_checkpoint  # noqa: E402
from mlx_serving.serving import Batch, Serving, ServingHandle  # noqa: E402
from mlx_serving.tokenization import Tokenizer  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing about rain "
         "and green hills under grey clouds near old stone walls").split()  # one token each
MAX_LEN = 336  # longest prompt (200) + longest generation (128), rounded up
STATIC_BATCH, STATIC_TIMEOUT_S = 8, 0.02
WARMUP = [{"text": "the quick brown fox", "max_new_tokens": 4}, {"text": "a lazy dog", "max_new_tokens": 6}]

Spec = dict[str, Any]  # one request: {"text", "max_new_tokens"}
Timing = tuple[float, float, int]  # (ttft_s, latency_s, generated tokens)


def workload(n: int, seed: int) -> list[Spec]:
    """``n`` seeded requests: 4..200 prompt words (one token each), max_new_tokens 8..128."""
    rng = random.Random(seed)
    return [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 200))),
             "max_new_tokens": rng.randint(8, 128)} for _ in range(n)]


class StaticGenerate:
    """Static Backend: one whole-request batch per ``handle_batch``, through ``generate``.

    Rows are ``(prompt_ids, max_new_tokens)``; every row decodes for the batch's largest
    ``max_new_tokens`` (or until its own EOS) and is then cut to its own limit, as a
    whole-request batch does. Output: one list of token ids per row.
    """

    def __init__(self, state: State, eos: tuple[int, ...]):
        self._state, self._eos = state, eos

    def init(self, mode: str, arg: Any, partitions: int) -> None:
        return None

    def handle_batch(self, batch: Batch, partition: int, state: Any) -> tuple[list[list[int]], None]:
        rows = batch.data[: batch.size]
        ids, _ = generate([p for p, _ in rows], self._state, max_new_tokens=max(n for _, n in rows),
                          max_len=MAX_LEN, eos_token_ids=self._eos, profile_timing=False)
        return [out[:n] for out, (_, n) in zip(ids, rows)], None


def static_serving(tokenizer: Tokenizer, state: State) -> Serving:
    """Serving over :class:`StaticGenerate`: input a Spec, result the generated token ids."""
    eos = tuple(sorted(tokenizer.eos_token_ids))
    return (Serving.new(StaticGenerate(state, eos))
            .client_preprocessing(lambda s: (Batch.stack([(tokenizer.encode(s["text"]), s["max_new_tokens"])]), None))
            .client_postprocessing(lambda r, _: r[0][0]))


async def _timed_stream(h: ServingHandle, spec: Spec, t0: float, texts: list[str]) -> Timing:
    first, pieces, final = None, [], {}
    async for item in await Serving.stream_async(h, spec):
        first = first or time.perf_counter()
        if isinstance(item, str):
            pieces.append(item)
        else:
            final = item
    texts.append("".join(pieces))
    end = time.perf_counter()
    return first - t0, end - t0, final["num_tokens"]


async def _timed_static(h: ServingHandle, spec: Spec, t0: float, ids: list[list[int]]) -> Timing:
    out = await Serving.batched_run_async(h, spec)
    end = time.perf_counter()
    ids.append(out)
    return end - t0, end - t0, len(out)


async def _drive(call: Any, h: ServingHandle, specs: list[Spec],
                 concurrent: bool) -> tuple[list[Timing], list[Any], float]:
    """Submit every spec at t0 (or one after another); timings and outputs in spec order."""
    timings: list[Timing | None] = [None] * len(specs)
    outputs: list[list[Any]] = [[] for _ in specs]

    async def one(i: int) -> None:
        timings[i] = await call(h, specs[i], t0, outputs[i])

    t0 = time.perf_counter()
    if concurrent:
        async with anyio.create_task_group() as tg:
            for i in range(len(specs)):
                tg.start_soon(one, i)
    else:
        for i in range(len(specs)):
            await one(i)
    return timings, [o[0] for o in outputs], time.perf_counter() - t0  # type: ignore[return-value]


def run_regime(serving: Serving, specs: list[Spec], static: bool, concurrent: bool, **start: Any) -> dict[str, Any]:
    """One timed pass of ``specs`` through a fresh start of ``serving`` (after a warm-up)."""
    call = _timed_static if static else _timed_stream
    work: list[float] = []  # executor time per step (iterative) or per batch (static)
    serving = serving.telemetry(lambda e: work.append(e.duration_s) if e.kind in ("step", "execute") else None)
    with serving.start(**start) as h:
        anyio.run(_drive, call, h, WARMUP, True)  # compiles, first allocations
        work.clear()
        cpu0 = time.process_time()
        timings, outputs, wall = anyio.run(_drive, call, h, specs, concurrent)
        cpu_s = time.process_time() - cpu0
        stats = h.stats()
    ttft, lat, tokens = (np.array(x) for x in zip(*timings))
    return {"tokens": int(tokens.sum()), "wall_s": wall, "tok_s": float(tokens.sum() / wall),
            "latency_p50_s": float(np.percentile(lat, 50)), "latency_p99_s": float(np.percentile(lat, 99)),
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "cpu_s": cpu_s, "tok_per_cpu_s": float(tokens.sum() / cpu_s),
            "executor_calls": len(work), "executor_busy_s": float(sum(work)),
            "ms_per_call": float(sum(work)) / len(work) * 1e3, "tokens_per_call": float(tokens.sum()) / len(work),
            "mean_batch_fill": stats.mean_batch_fill, "loadavg_1min": os.getloadavg()[0], "outputs": outputs}


def source_version() -> dict[str, Any]:
    """The commit measured and whether the measured packages had uncommitted changes."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": git("status", "--porcelain", "--", "../models", "../serving")}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each number over the runs; the first run's outputs; every run's tok/s."""
    out = {k: float(np.median([r[k] for r in runs])) for k, v in runs[0].items() if isinstance(v, (int, float))}
    out["tok_s_runs"] = [r["tok_s"] for r in runs]
    out["latency_p50_s_runs"] = [r["latency_p50_s"] for r in runs]
    out["outputs"] = runs[0]["outputs"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="rounds; each regime's median is reported")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "continuous.json")
    args = ap.parse_args()

    source = source_version()  # before measuring: others may edit the tree during a long run
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "tiny32", "tiny", 0, quantized=False, dtype="float32")
        state, tokenizer = load(ckpt), Tokenizer.from_dir(ckpt)
    specs = workload(args.requests, args.seed)
    prompt_lens = [len(tokenizer.encode(s["text"])) for s in specs]

    def continuous(max_batch: int) -> Serving:
        return text_generation.serving(tokenizer, state, max_len=MAX_LEN, max_batch=max_batch, profile_timing=False)

    regimes = {
        "continuous (batch 8)": lambda: run_regime(continuous(8), specs, False, True),
        "continuous (batch 32)": lambda: run_regime(continuous(32), specs, False, True),
        f"static Nx-style (batch {STATIC_BATCH})": lambda: run_regime(
            static_serving(tokenizer, state), specs, True, True,
            batch_size=STATIC_BATCH, batch_timeout=STATIC_TIMEOUT_S),
        "sequential": lambda: run_regime(continuous(1), specs, False, False),
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in regimes}
    names = list(regimes)
    for round_ in range(args.repeats):  # rotate the order: load from other jobs drifts over time
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            runs[name].append(regimes[name]())
            print(f"round {round_}: {name}: {runs[name][-1]['tok_s']:.1f} tok/s in {runs[name][-1]['wall_s']:.1f} s",
                  flush=True)
    results = {name: summarize(rs) for name, rs in runs.items()}

    base_name, static_name = "continuous (batch 8)", f"static Nx-style (batch {STATIC_BATCH})"
    outputs = {name: r.pop("outputs") for name, r in results.items()}
    outputs[static_name] = [tokenizer.decode(ids) for ids in outputs[static_name]]
    same = {name: texts == outputs[base_name] for name, texts in outputs.items() if name != base_name}
    base = results[base_name]
    print(f"\n{args.requests} requests, prompts {min(prompt_lens)}..{max(prompt_lens)} tokens, "
          f"max_new_tokens {min(s['max_new_tokens'] for s in specs)}..{max(s['max_new_tokens'] for s in specs)}; "
          f"texts equal to continuous (batch 8): {same}\n")
    print("| regime | tok/s | ratio | tok per CPU-s | ratio | p50 latency s | ratio | p99 latency s | ratio "
          "| p50 TTFT s | executor ms per step/batch | tokens per step/batch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        keys = ("tok_s", "tok_per_cpu_s", "latency_p50_s", "latency_p99_s")
        r["ratios_vs_continuous_b8"] = q = {k: r[k] / base[k] for k in keys}
        cells = " | ".join(f"{r[k]:.{1 if k.startswith('tok') else 2}f} | {q[k]:.2f}" for k in keys)
        print(f"| {name} | {cells} | {r['ttft_p50_s']:.2f} | {r['ms_per_call']:.1f} | {r['tokens_per_call']:.1f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python bench/continuous.py " + " ".join(f"--{k} {v}" for k, v in
                                                            [("requests", args.requests), ("seed", args.seed),
                                                             ("repeats", args.repeats)]),
        "source": source,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
                    "mlx": mx.__version__, "device": str(mx.default_device())},
        "workload": {"requests": args.requests, "prompt_tokens": prompt_lens,
                     "max_new_tokens": [s["max_new_tokens"] for s in specs], "sampler": "greedy"},
        "texts_equal_to_continuous_b8": same,
        "regimes": results,
    }, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
