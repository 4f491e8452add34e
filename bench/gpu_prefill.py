"""Prefill of ragged prompts (issue 17, item 4): packed, padded and boolean-mask sides, on the bare Engine.

Workload: ``--requests`` prompts of seeded uniform lengths in ``--prompt-range`` (random token ids,
``numpy.random.default_rng(--seed)``), all added at once, one new token each (greedy, no EOS), so a
run is the prefill of every prompt plus one decode-free sample. Engine: ``max_batch`` =
``--requests``, ``prefill_chunk`` ``--prefill-chunk``, paged KV cache, prefix caching off (every
run prefills every token). Timed: wall from the first ``add`` to the last event (the device synced
by the events), for four sides (:data:`SIDES`), alternating, ``--rounds`` times each after one
untimed run per side (MLX's per-shape kernel builds, recorded as ``first_run_s``): "default"
(the engine's defaults: rows of one start attend as causal groups, ``engine._MAX_CAUSAL_GROUPS``;
packed where shapes are not bucketed, ``engine.PACK_PREFILL``), "packed" (projections and MLP on
the real tokens only), "padded" (on the padded ``(rows, tokens)`` grid) and "bool_mask" (one
attention call with a boolean mask);
prefill tok/s = real prompt tokens / wall.
Also reports the padded token count of the grid (what the unpacked linear layers process).

Second study (``--attention``): one prefill-shaped attention call ``(B, 16, T, 128)`` queries over
``(B, 8, S, 128)`` keys through ``mx.fast.scaled_dot_product_attention`` with the engine's boolean
mask (the last T of S positions, causal) vs the ``"causal"`` string mask, median of 10 synced
calls, and the first call of each shape (per-shape builds included): how much of prefill the
masked attention costs on this device, and what a prefill shape not seen before costs.

Run (MLX CUDA build): ``python bench/gpu_prefill.py`` (JSON to bench/results/gpu_prefill.json, or
``--out``); on CPU ``--quick`` (tiny preset, 16 prompts of 16-128 tokens; JSON to /tmp) is a smoke run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_serving.models.generation.engine as engine_module  # noqa: E402
from gpu_throughput import default_ckpt  # noqa: E402
from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams  # noqa: E402
from mlx_serving.models.decoder.layers import State  # noqa: E402
from mlx_serving.models.loader import load  # noqa: E402
from mlx_serving.models.seeded_checkpoint import write_checkpoint  # noqa: E402


def prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of uniform lengths in ``[lo, hi]`` with uniform token ids below ``vocab``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(k)).tolist() for k in rng.integers(lo, hi + 1, n)]


def padded_tokens(lengths: list[int], chunk: int, bucket: bool) -> int:
    """Token positions of the padded prefill grids the engine builds for ``lengths`` all added at
    once (every row prefills its next chunk each step; rows and tokens rounded up to powers of two,
    tokens at least 16, when ``bucket``)."""
    left, total = list(lengths), 0
    while any(left):
        chunks = [min(chunk, k) for k in left if k > 0]
        b, t = len(chunks), max(chunks)
        if bucket:  # Engine._prefill_width: power of two, at least 16, at most the chunk
            b, t = engine_module._pow2(b), min(chunk, max(16, engine_module._pow2(t)))
        total += b * t
        left = [k - min(chunk, k) for k in left]
    return total


def run_once(state: State, batch: list[list[int]], chunk: int) -> float:
    """Seconds from the first add to the last event of one prefill-only run."""
    max_len = max(map(len, batch)) + 8
    engine = Engine(state, EngineConfig.of(max_batch=len(batch), max_len=max_len, prefill_chunk=chunk,
                                           prefix_caching=False))  # no decode: no warm_up
    params = SamplingParams(max_new_tokens=1)
    t0 = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add(i, p, params)
    done = 0
    while done < len(batch):
        done += sum(e.finish_reason is not None for e in engine.step())
    return time.perf_counter() - t0


#: The sides compared: engine settings (module constants) of each.
SIDES = {"default": {"PACK_PREFILL": None, "_MAX_CAUSAL_GROUPS": 4},
         "packed": {"PACK_PREFILL": True, "_MAX_CAUSAL_GROUPS": 4},
         "padded": {"PACK_PREFILL": False, "_MAX_CAUSAL_GROUPS": 4},
         "bool_mask": {"PACK_PREFILL": None, "_MAX_CAUSAL_GROUPS": 0}}


def prefill_study(state: State, batch: list[list[int]], chunk: int, rounds: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {name: [] for name in SIDES}
    cold = {}
    defaults = {k: getattr(engine_module, k) for k in SIDES["default"]}
    for r in range(rounds + 1):
        for name, settings in SIDES.items():
            for k, v in settings.items():
                setattr(engine_module, k, v)
            s = run_once(state, batch, chunk)
            if r:
                times[name].append(s)
            else:
                cold[name] = s
    for k, v in defaults.items():
        setattr(engine_module, k, v)
    real = sum(map(len, batch))
    out: dict[str, Any] = {"requests": len(batch), "real_tokens": real,
                           "padded_grid_tokens": padded_tokens([len(p) for p in batch], chunk,
                                                               mx.default_device() == mx.gpu),
                           "first_run_s": cold}
    for name, ts in times.items():
        med = statistics.median(ts)
        out[name] = {"wall_s": ts, "median_s": med, "prefill_tok_s": real / med}
    out["speedup_vs"] = {name: out[name]["median_s"] / out["default"]["median_s"] for name in SIDES}
    return out


def attention_study(b: int, t: int, s: int) -> dict[str, Any]:
    """Masked vs causal-string prefill attention, ms (median of 10 synced calls)."""
    q = mx.random.normal((b, 16, t, 128)).astype(mx.bfloat16)
    k = mx.random.normal((b, 8, s, 128)).astype(mx.bfloat16)
    v = mx.random.normal((b, 8, s, 128)).astype(mx.bfloat16)
    j, pos = mx.arange(s), (s - t) + mx.arange(t)
    mask = mx.broadcast_to((j[None, :] <= pos[:, None])[None, None], (b, 1, t, s))
    out: dict[str, Any] = {}
    results = []
    for name, m in (("bool_mask", mask), ("causal", "causal")):
        ts = []
        for _ in range(11):
            t0 = time.perf_counter()
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=128 ** -0.5, mask=m)
            mx.eval(o)
            ts.append((time.perf_counter() - t0) * 1e3)
        results.append(o)
        out[f"{name}_ms"] = statistics.median(ts[1:])
        out[f"{name}_first_ms"] = ts[0]  # a new shape: MLX's (and cuDNN's) per-shape build included
    # "causal" must be bottom-right aligned (query i sees keys <= S - T + i), as the mask is
    out["max_abs_diff"] = float(mx.abs(results[0].astype(mx.float32) - results[1].astype(mx.float32)).max())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="0.6b")
    ap.add_argument("--ckpt", type=Path, default=None, help="default /tmp/qwen3-<preset>-bench")
    ap.add_argument("--weights", choices=("dequantized", "4bit"), default="dequantized")
    ap.add_argument("--requests", default="256,32", help="comma-separated batch sizes")
    ap.add_argument("--prompt-range", default="16,1024")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention", default="1:512:1024,1:1024:1024,1:2048:2048,64:512:1024,256:512:1024")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/gpu_prefill.json (--quick: /tmp)")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.requests, args.prompt_range, args.rounds = "tiny", "16", "16,128", 1
        args.attention = "1:64:128"
    args.out = args.out or Path("/tmp/gpu_prefill_quick.json" if args.quick else "bench/results/gpu_prefill.json")
    ckpt = args.ckpt or default_ckpt(args.preset)
    if not (ckpt / "config.json").is_file():
        write_checkpoint(ckpt, args.preset, seed=0)
    state = load(ckpt, dequantize=args.weights == "dequantized")
    lo, hi = map(int, args.prompt_range.split(","))
    out: dict[str, Any] = {"device": str(mx.default_device()), "mlx": mx.__version__, "preset": args.preset,
                           "weights": args.weights, "prefill_chunk": args.prefill_chunk, "prefill": {}}
    for n in map(int, args.requests.split(",")):
        batch = prompts(n, lo, hi, state.config.vocab_size, args.seed)
        r = out["prefill"][str(n)] = prefill_study(state, batch, args.prefill_chunk, args.rounds)
        print(f"{n:4d} prompts, {r['real_tokens']} tokens (grid {r['padded_grid_tokens']}): "
              + ", ".join(f"{k} {r[k]['median_s']:.3f} s ({r[k]['prefill_tok_s']:.0f} tok/s, first run "
                          f"{r['first_run_s'][k]:.1f} s)" for k in SIDES), flush=True)
    out["attention"] = {}
    for spec in args.attention.split(","):
        b, t, s = map(int, spec.split(":"))
        a = out["attention"][spec] = attention_study(b, t, s)
        print(f"attention B={b} T={t} S={s}: bool mask {a['bool_mask_ms']:.2f} ms, causal {a['causal_ms']:.2f} ms, "
              f"max |difference| {a['max_abs_diff']:.2e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
