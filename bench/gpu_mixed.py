"""Mixed workload (issue 17): ragged prompts and outputs submitted at once, ours vs mlx-lm, same process.

Workload: ``--requests`` (256) requests, all submitted at t = 0; prompt lengths drawn uniformly from
``--prompt-range`` (16-1,024 tokens) and output lengths from ``--new-range`` (16-512 tokens) with a
seeded ``numpy.random.default_rng(--seed)``; greedy, EOS ignored, so every request generates exactly
its own output length (on both sides). Prompts are random one-token words (``gpu_throughput.word_prompts``)
that round-trip to the same ids through our tokenizer and mlx-lm's. Checkpoint: the seeded
Qwen3-0.6B-shaped 4-bit checkpoint (``write_checkpoint(path, preset, seed=0)``); ours loads it with
its projections dequantized (``--weights dequantized``, as bench/gpu_throughput.py), mlx-lm as stored.

Measured (``wall`` = first submission -> last token, seconds, prefill included):

- ours at each ``--batches`` value (``max_batch`` of the text-generation serving: 256, 128),
  requests ``{"text", "max_new_tokens"}`` through ``Serving.stream_async`` on one event loop:
  aggregate tok/s = generated tokens / wall; TTFT (ms) of each request = time from its submission
  (just before ``stream_async`` is awaited) to the first item its stream yields (measured on the
  client, not derived from server timings), p50 / p99 / max; also ``ttft_from_start_ms``, from the
  moment the first request was submitted (the clients' own submission spread included);
- mlx-lm ``batch_generate`` with its defaults (``completion_batch_size`` 32, ``prefill_batch_size``
  8) and per-request ``max_tokens`` (a list: the same output lengths): aggregate tok/s only (it
  does not stream);
- mlx-lm ``BatchGenerator`` driven directly at each batch (``completion_batch_size`` = batch,
  ``prefill_batch_size`` = ``--peer-prefill-batch`` or the batch), per-request ``max_tokens``:
  aggregate tok/s and TTFT = ``insert`` -> the first generated token of that request.

Generated tokens are counted on each side (ours: ``num_tokens`` of each final stream item; mlx-lm:
its returned ids / responses) and must equal the requested total: the ratios compare the same work.
Each side first runs a smaller warm-up workload (``--warmup`` requests, another seed, outputs capped
at 32 tokens) so kernel builds are not timed. Prints a table; writes JSON (``--out``, default
bench/results/gpu_mixed.json; each request's prompt and output length under ``prompt_lens`` /
``new_lens``, from which bench/gpu_summary.py builds the bandwidth floor) with the targets of issue 17 (>= 15x ``batch_generate`` at batch 256,
TTFT p99 <= 3 s at batch 128) marked met or not.

Run (MLX CUDA build): ``python bench/gpu_mixed.py``; on CPU ``--quick`` (tiny preset, 8 requests,
16-64 prompt and 2-8 new tokens, batches 8 and 4) is a smoke run of about a minute on 2
shared CPU cores (mlx-lm's CPU decode step dominates it).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_summary import MIXED_RATIO, MIXED_TTFT_P99_S  # noqa: E402
from gpu_throughput import default_ckpt, load_peer, save, word_prompts  # noqa: E402
from mlx_serving.models import text_generation  # noqa: E402
from mlx_serving.models.decoder.layers import State  # noqa: E402
from mlx_serving.models.loader import load  # noqa: E402
from mlx_serving.models.families.qwen3 import PRESETS  # noqa: E402
from mlx_serving.models.seeded_checkpoint import write_checkpoint  # noqa: E402
from mlx_serving.serving import Serving  # noqa: E402
from mlx_serving.tokenization import Tokenizer  # noqa: E402

__all__ = ["Workload", "add_checkpoint_args", "load_ours", "make_workload", "summary"]



@dataclass(frozen=True)
class Workload:
    """Token ids of each prompt, their texts (round-trip to the same ids) and output lengths."""

    prompts: list[list[int]]
    texts: list[str]
    new: list[int]

    @property
    def total_new(self) -> int:
        return sum(self.new)


def summary(values_s: list[float]) -> dict[str, float]:
    """p50 / p99 / max / mean of durations given in seconds, returned in milliseconds
    (``numpy.percentile``, linear interpolation); NaN for an empty list."""
    if not values_s:
        return {k: float("nan") for k in ("p50", "p99", "max", "mean")}
    ms = np.asarray(values_s) * 1e3
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
            "max": float(ms.max()), "mean": float(ms.mean())}


def add_checkpoint_args(ap: argparse.ArgumentParser) -> None:
    """Add ``--ckpt``, ``--preset`` and ``--weights``: the checkpoint ``load_ours`` reads. ``--ckpt``
    stays None when not given: resolve it with ``default_ckpt`` after parsing (``--quick`` may change
    the preset first)."""
    ap.add_argument("--ckpt", type=Path, default=None, help="default /tmp/qwen3-<preset>-bench (written if missing)")
    ap.add_argument("--preset", default="0.6b", choices=sorted(PRESETS))
    ap.add_argument("--weights", choices=("dequantized", "4bit"), default="dequantized")


def load_ours(ckpt: Path, preset: str, weights: str) -> tuple[tokenizers.Tokenizer, Tokenizer, State]:
    """Write the seeded checkpoint if missing, check it has ``preset``'s shape (ValueError if not:
    a checkpoint of another preset left at that path), and load our side: the raw tokenizer, ours
    with EOS ignored, and the state (projections dense when ``weights`` is "dequantized")."""
    if not (ckpt / "config.json").is_file():
        write_checkpoint(ckpt, preset, seed=0)
    config = json.loads((ckpt / "config.json").read_text())
    if config["hidden_size"] != PRESETS[preset]["hidden_size"]:
        raise ValueError(f"--ckpt {ckpt} holds a hidden_size {config['hidden_size']} checkpoint, not preset {preset!r}")
    raw = tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    return raw, Tokenizer(raw, eos_token_ids=()), load(ckpt, dequantize=weights == "dequantized")


def make_workload(raw: tokenizers.Tokenizer, tok: Tokenizer, n: int, prompt_range: tuple[int, int],
                  new_range: tuple[int, int], seed: int) -> Workload:
    """``n`` requests: prompt and output lengths uniform in the inclusive ranges (seeded), prompts
    cut from word prompts of the longest length. Raises ValueError if a prompt does not round-trip."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(prompt_range[0], prompt_range[1] + 1, n)
    new = rng.integers(new_range[0], new_range[1] + 1, n).tolist()
    full = word_prompts(raw, n, prompt_range[1], seed=seed)
    prompts = [p[:int(k)] for p, k in zip(full, lengths)]
    texts = [raw.decode(p) for p in prompts]
    if any(tok.encode(t) != p for t, p in zip(texts, prompts)):
        raise ValueError("a prompt does not round-trip through the tokenizer")
    return Workload(prompts, texts, new)


