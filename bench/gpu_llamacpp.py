"""llama.cpp's CUDA build beside ours on one GPU, on the project's own seeded checkpoint (issue 28).

The weights: ``write_checkpoint(DIR, "0.6b", quantized=False)`` (the seeded Qwen3-0.6B shape, dense
bf16, Hugging Face layout, seed 0: the weights the 4-bit bench checkpoint quantizes), converted
with llama.cpp's own ``convert_hf_to_gguf.py`` to GGUF bf16 and q8_0, and Q4_0 with
``llama-quantize``. llama.cpp is the tree vendored by the llama-cpp-python 0.3.36 sdist
(ggml-org/llama.cpp@0c1e57098, bench/llamacpp.py), built with ``-DGGML_CUDA=ON`` for sm_90.

The source .tgz (``.lcpp/llamacpp-src.tgz``, 11 MB): ``pip download --no-deps --no-binary :all:
llama-cpp-python==0.3.36``, then from the sdist's ``vendor/`` folder ``tar -czf
llamacpp-src.tgz --exclude=llama.cpp/models --exclude=llama.cpp/docs --exclude=llama.cpp/tests
--exclude=llama.cpp/media --exclude=llama.cpp/build --exclude=llama.cpp/benches llama.cpp``.

Steps (each a subcommand; ``WORK`` holds the build, the checkpoint and the GGUF files):

- ``build --src TGZ --work WORK``: unpack the trimmed source (a .tgz whose top folder is
  ``llama.cpp``) and start a detached ``nice`` build of llama-bench, llama-batched-bench,
  llama-quantize and llama-server (log: ``WORK/build.log``, ending ``BUILD_RC=<rc>``); needs only
  the standard library, so it can start before MLX is installed.
- ``weights --work WORK``: write the checkpoint to ``WORK/hf`` and the bf16 / q8_0 GGUF files
  (needs torch, as the converter does).
- ``tools --work WORK --out JSON``: wait for the build, make Q4_0, run ``llama-bench`` (pp512,
  tg128, 3 repetitions, all layers on the GPU, flash attention) on each GGUF file and
  ``llama-batched-bench`` (128 prompt / 128 generated tokens at 1, 32 and 128 parallel sequences)
  on bf16 and Q4_0; records their own figures (tok/s).
- ``server --work WORK --out JSON``: ``llama-server`` (bf16 GGUF, ``--parallel N`` slots,
  continuous batching, flash attention; as it ships, and with its experimental
  ``--backend-sampling``) and ``mlx-serving serve`` (the same weights' directory, ``--max-batch
  N``), all up at once; per N a warm-up round on each, then ``--rounds`` rounds, the order rotated
  each round. A round is N clients at once, each streaming one ``POST /v1/completions``
  (a 128-token prompt of one-token words, distinct per client, greedy, ``ignore_eos``,
  ``max_tokens`` 128) with httpx. Per round: output tok/s (completion tokens / wall from the first
  send to the last end), TTFT p50 / p99 (send -> first text), ITL p50 / p99 (gaps between a
  stream's text chunks, all streams pooled); each side's median round, and ours / each llama-server
  variant taken within each round, then the median (the target row uses the fastest variant).

Run on the GPU machine (bench/gpu_issue28.sh calls these in order); writes JSON as it goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

# bench/ holds scripts named like the packages (bench/tokenization.py): keep it off sys.path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.http_load: its server start-up, free ports

import numpy as np  # noqa: E402

if TYPE_CHECKING:
    import httpx

TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-server")
CMAKE = ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_NATIVE=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
         "-DCMAKE_BUILD_TYPE=Release")
FORMATS = ("bf16", "q8_0", "q4_0")
JSON = dict[str, Any]  # a JSON object as written


def bin_dir(work: Path) -> Path:
    return work / "llama.cpp" / "build" / "bin"


def gguf(work: Path, fmt: str) -> Path:
    return work / f"q06-{fmt}.gguf"


# --- build, weights -----------------------------------------------------------------------------------

def start_build(src: Path, work: Path, jobs: int) -> None:
    """Unpack ``src`` into ``work`` (once) and start the CMake build detached; returns at once."""
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "llama.cpp").is_dir():
        with tarfile.open(src) as tar:
            tar.extractall(work, filter="data")
    tree = work / "llama.cpp"
    targets = " ".join(f"--target {t}" for t in TARGETS)
    script = (f"cmake -S {tree} -B {tree}/build {' '.join(CMAKE)} > {work}/cmake.log 2>&1 && "
              f"nice -n 10 cmake --build {tree}/build -j{jobs} {targets} > {work}/build.log 2>&1; "
              f"echo BUILD_RC=$? >> {work}/build.log")
    subprocess.Popen(["setsid", "bash", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)


def write_weights(work: Path, formats: list[str]) -> None:
    """The dense bf16 checkpoint in ``work/hf`` and its GGUF conversions (``formats``: bf16, q8_0)."""
    from mlx_serving.models.seeded_checkpoint import write_checkpoint

    hf = work / "hf"
    if not (hf / "model.safetensors").is_file():
        write_checkpoint(hf, "0.6b", seed=0, quantized=False, dtype="bfloat16")
    env = {**os.environ, "PYTHONPATH": f"{work / 'llama.cpp' / 'gguf-py'}:{os.environ.get('PYTHONPATH', '')}"}
    for fmt in formats:
        if not gguf(work, fmt).is_file():
            subprocess.run([sys.executable, str(work / "llama.cpp" / "convert_hf_to_gguf.py"), str(hf), "--outtype",
                            fmt, "--outfile", str(gguf(work, fmt))], env=env, check=True,
                           stdout=subprocess.DEVNULL)
        print(f"{gguf(work, fmt).name}: {gguf(work, fmt).stat().st_size / 1e9:.2f} GB")


# --- tools -------------------------------------------------------------------------------------

def wait_build(work: Path, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    log = work / "build.log"
    while time.monotonic() < end:
        text = log.read_text() if log.is_file() else ""
        if m := re.search(r"BUILD_RC=(\d+)", text):
            if m.group(1) != "0":
                raise RuntimeError(f"llama.cpp build failed: {text[-2000:]}")
            return
        time.sleep(3)
    raise TimeoutError(f"llama.cpp build not done after {timeout_s} s")


def llama_bench(work: Path, fmt: str) -> list[JSON]:
    """llama-bench pp512 + tg128 (3 repetitions): its rows with avg/stddev tok/s."""
    out = subprocess.run([str(bin_dir(work) / "llama-bench"), "-m", str(gguf(work, fmt)), "-p", "512", "-n", "128",
                          "-ngl", "99", "-fa", "1", "-r", "3", "-o", "json"], capture_output=True, text=True,
                         timeout=240, check=True).stdout
    keep = ("n_prompt", "n_gen", "avg_ts", "stddev_ts", "samples_ts", "gpu_info", "model_size", "build_commit")
    return [{k: r.get(k) for k in keep} for r in json.loads(out)]


def batched_bench(work: Path, fmt: str) -> list[JSON]:
    """llama-batched-bench 128 / 128 at 1, 32, 128 sequences: its table as dicts (tok/s, seconds)."""
    out = subprocess.run([str(bin_dir(work) / "llama-batched-bench"), "-m", str(gguf(work, fmt)), "-c", "40960",
                          "-b", "2048", "-ub", "512", "-npp", "128", "-ntg", "128", "-npl", "1,32,128", "-ngl", "99",
                          "-fa", "on"], capture_output=True, text=True, timeout=300, check=True).stdout
    return parse_batched(out)


def parse_batched(text: str) -> list[JSON]:
    """The rows of llama-batched-bench's markdown table (``| PP | TG | B | N_KV | T_PP s | S_PP t/s |
    T_TG s | S_TG t/s | T s | S t/s |``) as dicts keyed by its column names."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.lstrip().startswith("|")]
    if not rows:
        return []
    head = rows[0]
    return [dict(zip(head, (float(c) for c in r))) for r in rows[1:] if len(r) == len(head)
            and all(re.fullmatch(r"[\d.]+", c) for c in r)]


