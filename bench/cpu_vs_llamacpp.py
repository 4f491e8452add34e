"""Our CPU path beside llama.cpp on the same GGUF and the same thread count (issue 24).

Two parts, each run alternately (ours, theirs, ours, theirs, ...) ``--runs`` times (default 3),
medians per side and ratios ours / theirs over the medians:

- kernel: ``llama-bench -m GGUF -p 512 -n 128 -t 2 -r 3 -o json`` (pp512 and tg128 tok/s) vs a
  ``Serving`` (``text_generation.from_mlx4bit(dir, max_len=1024, max_batch=1)``) on the same model
  converted to MLX, in a child process with ``OMP_NUM_THREADS=2``: a 512-token prompt (its token
  count checked against the serving's) with ``max_new_tokens = min_tokens = 128`` (EOS cannot end
  it), prefill = prompt tokens / time to first token, decode = (tokens - 1) / (last - first token
  time), from the stream's arrival times; and the tg128 analogue: a 1-token prompt, 128 tokens.
  ``--kernel-prompt N`` runs ppN instead of pp512. A different prompt of the same length and a different 1-token prompt warm the serving up first (no
  prefix caching here), as llama-bench warms up each test.
- servers: ``llama-server -m GGUF -t 2 --parallel N -c N*320`` vs ``mlx-serving serve --model GGUF
  --max-batch N --max-len 320`` (``OMP_NUM_THREADS=2``), each started fresh per run, warmed up by
  one request, then driven by the official ``openai`` async client: N concurrent streamed
  completions (``/v1/completions``, greedy), 2N requests (at least 4), each a distinct 128-token
  prompt and 128 generated tokens (``ignore_eos`` for llama-server, ``min_tokens`` for ours);
  aggregate generated tok/s (tokens / wall), TTFT p50/p90, ITL p50 (gaps between streamed
  chunks), errors (raised or timed out), short (fewer tokens than asked), peak RSS (VmHWM of the
  server process and its children, sampled from /proc) for N = 1, 8, 32. Ours runs as
  ``python -m mlx_serving.models serve`` (the ``mlx-serving`` script's entry point). Each request
  opens its own connection (no keep-alive) and is never retried. llama-server (this version:
  ``0.5.0-dev``) with an explicit ``--parallel`` keeps one KV buffer per slot (``--kv-unified`` is
  only on with ``--parallel`` auto), so ``-c N*320`` gives each slot 320 positions like our
  ``--max-len``; it honours ``max_tokens`` and ``ignore_eos`` (checked: a chat prompt that stops
  after 16 tokens runs to 64 with ``ignore_eos``) and streams ``usage``; its other settings are
  its defaults (prompt cache, ``--cache-ram`` 8 GiB, polling threads).
- quick (``--quick``): one run, N = 1 and 8, 64-token kernel prompt, 16 new tokens, 32-token
  server prompts, llama-bench ``-r 1``; JSON to /tmp/cpu_vs_llamacpp_quick.json.

Every run's raw numbers, its load averages before it, the medians, ratios and the machine (CPU
model, cores, versions, llama.cpp commit) go to bench/results/cpu_vs_llamacpp.json; a markdown
table (figure | llama.cpp | ours | ratio | target) is printed at the end.

Commands (a quiet machine: nothing else running)::

    nice -n 19 .venv/bin/python bench/llamacpp.py build --native --target llama-bench --target llama-server
    .venv/bin/python bench/cpu_vs_llamacpp.py            # full: 3 runs, N = 1, 8, 32
    .venv/bin/python bench/cpu_vs_llamacpp.py --quick    # smoke: 1 run, N = 1, 8, short; /tmp
    .venv/bin/python bench/cpu_vs_llamacpp.py --kernel-only --decode-path native   # issue 39's step
    .venv/bin/python bench/cpu_vs_llamacpp.py --servers-only --streams 32 --runs 1   # the 32 streams

``--streams`` picks the server levels N, ``--runs`` the rounds, ``--servers-only`` skips the kernel
part and ``--kernel-only`` the servers; ``--decode-path`` reaches both our kernel child and our
server (``serve --decode-path``), ``--serve-args`` adds flags to our server's command.

The first command builds llama.cpp (vendored by the llama-cpp-python sdist, bench/llamacpp.py)
with ``-DGGML_NATIVE=ON`` into the cache; this script builds it too when missing. The default
model is SmolLM2-135M-Instruct (GGUF Q4_1 from PyPI, ``sources.PACKAGED``); ``--model`` takes
another .gguf file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

# bench/ holds scripts named like the packages (bench/tokenization.py): keep it off sys.path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.append(str(Path(__file__).resolve().parent.parent))  # for bench.llamacpp

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402

from bench import llamacpp  # noqa: E402
from bench.http_load import _free_port  # noqa: E402

_WORDS = ("river", "lantern", "orbit", "copper", "meadow", "signal", "harbor", "quartz", "ember", "violet",
          "garden", "silver", "thunder", "marble", "window", "forest", "pepper", "canyon", "velvet", "rocket")
_MAX_LEN = 320  # KV positions per sequence in the server part (llama-server: -c N * 320)


@dataclass(frozen=True)
class Settings:
    """What one invocation measures."""

    threads: int
    runs: int
    levels: tuple[int, ...]
    kernel_prompt: int
    kernel_gen: int
    bench_reps: int
    server_prompt: int
    server_gen: int
    request_timeout: float
    decode_path: str | None = None  # ours: the engine's decode path (None: its default; "native": issue 39)
    kernel: bool = True  # run the kernel part (False: --servers-only)
    serve_args: tuple[str, ...] = ()  # ours: more ``serve`` flags (--serve-args)


FULL = Settings(threads=2, runs=3, levels=(1, 8, 32), kernel_prompt=512, kernel_gen=128, bench_reps=3,
                server_prompt=128, server_gen=128, request_timeout=600.0)
QUICK = Settings(threads=2, runs=1, levels=(1, 8), kernel_prompt=64, kernel_gen=16, bench_reps=1,
                 server_prompt=32, server_gen=16, request_timeout=120.0)


# -- prompts ---------------------------------------------------------------------------------------

def exact_prompt(tokenizer: Any, n_tokens: int, seed: int) -> str:
    """A text of seeded random English words (distinct per seed) that our tokenizer encodes to
    exactly ``n_tokens`` ids: the decoded first ``n_tokens`` ids of a longer text, re-encoded to
    check."""
    rng = np.random.default_rng(seed)
    text = f"{seed}." + "".join(" " + str(w) for w in rng.choice(_WORDS, size=2 * n_tokens))
    prefix = tokenizer.decode(tokenizer.encode(text)[:n_tokens])
    if len(tokenizer.encode(prefix)) != n_tokens:
        raise ValueError(f"seed {seed}'s words do not round-trip to {n_tokens} tokens")
    return prefix


# -- ours: the kernel figures in a child process ---------------------------------------------------

def _stream_times(serving: Any, text: str, gen: int) -> dict[str, Any]:
    """One streamed request: arrival times of its text pieces (s, from the call) and its final dict."""
    t0 = time.perf_counter()
    times: list[float] = []
    final: dict[str, Any] = {}
    request = {"text": text, "max_new_tokens": gen, "min_tokens": gen}
    with serving.stream(request) as stream:
        for item in stream:
            if isinstance(item, str):
                times.append(time.perf_counter() - t0)
            else:
                final = item
    return {"times": times, "final": final}


def _speeds(sample: dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
    times, final = sample["times"], sample["final"]
    if final["token_summary"]["input"] != prompt_tokens:
        raise ValueError(f"the prompt is {final['token_summary']['input']} tokens, not {prompt_tokens}")
    tokens = final["num_tokens"]
    return {"prompt_tokens": prompt_tokens, "tokens": tokens, "ttft_s": times[0],
            "prefill_tok_s": prompt_tokens / times[0], "decode_tok_s": (tokens - 1) / (times[-1] - times[0]),
            "engine_timing_ms": final.get("timing")}


def ours_kernel(checkpoint: Path, prompt_tokens: int, gen: int, decode_path: str | None = None) -> dict[str, Any]:
    """Prefill and decode of a ``prompt_tokens`` prompt, and decode from a 1-token prompt
    (the tg analogue), through one inline ``Serving`` (its engine on ``decode_path``)."""
    from mlx_serving.models import text_generation

    serving = text_generation.from_mlx4bit(checkpoint, max_len=1024, max_batch=1, max_new_tokens=gen,
                                           prefix_caching=False, decode_path=decode_path)
    try:
        tokenizer = serving_tokenizer(checkpoint)
        _stream_times(serving, exact_prompt(tokenizer, prompt_tokens, seed=1), 4)  # warm-up, both shapes
        _stream_times(serving, "A", 4)
        long = _speeds(_stream_times(serving, exact_prompt(tokenizer, prompt_tokens, seed=0), gen), prompt_tokens)
        short = _speeds(_stream_times(serving, "The", gen), 1)
    finally:
        serving.close()
    return {"prefill": long, "tg": short}


def serving_tokenizer(checkpoint: Path) -> Any:
    from mlx_serving.tokenization import Tokenizer

    return Tokenizer.from_dir(checkpoint)


def run_ours_kernel(checkpoint: Path, s: Settings) -> dict[str, Any]:
    """``ours_kernel`` in a fresh child process with ``OMP_NUM_THREADS`` = the thread count."""
    env = {**os.environ, "OMP_NUM_THREADS": str(s.threads)}
    out = subprocess.run([sys.executable, __file__, "--ours-kernel", str(checkpoint), str(s.kernel_prompt),
                          str(s.kernel_gen), *(["--decode-path", s.decode_path] if s.decode_path else [])],
                         env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"ours kernel child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- theirs: llama-bench --------------------------------------------------------------------------

def run_llama_bench(bin_dir: Path, gguf: Path, s: Settings) -> dict[str, Any]:
    """``llama-bench -o json``: tok/s of the pp and tg tests (mean over its ``-r`` repetitions)."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", str(s.kernel_prompt), "-n", str(s.kernel_gen),
           "-t", str(s.threads), "-r", str(s.bench_reps), "-o", "json"]
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    pp = next(r for r in rows if r["n_gen"] == 0)
    tg = next(r for r in rows if r["n_prompt"] == 0)
    return {"command": " ".join(cmd), "pp_tok_s": pp["avg_ts"], "tg_tok_s": tg["avg_ts"],
            "pp_samples_ts": pp.get("samples_ts"), "tg_samples_ts": tg.get("samples_ts"),
            "build_commit": pp.get("build_commit"), "cpu_info": pp.get("cpu_info")}