async def ours_streams(handle: Any, work: Workload) -> dict[str, Any]:
    """Submit every request at once through ``stream_async``; TTFT per request from its stream."""
    ttft: list[float] = []
    firsts: list[float] = []
    counts: list[int] = []

    async def one(text: str, new: int) -> None:
        submitted = time.perf_counter()
        first = None
        async with await Serving.stream_async(handle, {"text": text, "max_new_tokens": new}) as stream:
            async for item in stream:
                if first is None:
                    first = time.perf_counter()
                    ttft.append(first - submitted)
                    firsts.append(first - t0)
                if isinstance(item, dict):
                    counts.append(item["num_tokens"])

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for text, new in zip(work.texts, work.new):
            tg.start_soon(one, text, new)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": sum(counts), "tok_s": sum(counts) / wall, "ttft_ms": summary(ttft),
            "ttft_from_start_ms": summary(firsts)}


def run_ours(tok: Tokenizer, state: State, batch: int, work: Workload, warm: Workload,
             prefill_chunk: int) -> dict[str, Any]:
    """Our serving at ``max_batch`` = ``batch``: warm-up workload, then the timed one."""
    max_len = max(map(len, work.prompts + warm.prompts)) + max(work.new + warm.new) + 8
    gen = text_generation.serving(tok, state, max_new_tokens=max(work.new), max_len=max_len,
                                  max_batch=batch, prefill_chunk=prefill_chunk)
    with Serving.start(gen, batch_timeout=0.002) as handle:
        anyio.run(ours_streams, handle, warm)
        result = anyio.run(ours_streams, handle, work)
        result["backend"] = handle.stats().backend
    mx.clear_cache()
    return result