def tools(work: Path, out: Path) -> None:
    wait_build(work, 900)
    if not gguf(work, "q4_0").is_file():
        subprocess.run([str(bin_dir(work) / "llama-quantize"), str(gguf(work, "bf16")), str(gguf(work, "q4_0")),
                        "Q4_0"], check=True, capture_output=True)
    doc: JSON = {"llama_cpp": "ggml-org/llama.cpp@0c1e57098 (llama-cpp-python 0.3.36 sdist), CUDA sm_90",
                 "model_bytes": {f: gguf(work, f).stat().st_size for f in FORMATS}}
    for fmt in FORMATS:
        doc.setdefault("llama_bench", {})[fmt] = llama_bench(work, fmt)
        save(out, doc)
    for fmt in ("bf16", "q4_0"):
        doc.setdefault("batched_bench", {})[fmt] = batched_bench(work, fmt)
        save(out, doc)
    print(json.dumps(doc, indent=1)[:3000])


# --- server ------------------------------------------------------------------------------------

@dataclass
class Stream:
    """One streamed completion: seconds from send to each text chunk and to the end."""

    chunks: list[float] = field(default_factory=list)
    end: float = 0.0
    tokens: int = 0
    prompt_tokens: int = 0


def prompts(hf: Path, n: int, length: int) -> list[str]:
    """``n`` texts of ``length`` one-token words (bench/gpu_throughput.py's ``word_prompts`` with
    the tokenizer of ``hf``), checked to encode to exactly ``length`` ids."""
    import tokenizers

    from bench.gpu_throughput import word_prompts

    tok = tokenizers.Tokenizer.from_file(str(hf / "tokenizer.json"))
    texts = [tok.decode(ids) for ids in word_prompts(tok, n, length, seed=0)]
    assert all(len(tok.encode(t, add_special_tokens=False).ids) == length for t in texts)
    return texts