# -- servers --------------------------------------------------------------------------------------

def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def _hwm_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class PeakRss:
    """Samples the summed VmHWM of a process tree every 0.2 s in a thread until ``stop``;
    ``peak_mib`` is the largest sum seen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_kib, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self.peak_kib = max(self.peak_kib, sum(_hwm_kib(p) for p in _tree(self.pid)))
            if self._stop.wait(0.2):
                return

    @property
    def peak_mib(self) -> float:
        return self.peak_kib / 1024

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@contextmanager
def server(command: list[str], port: int, env: dict[str, str], log: Path) -> Iterator[tuple[str, PeakRss]]:
    """Start a server, wait for ``GET /health`` = 200 (300 s at most), yield its URL and RSS
    sampler; always terminate it (then kill after 30 s) and stop the sampler."""
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    rss = PeakRss(process.pid)
    try:
        end = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"{command[0]} did not become healthy in 300 s")
            time.sleep(0.2)
        yield url, rss
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        rss.stop()


@dataclass
class Request:
    """One streamed completion: seconds from send to each non-empty chunk, tokens, error."""

    chunk_s: list[float]
    tokens: int
    error: str | None


async def _one_request(client: openai.AsyncOpenAI, model: str, prompt: str, gen: int,
                       extra: dict[str, Any]) -> Request:
    t0 = time.perf_counter()
    chunks: list[float] = []
    usage: int | None = None
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=gen, temperature=0.0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body=extra)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        if any(c.text for c in chunk.choices):
            chunks.append(time.perf_counter() - t0)
    return Request(chunks, usage if usage is not None else len(chunks), None)


async def drive(url: str, model: str, prompts: list[str], concurrency: int, gen: int, extra: dict[str, Any],
                timeout: float) -> tuple[list[Request], float]:
    """All ``prompts`` through ``concurrency`` concurrent streams; each bounded by ``timeout``, no
    retries. A fresh connection per request (no keep-alive): a pooled connection that the server
    closed while idle would fail a request on the client's side."""
    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=concurrency + 4,
                                                              max_keepalive_connections=0))
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout,
                                http_client=http)
    gate = asyncio.Semaphore(concurrency)

    async def bounded(prompt: str) -> Request:
        async with gate:
            try:
                return await asyncio.wait_for(_one_request(client, model, prompt, gen, extra), timeout)
            except (openai.OpenAIError, asyncio.TimeoutError) as exc:
                return Request([], 0, f"{type(exc).__name__}: {exc} ({exc.__cause__!r})"[:300])

    start = time.perf_counter()
    try:
        done = await asyncio.gather(*(bounded(p) for p in prompts))
    finally:
        await client.close()
    return list(done), time.perf_counter() - start