def mlxlm_batch_generate(model: Any, mlxlm_tok: Any, work: Workload) -> dict[str, Any]:
    """mlx-lm ``batch_generate`` (its default batch sizes), per-request ``max_tokens``."""
    from mlx_lm import batch_generate

    t0 = time.perf_counter()
    resp = batch_generate(model, mlxlm_tok, work.prompts, max_tokens=work.new, return_token_ids=True)
    wall = time.perf_counter() - t0
    produced = sum(len(t) for t in resp.token_ids)
    return {"wall_s": wall, "tokens": produced, "tok_s": produced / wall}


def mlxlm_generator(model: Any, work: Workload, batch: int, prefill_batch: int) -> dict[str, Any]:
    """mlx-lm ``BatchGenerator`` (``completion_batch_size`` = ``batch``), per-request ``max_tokens``;
    TTFT = ``insert`` -> that request's first generated token."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, stop_tokens=None, completion_batch_size=batch, prefill_batch_size=prefill_batch)
    t0 = time.perf_counter()
    gen.insert(work.prompts, work.new)
    first: dict[int, float] = {}
    produced = 0
    while responses := gen.next_generated():
        now = time.perf_counter()
        for r in responses:
            first.setdefault(r.uid, now - t0)
        produced += len(responses)
    wall = time.perf_counter() - t0
    gen.close()
    mx.clear_cache()
    return {"wall_s": wall, "tokens": produced, "tok_s": produced / wall, "ttft_ms": summary(list(first.values()))}


def check_tokens(name: str, result: dict[str, Any], work: Workload) -> None:
    """RuntimeError unless ``result`` generated exactly the workload's requested tokens."""
    if result["tokens"] != work.total_new:
        raise RuntimeError(f"{name} generated {result['tokens']} tokens, expected {work.total_new}")


def parse_range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split("-"))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LO-HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_checkpoint_args(ap)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-range", type=parse_range, default=(16, 1024), help="prompt tokens LO-HI (inclusive)")
    ap.add_argument("--new-range", type=parse_range, default=(16, 512), help="new tokens LO-HI (inclusive)")
    ap.add_argument("--batches", default="256,128", help="our max_batch values (comma-separated)")
    ap.add_argument("--peer", default="batch_generate,batch_generator",
                    help="mlx-lm sides to run: batch_generate, batch_generator (comma-separated; empty: none)")
    ap.add_argument("--peer-prefill-batch", type=int, default=0, help="BatchGenerator prefill_batch_size (0: = batch)")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=32, help="warm-up requests per side (outputs capped at 32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu_mixed.json"))
    ap.add_argument("--quick", action="store_true", help="tiny preset, 8 short requests, batches 8 and 4: a CPU smoke run")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.requests, args.prompt_range, args.new_range = "tiny", 8, (16, 64), (2, 8)
        args.batches, args.warmup = "8,4", 2
    args.ckpt = args.ckpt or default_ckpt(args.preset)
    return args


def main() -> None:
    args = parse_args()
    raw, tok, state = load_ours(args.ckpt, args.preset, args.weights)
    work = make_workload(raw, tok, args.requests, args.prompt_range, args.new_range, args.seed)
    warm = make_workload(raw, tok, args.warmup, args.prompt_range, (1, min(32, args.new_range[1])), args.seed + 1)
    batches = [int(b) for b in args.batches.split(",")]
    out: dict[str, Any] = {
        "device": str(mx.default_device()), "mlx": mx.__version__, "host": platform.node(), "preset": args.preset,
        "ours_weights": args.weights, "requests": args.requests, "prompt_range": args.prompt_range,
        "new_range": args.new_range, "seed": args.seed, "prompt_tokens": sum(map(len, work.prompts)),
        "new_tokens": work.total_new, "prompt_lens": list(map(len, work.prompts)), "new_lens": work.new,
        "prefill_chunk": args.prefill_chunk, "ours": {}, "mlx_lm_batch_generator": {}}
    for b in batches:
        out["ours"][str(b)] = run_ours(tok, state, b, work, warm, args.prefill_chunk)
        record(args.out, out, f"ours at max_batch {b}", out["ours"][str(b)], work)
    run_peers(args, out, work, warm, batches)
    out["ratios"] = ratios(out, batches)
    out["targets"] = targets(out)
    save(args.out, out)
    print_table(out, batches)


