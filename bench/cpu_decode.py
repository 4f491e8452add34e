"""The native CPU decode step (``decode_path="native"``, models/decoder/cpu) beside the exact path
(``"matmul"``) on SmolLM2-135M (issue 39): quality and speed.

- quality (``--part quality``): teacher-forced decode over a fixed real-text corpus (default: the
  running Python's LICENSE.txt, the first ``--tokens`` tokens, split into ``--rows`` consecutive
  chunks decoded as one batch), every token through the one-token decode step of each path: the
  perplexity of each path (exp of the mean negative log-likelihood of the next token), their ratio,
  and the top-1 agreement (the share of positions whose argmax is the same). The same for the
  prefill (``prefill_*``): each chunk in one forward, the native path's over its int8 GEMM
  (``NativeDecode.prefill_state``), every position's logits scored.
- speed (``--part speed``): milliseconds per decode step of B rows (B in ``--batch``) at a context
  of ``--context`` tokens, alternating the two paths ``--rounds`` times, medians; tok/s = B / step.
  The load average is recorded with each round.

    .venv/bin/python bench/cpu_decode.py                  # both parts, JSON to bench/results/cpu_decode.json
    OMP_NUM_THREADS=2 .venv/bin/python bench/cpu_decode.py --part speed --batch 1 8 32

Threads: ``OMP_NUM_THREADS`` (the native step's pool and MLX's OpenMP kernels), else the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_serving.models import loader, sources
from mlx_serving.models.decoder import layers
from mlx_serving.models.decoder.attention import Rows
from mlx_serving.models.decoder.decode_backends import DecodeBackend, NativeDecode, decode_backend
from mlx_serving.models.decoder.kv_cache import PagedKVCache, init_paged_kv_cache, row_blocks
from mlx_serving.tokenization import Tokenizer


def default_corpus() -> Path:
    """The running Python's LICENSE.txt (a fixed English text wherever CPython is installed)."""
    return Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"


def _step(state: layers.State, backend: DecodeBackend, cache: PagedKVCache, tokens: np.ndarray, pos: int,
          table: mx.array) -> mx.array:
    b = len(tokens)
    rows = Rows(mx.array(tokens.reshape(b, 1).astype(np.int32)), mx.full((b,), pos, mx.int32),
                mx.ones((b,), mx.int32), pos + 1, mx.zeros((b,), mx.int32), table, dense=b == 1)
    logits = layers.forward(state, cache, rows, backend)
    mx.eval(logits, cache.keys, cache.values)
    return logits