def summarize(requests: list[Request], wall: float, gen: int) -> dict[str, Any]:
    ok = [r for r in requests if r.error is None and r.chunk_s]
    ttft = np.array([r.chunk_s[0] for r in ok]) * 1e3
    itl = np.concatenate([np.diff(r.chunk_s) for r in ok] or [np.array([])]) * 1e3
    tokens = sum(r.tokens for r in ok)
    return {"requests": len(requests), "errors": sum(r.error is not None for r in requests),
            "short": sum(r.tokens < gen for r in ok), "tokens": tokens, "chunks": sum(len(r.chunk_s) for r in ok),
            "wall_s": wall, "tok_s": tokens / wall,
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p90_ms": _pct(ttft, 90), "itl_p50_ms": _pct(itl, 50),
            "first_errors": [r.error for r in requests if r.error][:3]}


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def server_commands(side: str, bin_dir: Path, gguf: Path, n: int, port: int, threads: int,
                    decode_path: str | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    if side == "theirs":
        return [str(bin_dir / "llama-server"), "-m", str(gguf), "-t", str(threads), "--parallel", str(n),
                "-c", str(n * _MAX_LEN), "--port", str(port), "--host", "127.0.0.1"]
    return [sys.executable, "-m", "mlx_serving", "serve", "--model", str(gguf), "--max-batch", str(n),
            "--max-len", str(_MAX_LEN), "--port", str(port), "--log-level", "warning",
            *(["--decode-path", decode_path] if decode_path else []), *extra]


def no_eos(side: str, gen: int) -> dict[str, Any]:
    """The request field that keeps EOS from ending a completion before ``gen`` tokens."""
    return {"ignore_eos": True} if side == "theirs" else {"min_tokens": gen}


def run_server(side: str, bin_dir: Path, gguf: Path, n: int, prompts: list[str], s: Settings,
               logs: Path) -> dict[str, Any]:
    """One fresh server of ``side`` at ``--parallel`` / ``--max-batch`` N: warm-up, load, peak RSS."""
    port = _free_port()
    ours = side == "ours"
    command = server_commands(side, bin_dir, gguf, n, port, s.threads, s.decode_path if ours else None,
                              s.serve_args if ours else ())
    env = {**os.environ, "OMP_NUM_THREADS": str(s.threads)}
    with server(command, port, env, logs / f"{side}_n{n}.log") as (url, rss):
        warm, _ = asyncio.run(drive(url, gguf.stem, ["Hello"], 1, 2, no_eos(side, 2), s.request_timeout))
        if warm[0].error:
            raise RuntimeError(f"{side} warm-up request failed: {warm[0].error}")
        requests, wall = asyncio.run(drive(url, gguf.stem, prompts, n, s.server_gen, no_eos(side, s.server_gen),
                                           s.request_timeout))
    return {"command": " ".join(command), **summarize(requests, wall, s.server_gen), "peak_rss_mib": rss.peak_mib}


# -- the report -----------------------------------------------------------------------------------

def figures(levels: tuple[int, ...], kernel: bool = True) -> list[tuple[str, str, float | None, str]]:
    """The table's rows: (figure key, label, target ratio ours / theirs or None, "higher" or
    "lower": which way is better for ours; the kernel rows only with ``kernel``). The 32-stream targets
    apply to the largest level >= 32."""
    rows: list[tuple[str, str, float | None, str]] = [
        ("kernel.pp_tok_s", "prompt processing (pp, tok/s)", 1.0, "higher"),
        ("kernel.tg_tok_s", "single-stream decode (tg, tok/s)", 0.8, "higher")] if kernel else []
    for n in levels:
        big = n == max(levels) and n >= 32
        rows += [(f"server.{n}.tok_s", f"N={n}: aggregate tok/s", 2.0 if big else None, "higher"),
                 (f"server.{n}.ttft_p50_ms", f"N={n}: TTFT p50 (ms)", 1.0 if big else None, "lower"),
                 (f"server.{n}.ttft_p90_ms", f"N={n}: TTFT p90 (ms)", None, "lower"),
                 (f"server.{n}.itl_p50_ms", f"N={n}: ITL p50 (ms)", None, "lower"),
                 (f"server.{n}.errors", f"N={n}: errors", None, "lower"),
                 (f"server.{n}.peak_rss_mib", f"N={n}: peak RSS (MiB)", 1.5, "lower")]
    return rows


def flat(run: dict[str, Any], side: str) -> dict[str, float | None]:
    """One run's figures of ``side`` under the keys of :func:`figures`."""
    k = run["kernel"].get(side)
    out: dict[str, float | None] = (
        {} if k is None else
        {"kernel.pp_tok_s": k["pp_tok_s"], "kernel.tg_tok_s": k["tg_tok_s"]} if side == "theirs" else
        {"kernel.pp_tok_s": k["prefill"]["prefill_tok_s"], "kernel.tg_tok_s": k["tg"]["decode_tok_s"],
         "kernel.decode_after_prompt_tok_s": k["prefill"]["decode_tok_s"]})
    for n, level in run["server"].items():
        for key in ("tok_s", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "errors", "peak_rss_mib"):
            out[f"server.{n}.{key}"] = level[side][key]
    return out


def medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for side in ("ours", "theirs"):
        values: dict[str, list[float]] = {}
        for run in runs:
            for key, v in flat(run, side).items():
                values.setdefault(key, [])
                if v is not None:
                    values[key].append(v)
        out[side] = {key: statistics.median(v) if v else None for key, v in values.items()}
    out["ratio"] = {key: (v / out["theirs"][key]) if v is not None and out["theirs"].get(key) else None
                    for key, v in out["ours"].items()}
    return out


def table(med: dict[str, dict[str, float | None]], levels: tuple[int, ...], kernel: bool = True) -> str:
    lines = ["| figure | llama.cpp | ours | ratio | target |", "|---|---|---|---|---|"]
    for key, label, target, better in figures(levels, kernel):
        theirs, ours, ratio = med["theirs"].get(key), med["ours"].get(key), med["ratio"].get(key)
        goal = ""
        if target is not None:
            met = ratio is not None and (ratio >= target if better == "higher" else ratio <= target)
            goal = f"{'>=' if better == 'higher' else '<='} {target:g}x ({'met' if met else 'NOT met'})"
        lines.append(f"| {label} | {_fmt(theirs)} | {_fmt(ours)} | {_fmt(ratio, 'x')} | {goal} |")
    return "\n".join(lines)


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, int):
        return str(v)
    return f"{v:.2f}{unit}" if abs(v) < 100 else f"{v:.0f}{unit}"