def run_peers(args: argparse.Namespace, out: dict[str, Any], work: Workload, warm: Workload,
              batches: list[int]) -> None:
    """The mlx-lm sides named in ``--peer``, each after a warm-up on ``warm``, into ``out``."""
    peers = [p for p in args.peer.split(",") if p]
    if not peers:
        return
    model, mlxlm_tok = load_peer(args.ckpt)
    if "batch_generate" in peers:
        mlxlm_batch_generate(model, mlxlm_tok, warm)
        out["mlx_lm_batch_generate"] = mlxlm_batch_generate(model, mlxlm_tok, work)
        record(args.out, out, "mlx-lm batch_generate", out["mlx_lm_batch_generate"], work)
    if "batch_generator" in peers:
        for b in batches:
            pb = args.peer_prefill_batch or b
            mlxlm_generator(model, warm, b, pb)
            r = out["mlx_lm_batch_generator"][str(b)] = {**mlxlm_generator(model, work, b, pb), "prefill_batch_size": pb}
            record(args.out, out, f"mlx-lm BatchGenerator at {b}", r, work)


def record(path: Path, out: dict[str, Any], name: str, result: dict[str, Any], work: Workload) -> None:
    """Check ``result`` generated the requested tokens, print a progress line and write ``out`` as
    JSON (after every side, so a later side's failure keeps the earlier ones)."""
    check_tokens(name, result, work)
    print(f"{name}: {result['tok_s']:.0f} tok/s, wall {result['wall_s']:.2f} s", flush=True)
    save(path, out)


def ratios(out: dict[str, Any], batches: list[int]) -> dict[str, dict[str, float]]:
    """Our aggregate tok/s over mlx-lm's, per batch (``batch_generate``: one run at its defaults)."""
    res: dict[str, dict[str, float]] = {}
    for b in batches:
        ours = out["ours"][str(b)]["tok_s"]
        row = res.setdefault(str(b), {})
        if "mlx_lm_batch_generate" in out:
            row["vs_batch_generate"] = ours / out["mlx_lm_batch_generate"]["tok_s"]
        if str(b) in out["mlx_lm_batch_generator"]:
            row["vs_batch_generator"] = ours / out["mlx_lm_batch_generator"][str(b)]["tok_s"]
    return res


def targets(out: dict[str, Any]) -> dict[str, Any]:
    """Issue 17's mixed-workload targets, where this run measured them."""
    res: dict[str, Any] = {}
    ratio = out["ratios"].get("256", {}).get("vs_batch_generate")
    if ratio is not None:
        res["ratio_256_vs_batch_generate"] = {"value": ratio, "target": MIXED_RATIO, "met": ratio >= MIXED_RATIO}
    if "128" in out["ours"]:
        p99_s = out["ours"]["128"]["ttft_ms"]["p99"] / 1e3
        res["ttft_p99_s_at_128"] = {"value": p99_s, "target": MIXED_TTFT_P99_S, "met": p99_s <= MIXED_TTFT_P99_S}
    return res


def print_table(out: dict[str, Any], batches: list[int]) -> None:
    print(f"device {out['device']}  mlx {out['mlx']}  preset {out['preset']}  {out['requests']} requests  "
          f"prompts {out['prompt_range']}  outputs {out['new_range']}  "
          f"({out['prompt_tokens']:,} prompt / {out['new_tokens']:,} new tokens)")
    print(f"{'side':<34}{'wall s':>9}{'tok/s':>10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'ours / this':>13}")
    rows: list[tuple[str, dict[str, Any], float | None]] = []
    for b in batches:
        rows.append((f"ours, max_batch {b}", out["ours"][str(b)], None))
    if "mlx_lm_batch_generate" in out:
        r = out["mlx_lm_batch_generate"]
        rows.append(("mlx-lm batch_generate (defaults)", r, out["ours"][str(batches[0])]["tok_s"] / r["tok_s"]))
    for b, r in out["mlx_lm_batch_generator"].items():
        rows.append((f"mlx-lm BatchGenerator, batch {b}", r, out["ours"][b]["tok_s"] / r["tok_s"]))
    for name, r, ratio in rows:
        t = r.get("ttft_ms", {"p50": float("nan"), "p99": float("nan")})
        rs = "" if ratio is None else f"{ratio:.2f}x"
        print(f"{name:<34}{r['wall_s']:>9.2f}{r['tok_s']:>10.0f}{t['p50']:>13.0f}{t['p99']:>13.0f}{rs:>13}")
    print("(batch_generate's ratio is ours at the first --batches value over it)")
    for name, t in out["targets"].items():
        print(f"target {name}: {t['value']:.2f} (target {t['target']}) -> {'met' if t['met'] else 'NOT met'}")


if __name__ == "__main__":
    main()