async def stream_one(client: httpx.AsyncClient, model: str, text: str, new: int) -> Stream:
    body = {"model": model, "prompt": text, "max_tokens": new, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    s, t0 = Stream(), time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if usage := chunk.get("usage"):
                s.tokens, s.prompt_tokens = usage["completion_tokens"], usage.get("prompt_tokens", 0)
            if any(c.get("text") for c in chunk.get("choices") or ()):
                s.chunks.append(time.perf_counter() - t0)
    s.end = time.perf_counter() - t0
    s.tokens = s.tokens or len(s.chunks)
    return s


async def load_round(url: str, model: str, texts: list[str], new: int) -> JSON:
    """Every text as one streaming client at once; the round's figures."""
    import httpx

    limits = httpx.Limits(max_connections=len(texts) + 8, max_keepalive_connections=len(texts) + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(stream_one(client, model, t, new) for t in texts))
        wall = time.perf_counter() - t0
    ttft = np.array([s.chunks[0] for s in streams if s.chunks]) * 1e3
    itl = np.concatenate([np.diff(s.chunks) for s in streams if len(s.chunks) > 1] or [np.zeros(1)]) * 1e3
    tokens = sum(s.tokens for s in streams)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "prompt_tokens": streams[0].prompt_tokens,
            "ttft_ms_p50": float(np.percentile(ttft, 50)), "ttft_ms_p99": float(np.percentile(ttft, 99)),
            "itl_ms_p50": float(np.percentile(itl, 50)), "itl_ms_p99": float(np.percentile(itl, 99))}


#: llama-server variants: name -> extra arguments. ``backend_sampling``: its experimental
#: ``--backend-sampling`` (sampling on the GPU instead of per slot on the CPU).
LLAMA_VARIANTS = {"llama_server": [], "llama_server_backend_sampling": ["--backend-sampling"]}


def server_commands(work: Path, n: int, ctx: int, new: int, logs: Path,
                    variants: list[str]) -> dict[str, tuple[list[str], int, Path]]:
    """The servers' command lines at ``n`` slots of ``ctx`` positions each, ours and each llama-server
    variant of :data:`LLAMA_VARIANTS` named in ``variants``: name -> (argv, port, log)."""
    from bench.http_load import _free_port as free_port

    out = {}
    for name in variants:
        port = free_port()
        argv = [str(bin_dir(work) / "llama-server"), "-m", str(gguf(work, "bf16")), "--host", "127.0.0.1", "--port",
                str(port), "-ngl", "99", "-fa", "on", "--parallel", str(n), "-c", str(n * ctx), "-b", "2048",
                "-ub", "512", "--cont-batching", "--no-webui", "--alias", "q06", *LLAMA_VARIANTS[name]]
        out[name] = (argv, port, logs / f"{name}_{n}.log")
    port = free_port()
    ours = [sys.executable, "-m", "mlx_serving", "serve", "--model", str(work / "hf"), "--served-model-name", "q06",
            "--port", str(port), "--max-batch", str(n), "--max-len", str(ctx), "--max-queue", str(4 * n + 64),
            "--max-new-tokens", str(new), "--log-level", "warning"]
    return out | {"ours": (ours, port, logs / f"ours_{n}.log")}