def machine(bin_dir: Path) -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    server = bin_dir / "llama-server"
    server_version = (subprocess.run([str(server), "--version"], capture_output=True, text=True)
                      if server.is_file() else None)  # --kernel-only builds llama-bench alone
    return {"cpu_model": model, "cpu_count": os.cpu_count(), "avx512_vnni": "avx512_vnni" in flags,
            "platform": platform.platform(), "python": platform.python_version(),
            "mlx": version("mlx"), "openai": version("openai"),
            "llama_cpp": f"ggml-org/llama.cpp@{llamacpp.LLAMA_CPP_COMMIT} (llama-cpp-python "
                         f"{llamacpp.LLAMA_CPP_PYTHON_VERSION} sdist), -DGGML_NATIVE=ON, {bin_dir}",
            "llama_server_version": None if server_version is None
            else (server_version.stdout + server_version.stderr).strip()[-300:]}


# -- main -----------------------------------------------------------------------------------------

def one_run(r: int, bin_dir: Path, gguf: Path, checkpoint: Path, server_prompts: dict[int, list[str]],
            s: Settings, logs: Path) -> dict[str, Any]:
    """Run ``r``: the kernel figures (ours, then theirs; unless ``s.kernel`` is off), then each level's
    servers (ours, then theirs); ``os.getloadavg()`` before each."""
    run: dict[str, Any] = {"run": r, "kernel": {}, "server": {}, "loadavg": {}}
    for side in ("ours", "theirs") if s.kernel else ():
        run["loadavg"][f"kernel.{side}"] = os.getloadavg()
        run["kernel"][side] = run_ours_kernel(checkpoint, s) if side == "ours" else run_llama_bench(bin_dir, gguf, s)
        print(f"run {r} kernel {side}: {_brief(run['kernel'][side])}", file=sys.stderr)
    for n in s.levels:
        run["server"][n] = {}
        for side in ("ours", "theirs"):
            run["loadavg"][f"server.{n}.{side}"] = os.getloadavg()
            run["server"][n][side] = run_server(side, bin_dir, gguf, n, server_prompts[n], s, logs)
            print(f"run {r} N={n} {side}: {_brief(run['server'][n][side])}", file=sys.stderr)
    return run