def quality(state: layers.State, ids: np.ndarray, rows: int) -> dict[str, float]:
    """Perplexity of each path and top-1 agreement over ``ids`` split into ``rows`` chunks."""
    n = len(ids) // rows
    chunks = ids[: n * rows].reshape(rows, n)
    table = mx.array(row_blocks(rows, n))
    out: dict[str, float] = {}
    argmax: dict[str, np.ndarray] = {}
    for name in ("matmul", "native"):
        backend = decode_backend(state, name)
        if backend.name != name:
            raise SystemExit(f"the {name} path does not apply here")
        cache = init_paged_kv_cache(state, rows * -(-n // 16))
        nll, top = [], []
        for p in range(n - 1):
            logits = np.array(_step(state, backend, cache, chunks[:, p], p, table), dtype=np.float64)
            nll.extend(_scores(logits, chunks[:, p + 1]))
            top.append(logits.argmax(1))
        out[f"ppl_{name}"] = float(np.exp(np.mean(nll)))
        argmax[name] = np.stack(top)
    out["ppl_ratio"] = out["ppl_native"] / out["ppl_matmul"]
    out["top1_agreement"] = float((argmax["native"] == argmax["matmul"]).mean())
    out["tokens_scored"] = float(rows * (n - 1))
    return out


def _scores(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihoods of ``targets`` (M,) under ``logits`` (M, vocab)."""
    logp = logits.astype(np.float64) - logits.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    return -logp[np.arange(len(targets)), targets]


def prefill_quality(state: layers.State, ids: np.ndarray, rows: int) -> dict[str, float]:
    """As :func:`quality`, each chunk prefilled in one forward (all positions' logits gathered)."""
    n = len(ids) // rows
    chunks = ids[: n * rows].reshape(rows, n)
    table = mx.array(row_blocks(rows, n))
    gather = mx.array([r * n + p for r in range(rows) for p in range(n - 1)], dtype=mx.int32)
    targets = chunks[:, 1:].reshape(-1)
    out: dict[str, float] = {}
    argmax: dict[str, np.ndarray] = {}
    for name in ("matmul", "native"):
        backend = decode_backend(state, name)
        forward_state = backend.prefill_state if isinstance(backend, NativeDecode) else state
        cache = init_paged_kv_cache(state, rows * -(-n // 16))
        tokens = mx.array(chunks.astype(np.int32))
        batch = Rows(tokens, mx.zeros((rows,), mx.int32), mx.full((rows,), n, mx.int32), n, mx.zeros((rows,), mx.int32),
                     table, gather=gather)
        logits = np.array(layers.forward(forward_state, cache, batch), dtype=np.float64)
        out[f"prefill_ppl_{name}"] = float(np.exp(_scores(logits, targets).mean()))
        argmax[name] = logits.argmax(1)
    out["prefill_ppl_ratio"] = out["prefill_ppl_native"] / out["prefill_ppl_matmul"]
    out["prefill_top1_agreement"] = float((argmax["native"] == argmax["matmul"]).mean())
    return out


def speed(state: layers.State, batch: int, context: int, steps: int, rounds: int) -> dict[str, object]:
    """Median ms per decode step of ``batch`` rows at ``context`` tokens, the two paths alternating."""
    table = mx.array(row_blocks(batch, context + steps + 1))
    blocks = batch * table.shape[1]
    runs: dict[str, list[float]] = {"matmul": [], "native": []}
    loads = []
    tokens = np.full(batch, 100)
    for _ in range(rounds):
        loads.append(os.getloadavg()[0])
        for name in runs:
            backend = decode_backend(state, name)
            cache = init_paged_kv_cache(state, blocks)
            times = []
            for p in range(context, context + steps):
                t0 = time.perf_counter()
                _step(state, backend, cache, tokens, p, table)
                times.append(time.perf_counter() - t0)
            runs[name].append(statistics.median(times[2:]) * 1e3)
    ms = {name: statistics.median(v) for name, v in runs.items()}
    return {"batch": batch, "context": context, "ms_matmul": ms["matmul"], "ms_native": ms["native"],
            "tok_s_matmul": batch * 1e3 / ms["matmul"], "tok_s_native": batch * 1e3 / ms["native"],
            "speedup": ms["matmul"] / ms["native"], "rounds": runs, "loadavg_1min": loads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("quality", "speed", "both"), default="both")
    ap.add_argument("--model", default=None, help="a model source (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--corpus", type=Path, default=default_corpus(), help="the text scored (quality)")
    ap.add_argument("--tokens", type=int, default=2048, help="corpus tokens scored (quality)")
    ap.add_argument("--rows", type=int, default=8, help="chunks decoded as one batch (quality)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="rows per step (speed)")
    ap.add_argument("--context", type=int, default=128, help="tokens already in each row's cache (speed)")
    ap.add_argument("--steps", type=int, default=32, help="steps timed per round (speed)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (speed)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu_decode.json")
    args = ap.parse_args()
    resolved = sources.resolve(args.model)
    state = loader.load(resolved.path)
    report: dict[str, object] = {"model": resolved.name, "threads": os.environ.get("OMP_NUM_THREADS"),
                                 "isa": _isa(), "loadavg_start": os.getloadavg()}
    if args.part in ("quality", "both"):
        ids = np.array(Tokenizer.from_dir(resolved.path).encode(args.corpus.read_text())[: args.tokens])
        report["quality"] = {"corpus": str(args.corpus), **quality(state, ids, args.rows),
                             **prefill_quality(state, ids, args.rows)}
        print(json.dumps(report["quality"]), flush=True)
    if args.part in ("speed", "both"):
        report["speed"] = []
        for b in args.batch:
            r = speed(state, b, args.context, args.steps, args.rounds)
            report["speed"].append(r)  # type: ignore[attr-defined]
            print(f"B={b:>3} ctx={args.context}: matmul {r['ms_matmul']:.2f} ms ({r['tok_s_matmul']:.1f} tok/s)  "
                  f"native {r['ms_native']:.2f} ms ({r['tok_s_native']:.1f} tok/s)  x{r['speedup']:.2f}  "
                  f"load {r['loadavg_1min']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


def _isa() -> str | None:
    from mlx_serving.models.native import cpu_decode_module

    module = cpu_decode_module()
    return None if module is None else str(module.decoder_isa())


if __name__ == "__main__":
    main()
