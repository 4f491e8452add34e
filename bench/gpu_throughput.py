"""GPU throughput: ours (through the Serving) vs mlx-lm, same process, same seeded checkpoint.

Qwen3-0.6B-shaped seeded random MLX 4-bit checkpoint; 128-token prompts, 128 new tokens,
greedy, EOS ignored (both sides generate exactly ``--new`` tokens). Prints one table and writes
JSON (default bench/results/gpu_throughput.json). Measures:

Ours runs with its projections dequantized at load (``--weights dequantized``, the default;
``load(..., dequantize=True)``) and, for one stream and 1 / 128 concurrent, also with the
4-bit projections as stored (the library's default, ``load(..., dequantize=False)``: recorded as
``library_default_weights``).

- one stream: mlx-lm ``generate_step`` vs our Serving (``Serving.stream`` in process mode) and our
  bare ``Engine`` (dequantized and 4-bit): time to first token (ms) and decode tok/s; each side
  runs once to warm up, then ``--repeats`` (3) rounds alternate the sides (mlx-lm, Engine, Engine
  4-bit, Serving) and each side reports its median run (issue 17: "the median of 3 alternating
  runs of each side"; mlx-lm's speed varies up to 1.4x within one lease), every run's tok/s
  under ``runs``;
- concurrency curve: N concurrent requests through ``batched_run_async`` vs our bare ``Engine``
  (the serving's engine configuration: ``max_batch`` = the largest level, ``prefill_chunk`` 512,
  N prompts added at once, stepped to the end) vs mlx-lm ``batch_generate`` on N prompts (default
  and ``completion_batch_size=N``): aggregate tok/s = generated tokens / wall seconds (prefill
  included);
- arrival under load (skipped with ``--load-streams 0``): TTFT of one request arriving while 64
  streams decode, against its idle prefill time + 3 decode steps at batch 64.

``--parts`` picks the parts (``single``, ``curve``: ours and the bare engine, ``peer``: mlx-lm's
``batch_generate`` at ``--peer-concurrency``; default all three). ``--kv-cache-dtype`` (auto, int8,
int4, ...) and ``--decode-path`` set what every one of our sides runs (the Serving, the bare engine,
the 4-bit rows, the arrival part); the JSON records the KV dtype, the path asked for
(``decode_path_asked``) and the one it resolves to (``decode_path``). Issue 42:
``bench/gpu_kv_quant.py`` runs this per KV dtype, alternating.

The JSON is written after each part (a later failure keeps the earlier ones).

Run (MLX CUDA build): ``python bench/gpu_throughput.py``; on CPU use ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import anyio
import mlx.core as mx
import numpy as np
import tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_serving.models import text_generation  # noqa: E402
from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams  # noqa: E402
from mlx_serving.models.loader import load  # noqa: E402
from mlx_serving.models.decoder.decode_backends import DECODE_PATHS, decode_backend  # noqa: E402
from mlx_serving.models.decoder.kv_cache import KV_CACHE_DTYPES  # noqa: E402
from mlx_serving.models.seeded_checkpoint import write_checkpoint  # noqa: E402
from mlx_serving.serving import Serving  # noqa: E402
from mlx_serving.tokenization import Tokenizer  # noqa: E402


def word_prompts(tok: tokenizers.Tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of exactly ``length`` tokens: random common words that are one token each,
    so the text round-trips to the same ids through our tokenizer and mlx-lm's."""
    vocab = tok.get_vocab()
    words = sorted(w for w in vocab if w.startswith("Ġ") and w[1:].isalpha() and w[1:].islower() and len(w) > 3)
    rng = np.random.default_rng(seed)
    return [[vocab[w] for w in rng.choice(words, size=length)] for _ in range(n)]


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median decode tok/s (the lower middle one for an even count), with every
    run's tok/s under ``runs`` (in the order run)."""
    mid = sorted(runs, key=lambda r: r["decode_tok_s"])[(len(runs) - 1) // 2]
    return {**mid, "runs": [r["decode_tok_s"] for r in runs]}


def alternate(sides: dict[str, Callable[[int], dict[str, Any]]], repeats: int) -> dict[str, Any]:
    """Each side once on input 0 (warm-up: MLX builds kernels per shape on first use), then
    ``repeats`` rounds running every side in turn on input 1; each side's median run."""
    for measure in sides.values():
        measure(0)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, measure in sides.items():
            runs[name].append(measure(1))
    return {name: median_run(r) for name, r in runs.items()}


def mlxlm_single(model: Any, prompt: list[int], new: int) -> dict[str, float]:
    from mlx_lm.generate import generate_step
    t0 = time.perf_counter()
    first = last = t0
    count = 0
    for count, (tok_id, _) in enumerate(generate_step(mx.array(prompt), model, max_tokens=new), start=1):
        last = time.perf_counter()
        if count == 1:
            first = last
    return {"ttft_ms": (first - t0) * 1e3, "decode_tok_s": (count - 1) / (last - first), "tokens": count}


def mlxlm_batch(model: Any, tokenizer: Any, prompts: list[list[int]], new: int, **kw: Any) -> dict[str, float]:
    from mlx_lm import batch_generate
    t0 = time.perf_counter()
    resp = batch_generate(model, tokenizer, prompts, max_tokens=new, return_token_ids=True, **kw)
    wall = time.perf_counter() - t0
    produced = sum(len(t) for t in resp.token_ids)
    return {"wall_s": wall, "tokens": produced, "tok_s": produced / wall,
            "decode_tok_s": resp.stats.generation_tps}


def engine_single(state: Any, prompt: list[int], new: int, kv: dict[str, Any]) -> dict[str, float]:
    """One stream on a fresh bare engine (``kv``: its ``kv_cache_dtype`` and ``decode_path``)."""
    eng = Engine(state, EngineConfig.of(max_batch=1, max_len=len(prompt) + new + 8, **kv))
    eng.add(0, prompt, SamplingParams(max_new_tokens=new, eos_token_ids=()))
    t0 = time.perf_counter()
    times: list[float] = []
    while eng.num_active:
        if eng.step():
            times.append(time.perf_counter())
    eng.close()
    return {"ttft_ms": (times[0] - t0) * 1e3, "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
            "tokens": len(times)}


def engine_concurrent(eng: Engine, prompts: list[list[int]], new: int) -> dict[str, float]:
    """All ``prompts`` added to the bare engine at once, stepped until every one is done."""
    params = SamplingParams(max_new_tokens=new, eos_token_ids=())
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add(i, p, params)
    produced = 0
    while eng.num_active:
        produced += len(eng.step())
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": produced, "tok_s": produced / wall}


def serving_single(handle: Any, text: str) -> dict[str, float]:
    t0 = time.perf_counter()
    stamps: list[float] = []
    final: dict[str, Any] = {}
    for item in Serving.stream(handle, text):
        if isinstance(item, dict):
            final = item
        else:
            stamps.append(time.perf_counter())
    n = final["num_tokens"]
    wait_idle(handle)
    return {"ttft_ms": (stamps[0] - t0) * 1e3, "decode_tok_s": (n - 1) / (stamps[-1] - stamps[0]), "tokens": n}


def wait_idle(handle: Any, quiet_s: float = 0.02) -> None:
    """Return once the serving's engine thread has stopped stepping (no running row, ``steps_run``
    unchanged for ``quiet_s``): the one-stream sides alternate on two threads, and the engine lands
    its last pipelined step after the stream's final token; MLX evaluation from two threads at once
    is not safe (ml-explore/mlx#2067)."""
    last = -1
    while True:
        st = handle.stats()
        if st.running == 0 and st.steps_run == last:
            return
        last = st.steps_run
        time.sleep(quiet_s)


async def serving_concurrent(handle: Any, texts: list[str]) -> dict[str, float]:
    counts: list[int] = []

    async def one(text: str) -> None:
        r = await Serving.batched_run_async(handle, text)
        counts.append(r["results"][0]["num_tokens"])

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for t in texts:
            tg.start_soon(one, t)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": sum(counts), "tok_s": sum(counts) / wall}


async def arrival_under_load(handle: Any, background: list[str], probe: str) -> dict[str, float]:
    """TTFT of ``probe`` sent once all ``background`` streams are decoding; inter-token gap of
    the background streams (their decode step time) measured just before."""
    started = anyio.Event()
    first_seen = 0
    gaps: list[float] = []
    result: dict[str, float] = {}

    async def bg(text: str) -> None:
        nonlocal first_seen
        last = None
        async for item in await Serving.stream_async(handle, text):
            now = time.perf_counter()
            if isinstance(item, str):
                if last is None:
                    first_seen += 1
                    if first_seen == len(background):
                        started.set()
                elif started.is_set() and "ttft_ms" not in result:
                    gaps.append(now - last)
                last = now

    async def probe_task() -> None:
        await started.wait()
        await anyio.sleep(0.2)
        t0 = time.perf_counter()
        async for item in await Serving.stream_async(handle, probe):
            if isinstance(item, str):
                result["ttft_ms"] = (time.perf_counter() - t0) * 1e3
                break

    async with anyio.create_task_group() as tg:
        for t in background:
            tg.start_soon(bg, t)
        tg.start_soon(probe_task)
    result["step_ms_at_load"] = statistics.median(gaps) * 1e3 if gaps else float("nan")
    return result


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, default=None, help="default /tmp/qwen3-<preset>-bench (written if missing)")
    ap.add_argument("--preset", default="0.6b")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--concurrency", default="1,8,32,64,128,256")
    ap.add_argument("--peer-concurrency", default="1,8,32,128,256")
    ap.add_argument("--repeats", type=int, default=3, help="alternating one-stream rounds (median kept)")
    ap.add_argument("--load-streams", type=int, default=64, help="arrival-under-load streams (0: skip that part)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu_throughput.json"))
    ap.add_argument("--weights", choices=("dequantized", "4bit"), default="dequantized",
                    help="our projections: dequantized to dense at load (default) or 4-bit as stored; "
                         "one stream and 1 / 128 concurrent are also measured with 4-bit weights")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                    help="what our KV blocks hold (every side of ours)")
    ap.add_argument("--decode-path", default=None, choices=DECODE_PATHS, help="our decode path (default: the library's)")
    ap.add_argument("--quick", action="store_true", help="tiny preset, few tokens: a smoke run for CPU")
    args = ap.parse_args()
    unknown = sorted(set(args.parts.split(",")) - set(PARTS))
    if unknown:
        ap.error(f"--parts: unknown {unknown} (known: {', '.join(PARTS)})")
    if args.quick:
        args.preset, args.new, args.prompt_len = "tiny", 8, 16
        args.concurrency, args.peer_concurrency, args.load_streams = "1,4", "1,4", min(args.load_streams, 4)
    args.ckpt = args.ckpt or default_ckpt(args.preset)
    return args