def _brief(result: dict[str, Any]) -> str:
    skip = ("command", "pp_samples_ts", "tg_samples_ts", "cpu_info", "first_errors")
    return json.dumps({k: v for k, v in result.items() if k not in skip}, default=str)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 run, N = 1 and 8, short prompts and outputs; /tmp")
    ap.add_argument("--model", type=Path, default=None, help="a .gguf file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/"
                    "cpu_vs_llamacpp.json; --quick: /tmp/cpu_vs_llamacpp_quick.json)")
    ap.add_argument("--decode-path", default=None, help="ours: the engine's decode path (e.g. native: the CPU "
                    "decode step of issue 39; default: the engine's default)")
    ap.add_argument("--kernel-only", action="store_true", help="the kernel figures only (no servers)")
    ap.add_argument("--servers-only", action="store_true", help="the server figures only (no kernel part)")
    ap.add_argument("--streams", type=int, nargs="+", default=None, metavar="N",
                    help="the server levels N (--parallel / --max-batch; default 1 8 32, --quick: 1 8)")
    ap.add_argument("--runs", type=int, default=None, help="alternating rounds (default 3, --quick: 1)")
    ap.add_argument("--serve-args", default="", help="ours: more serve flags, one string (e.g. "
                    "'--max-step-tokens 256')")
    ap.add_argument("--kernel-prompt", type=int, default=None, help="the kernel part's prompt tokens (pp N; "
                    "default 512, --quick: 64)")
    ap.add_argument("--ours-kernel", nargs=3, metavar=("DIR", "PROMPT", "GEN"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.ours_kernel:
        print(json.dumps(ours_kernel(Path(args.ours_kernel[0]), int(args.ours_kernel[1]), int(args.ours_kernel[2]),
                                     args.decode_path)))
        return 0
    if args.kernel_only and args.servers_only:
        ap.error("--kernel-only and --servers-only exclude each other")
    s = replace(QUICK if args.quick else FULL, decode_path=args.decode_path, kernel=not args.servers_only,
                serve_args=tuple(shlex.split(args.serve_args)))
    s = replace(s, levels=() if args.kernel_only else tuple(args.streams or s.levels), runs=args.runs or s.runs,
                kernel_prompt=args.kernel_prompt or s.kernel_prompt)
    out = args.out or (Path("/tmp/cpu_vs_llamacpp_quick.json") if args.quick
                       else Path(__file__).parent / "results" / "cpu_vs_llamacpp.json")
    from mlx_serving.models import sources

    gguf = args.model or sources.fetch_packaged(sources.PACKAGED["smollm2-135m-instruct"])
    checkpoint = sources.resolve(gguf).path
    targets = (("llama-bench",) if s.kernel else ()) + (("llama-server",) if s.levels else ())
    bin_dir = llamacpp.build(targets, native=True)
    tokenizer = serving_tokenizer(checkpoint)
    server_prompts = {n: [exact_prompt(tokenizer, s.server_prompt, seed=100 + i) for i in range(max(4, 2 * n))]
                      for n in s.levels}
    report: dict[str, Any] = {"settings": asdict(s), "model": str(gguf), "checkpoint": str(checkpoint),
                              "machine": machine(bin_dir), "runs": []}
    with tempfile.TemporaryDirectory(prefix="cpu_vs_llamacpp_") as tmp:
        for r in range(s.runs):
            report["runs"].append(one_run(r, bin_dir, gguf, checkpoint, server_prompts, s, Path(tmp)))
            report["medians"] = medians(report["runs"])
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {out}\n")
    print(table(report["medians"], s.levels, s.kernel))
    return 0


if __name__ == "__main__":
    sys.exit(main())
