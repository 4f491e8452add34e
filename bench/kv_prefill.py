"""Native CPU prefill over each KV cache dtype (issue 42): CPU time per prefill of one prompt on the
"native" path (the int8 GEMM products and the native paged attention), and per decode step after it.

Every figure is process CPU time (``time.process_time``: all threads), the robust one on a shared
machine; the dtypes alternate ``--rounds`` times and each figure is the median over rounds of the
per-round median. The load average is reported with each round.

    OMP_NUM_THREADS=1 .venv/bin/python bench/kv_prefill.py --tokens 32 128 512 --dtypes float16 int8 int4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mlx.core as mx
import numpy as np

from mlx_serving.models import loader, sources
from mlx_serving.models.decoder import layers
from mlx_serving.models.decoder.attention import Rows
from mlx_serving.models.decoder.cpu import NativeDecode, native_decode
from mlx_serving.models.decoder.kv_cache import init_paged_kv_cache, row_blocks


def _rows(tokens: np.ndarray, start: int, width: int) -> Rows:
    n = tokens.shape[0]
    one = mx.array([start], mx.int32)
    return Rows(mx.array(tokens[None].astype(np.int32)), one, mx.array([n], mx.int32), start + n,
                mx.array([n - 1], mx.int32), mx.array(row_blocks(1, width)))


def _round(state: layers.State, native: NativeDecode, dtype: str, prompt: np.ndarray, steps: int,
           repeats: int) -> tuple[float, float]:
    """(median CPU ms per prefill of ``prompt``, median CPU ms per decode step after it)."""
    n = prompt.shape[0]
    width = n + steps + 16
    pre, dec = [], []
    for _ in range(repeats):
        cache = init_paged_kv_cache(state, -(-width // 16), 16, dtype)
        c0 = time.process_time()
        logits = layers.forward(native.prefill_state, cache, _rows(prompt, 0, width))
        mx.eval(logits, cache.arrays())
        pre.append(time.process_time() - c0)
        tok = int(np.argmax(np.array(logits[0])))
        for p in range(n, n + steps):
            c0 = time.process_time()
            logits = layers.forward(state, cache, _rows(np.array([tok]), p, width), decode=native)
            mx.eval(logits, cache.arrays())
            dec.append(time.process_time() - c0)
            tok = int(np.argmax(np.array(logits[0])))
    return statistics.median(pre) * 1e3, statistics.median(dec) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--dtypes", nargs="+", default=["float16", "int8", "int4"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="prefills per round")
    ap.add_argument("--steps", type=int, default=8, help="decode steps after each prefill")
    args = ap.parse_args()
    state = loader.load(sources.resolve(args.model).path)
    native = native_decode(state)
    assert native is not None, "the native decode path does not apply"
    rng = np.random.default_rng(0)
    for n in args.tokens:
        prompt = rng.integers(100, state.config.vocab_size - 100, size=n)
        pre: dict[str, list[float]] = {d: [] for d in args.dtypes}
        dec: dict[str, list[float]] = {d: [] for d in args.dtypes}
        loads = []
        for _ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for d in args.dtypes:
                p, q = _round(state, native, d, prompt, args.steps, args.repeats)
                pre[d].append(p)
                dec[d].append(q)
        out = {"tokens": n, "threads": os.environ.get("OMP_NUM_THREADS"),
               "prefill_cpu_ms": {d: round(statistics.median(v), 2) for d, v in pre.items()},
               "prefill_tok_per_cpu_s": {d: round(n * 1e3 / statistics.median(v), 1) for d, v in pre.items()},
               "decode_cpu_ms": {d: round(statistics.median(v), 3) for d, v in dec.items()},
               "loadavg_1min": loads}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