def serve_level(work: Path, n: int, rounds: int, prompt_len: int, new: int, logs: Path, variants: list[str]) -> JSON:
    """Every server up at once; a warm-up round each, then ``rounds`` rounds, the order rotated each
    round. ``ours_over``: ours / each llama-server variant, per round, then the median;
    ``ours_over_llama_server``: that ratio against the fastest variant (by median tok/s)."""
    from bench.http_load import subprocess_server  # MLX and httpx: needed from here on only

    texts = prompts(work / "hf", n, prompt_len)
    with ExitStack() as stack:
        urls = {name: stack.enter_context(subprocess_server(argv, port, "/health", log))
                for name, (argv, port, log) in server_commands(work, n, prompt_len + new + 64, new, logs,
                                                               variants).items()}
        warm = {name: asyncio.run(load_round(url, "q06", texts, new)) for name, url in urls.items()}
        runs: dict[str, list[JSON]] = {name: [] for name in urls}
        names = list(urls)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                runs[name].append(asyncio.run(load_round(urls[name], "q06", texts, new)))
    med = {name: median_round(rs) for name, rs in runs.items()}
    over = {v: statistics.median(o["tok_s"] / lc["tok_s"] for o, lc in zip(runs["ours"], runs[v])) for v in variants}
    best = max(variants, key=lambda v: med[v]["tok_s"])
    return {"clients": n, "warm_up": warm, **med, "ours_over": over, "fastest_llama_server": best,
            "ours_over_llama_server": over[best], "runs_tok_s": {name: [r["tok_s"] for r in rs] for name, rs in runs.items()}}


def median_round(rounds: list[JSON]) -> JSON:
    """The round with the median output tok/s (the lower middle one for an even count)."""
    return sorted(rounds, key=lambda r: r["tok_s"])[(len(rounds) - 1) // 2]


def server(work: Path, out: Path, levels: list[int], rounds: int, prompt_len: int, new: int,
           variants: list[str]) -> None:
    wait_build(work, 900)
    doc: JSON = {"prompt_tokens": prompt_len, "new_tokens": new, "rounds": rounds, "weights": "bf16 (same values)",
                 "levels": {}}
    for n in levels:
        row = serve_level(work, n, rounds, prompt_len, new, out.parent, variants)
        doc["levels"][str(n)] = row
        save(out, doc)
        o, lc = row["ours"], row[row["fastest_llama_server"]]
        print(f"{n:>4} clients: ours {o['tok_s']:8.0f} tok/s (TTFT p50 {o['ttft_ms_p50']:.0f} ms, ITL p99 "
              f"{o['itl_ms_p99']:.1f} ms) | {row['fastest_llama_server']} {lc['tok_s']:8.0f} tok/s (TTFT p50 "
              f"{lc['ttft_ms_p50']:.0f} ms, ITL p99 {lc['itl_ms_p99']:.1f} ms) | ratio "
              f"{row['ours_over_llama_server']:.2f}x", flush=True)


def save(path: Path, doc: JSON) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    build = sub.add_parser("build")
    build.add_argument("--src", type=Path, required=True, help="the trimmed llama.cpp source .tgz")
    build.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    for name in ("build", "weights", "tools", "server"):
        p = sub.choices.get(name) or sub.add_parser(name)
        p.add_argument("--work", type=Path, required=True)
        if name in ("tools", "server"):
            p.add_argument("--out", type=Path, required=True)
    sub.choices["weights"].add_argument("--formats", default="bf16,q8_0", help="GGUF conversions (comma-separated)")
    srv = sub.choices["server"]
    srv.add_argument("--levels", default="1,32,128", help="parallel slots = clients, comma-separated")
    srv.add_argument("--rounds", type=int, default=3)
    srv.add_argument("--prompt-len", type=int, default=128)
    srv.add_argument("--new", type=int, default=128)
    srv.add_argument("--llama-variants", default=",".join(LLAMA_VARIANTS),
                     help=f"llama-server variants, comma-separated (of {', '.join(LLAMA_VARIANTS)})")
    args = ap.parse_args()
    if args.cmd == "build":
        start_build(args.src, args.work, args.jobs)
    elif args.cmd == "weights":
        write_weights(args.work, args.formats.split(","))
    elif args.cmd == "tools":
        tools(args.work, args.out)
    else:
        server(args.work, args.out, [int(x) for x in args.levels.split(",")], args.rounds, args.prompt_len, args.new,
               args.llama_variants.split(","))


if __name__ == "__main__":
    main()