#: The parts ``--parts`` may name (see the module docstring).
PARTS = ("single", "curve", "peer")


def default_ckpt(preset: str) -> Path:
    """Where the GPU benches write (and share) the seeded ``preset`` checkpoint when ``--ckpt`` is not given."""
    return Path(f"/tmp/qwen3-{preset}-bench")


def save(path: Path, out: dict[str, Any]) -> None:
    """Write ``out`` as JSON to ``path`` (the GPU benches save after every part, so a later failure
    keeps the earlier ones)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))


def main() -> None:
    args = parse_args()
    if not (args.ckpt / "config.json").is_file():
        write_checkpoint(args.ckpt, args.preset, seed=0)
    parts = set(args.parts.split(","))
    raw = tokenizers.Tokenizer.from_file(str(args.ckpt / "tokenizer.json"))
    tok = Tokenizer(raw, eos_token_ids=())  # EOS ignored: every request generates exactly --new tokens
    state4 = load(args.ckpt)  # 4-bit projections, as stored
    state = load(args.ckpt, dequantize=True) if args.weights == "dequantized" else state4
    peer = load_peer(args.ckpt) if parts & {"single", "peer"} else None
    levels = [int(x) for x in args.concurrency.split(",")]
    peer_levels = [int(x) for x in args.peer_concurrency.split(",")]
    n_max = 2 * max(levels + peer_levels + [args.load_streams + 1])
    prompts = word_prompts(raw, n_max, args.prompt_len, seed=0)
    texts = [raw.decode(p) for p in prompts]
    assert all(tok.encode(t) == p for t, p in zip(texts[:8], prompts[:8])), "prompts must round-trip"
    default_dequantize = inspect.signature(load).parameters["dequantize"].default
    kv = {"kv_cache_dtype": args.kv_cache_dtype, "decode_path": args.decode_path}
    out: dict[str, Any] = {"device": str(mx.default_device()), "mlx": mx.__version__, "preset": args.preset,
                           "ours_weights": args.weights, "kv_cache_dtype": args.kv_cache_dtype,
                           "decode_path": decode_backend(state, args.decode_path, args.kv_cache_dtype).name,
                           "decode_path_asked": args.decode_path,
                           "library_default_weights": "dequantized" if default_dequantize else "4bit",
                           "prompt_len": args.prompt_len, "new_tokens": args.new, "host": platform.node(),
                           "command": " ".join(["python", "bench/gpu_throughput.py", *sys.argv[1:]])}
    max_len = args.prompt_len + args.new + 8
    gen = text_generation.serving(tok, state, max_new_tokens=args.new, max_len=max_len,
                                  max_batch=max(levels), prefill_chunk=512, **kv)
    if "single" in parts and peer is not None:
        out["single"] = single_part(gen, peer[0], state, state4, prompts, texts, args, kv)
        save(args.out, out)
    out["curve"] = curve = {}
    if "curve" in parts:
        curve_part(curve, gen, tok, state, state4, prompts, texts, args, kv)
        save(args.out, out)
    if "peer" in parts and peer is not None:
        peer_part(out, *peer, prompts, peer_levels, args)
    if args.load_streams:
        out["arrival_under_load"] = arrival_part(tok, state, texts, args, kv)
    save(args.out, out)
    print_table(out)


def load_peer(ckpt: Path) -> tuple[Any, Any]:
    """mlx-lm's model (as stored) and tokenizer, EOS ignored."""
    from mlx_lm import load as mlxlm_load

    model, mlxlm_tok = mlxlm_load(str(ckpt))
    mlxlm_tok.eos_token_ids = set()
    return model, mlxlm_tok


def single_part(gen: Any, model: Any, state: Any, state4: Any, prompts: list[list[int]], texts: list[str],
                args: argparse.Namespace, kv: dict[str, Any]) -> dict[str, Any]:
    """One stream: mlx-lm, our bare engine (dequantized and 4-bit) and our Serving, alternating."""
    with Serving.start(gen, batch_size=1, batch_timeout=0.0) as h:
        single = alternate({
            "mlx_lm_generate_step": lambda i: mlxlm_single(model, prompts[i], args.new),
            "ours_engine": lambda i: engine_single(state, prompts[i], args.new, kv),
            "ours_engine_4bit": lambda i: engine_single(state4, prompts[i], args.new, kv),
            "ours_serving": lambda i: serving_single(h, texts[i])}, args.repeats)
    mx.clear_cache()  # the closed serving's engine released its buffers on its thread; no thread evaluates now
    return single


def curve_part(curve: dict[str, Any], gen: Any, tok: Tokenizer, state: Any, state4: Any, prompts: list[list[int]],
               texts: list[str], args: argparse.Namespace, kv: dict[str, Any]) -> None:
    """Into ``curve`` per level: our Serving, our bare engine, and our 4-bit Serving at 1 and 128."""
    levels = [int(x) for x in args.concurrency.split(",")]
    max_len = args.prompt_len + args.new + 8
    for n in levels:
        with Serving.start(gen, batch_size=n, batch_timeout=0.002) as h:
            anyio.run(serving_concurrent, h, texts[n:2 * n])  # warm-up at this concurrency
            curve[str(n)] = {"ours": anyio.run(serving_concurrent, h, texts[:n])}
        mx.clear_cache()
    for n in levels:  # the serving's engine without the serving: fresh per level, as each Serving.start
        eng = Engine(state, EngineConfig.of(max_batch=max(levels), max_len=max_len, prefill_chunk=512, **kv))
        eng.warm_up()
        engine_concurrent(eng, prompts[n:2 * n], args.new)
        curve[str(n)]["ours_engine"] = engine_concurrent(eng, prompts[:n], args.new)
        eng.close()
        mx.clear_cache()
    gen4 = text_generation.serving(tok, state4, max_new_tokens=args.new, max_len=max_len, max_batch=max(levels), **kv)
    with Serving.start(gen4, batch_size=max(levels), batch_timeout=0.002) as h:
        for n in (1, 128):
            if n <= max(levels):
                anyio.run(serving_concurrent, h, texts[n:2 * n])
                curve.setdefault(str(n), {})["ours_4bit"] = anyio.run(serving_concurrent, h, texts[:n])
    mx.clear_cache()


def peer_part(out: dict[str, Any], model: Any, mlxlm_tok: Any, prompts: list[list[int]], peer_levels: list[int],
              args: argparse.Namespace) -> None:
    """Into ``out["curve"]`` per level: mlx-lm's ``batch_generate`` (default, and above 32 with batch
    sizes N); ``out`` saved after each level."""
    for n in peer_levels:
        row = out["curve"].setdefault(str(n), {})
        mlxlm_batch(model, mlxlm_tok, prompts[n:2 * n], args.new)  # warm-up at this concurrency
        row["mlx_lm_batch_generate"] = mlxlm_batch(model, mlxlm_tok, prompts[:n], args.new)
        if n > 32:  # mlx-lm's default completion_batch_size is 32: also give it N
            tuned = {"completion_batch_size": n, "prefill_batch_size": n}
            mlxlm_batch(model, mlxlm_tok, prompts[n:2 * n], args.new, **tuned)
            row["mlx_lm_batch_generate_cbs_n"] = mlxlm_batch(model, mlxlm_tok, prompts[:n], args.new, **tuned)
        save(args.out, out)


def arrival_part(tok: Tokenizer, state: Any, texts: list[str], args: argparse.Namespace,
                 kv: dict[str, Any]) -> dict[str, Any]:
    """TTFT of one request arriving while ``--load-streams`` streams decode, against its bound."""
    load_gen = text_generation.serving(tok, state, max_new_tokens=4 * args.new,
                                       max_len=args.prompt_len + 4 * args.new + 8, max_batch=args.load_streams + 1,
                                       **kv)
    with Serving.start(load_gen, batch_size=args.load_streams + 1, batch_timeout=0.002) as h:
        idle = serving_single(h, texts[-1])
        under = anyio.run(arrival_under_load, h, texts[:args.load_streams], texts[-1])
    bound = idle["ttft_ms"] + 3 * under["step_ms_at_load"]
    return {"streams": args.load_streams, "idle_ttft_ms": idle["ttft_ms"], **under,
            "bound_ms": bound, "within_bound": under["ttft_ms"] <= bound}


def print_table(out: dict[str, Any]) -> None:
    """The parts run, as tables on stdout."""
    print(f"device {out['device']}  mlx {out['mlx']}  preset {out['preset']}  prompt {out['prompt_len']}  "
          f"new {out['new_tokens']}  KV {out['kv_cache_dtype']}  decode path {out['decode_path']}")
    if "single" in out:
        print_single(out["single"])
    print_curve(out["curve"])
    if "arrival_under_load" not in out:
        return
    a = out["arrival_under_load"]
    print(f"\narrival while {a['streams']} streams decode: TTFT {a['ttft_ms']:.1f} ms; bound = idle TTFT "
          f"{a['idle_ttft_ms']:.1f} + 3 x step {a['step_ms_at_load']:.2f} = {a['bound_ms']:.1f} ms -> "
          f"{'within' if a['within_bound'] else 'OVER'}")


def print_single(s: dict[str, Any]) -> None:
    """The one-stream table."""
    peer = s["mlx_lm_generate_step"]
    print(f"{'one stream':<28}{'TTFT ms':>10}{'decode tok/s':>14}{'vs mlx-lm':>11}")
    for name, r in (("mlx-lm generate_step", peer), ("ours: Engine", s["ours_engine"]),
                    ("ours: Engine, 4-bit weights", s["ours_engine_4bit"]), ("ours: Serving.stream", s["ours_serving"])):
        print(f"{name:<28}{r['ttft_ms']:>10.1f}{r['decode_tok_s']:>14.1f}{r['decode_tok_s'] / peer['decode_tok_s']:>10.2f}x")


def print_curve(curve: dict[str, Any]) -> None:
    """The concurrency table (nan where a side did not run)."""
    print(f"\n{'concurrent':>10}{'ours tok/s':>12}{'engine':>10}{'mlx-lm bg':>12}{'ratio':>8}{'mlx-lm cbs=N':>14}{'ratio':>8}")
    for n, row in sorted(curve.items(), key=lambda kv: int(kv[0])):
        ours = row.get("ours", {}).get("tok_s", float("nan"))
        bg = row.get("mlx_lm_batch_generate", {}).get("tok_s", float("nan"))
        cbs = row.get("mlx_lm_batch_generate_cbs_n", {}).get("tok_s", float("nan"))
        eng = row.get("ours_engine", {}).get("tok_s", float("nan"))
        print(f"{n:>10}{ours:>12.0f}{eng:>10.0f}{bg:>12.0f}{ours / bg:>7.2f}x{cbs:>14.0f}{ours / cbs:>7.2f}x")
        if "ours_4bit" in row:
            q = row["ours_4bit"]["tok_s"]
            print(f"{'(4-bit)':>10}{q:>12.0f}{'':>10}{'':>12}{q / bg:>7.2f}x")


if __name__ == "__main__":
    main()
