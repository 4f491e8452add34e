"""GPU: the fused decode kernel reading the paged KV cache (block tables) vs the slot cache.

Issue 13 asks the paged fused path to stay within 5% of the slot path. Same process, same
seeded Qwen3-0.6B-shaped checkpoint (dequantized projections, the CUDA default), the bare
:class:`Engine` with compiled decode on both sides; ``B`` prompts of ``--prompt-len`` random
tokens, ``--new`` greedy tokens each, EOS ignored. Per batch size, the two layouts alternate
``--repeats`` times (after one warm-up run each); reported: the median decode tok/s (tokens
after each row's first / time from the first to the last token event), the median wall time per
engine step in the decode phase, the ratio paged / slots, and whether both generated the same
tokens (they must: same kernel arithmetic, different addressing).

Run (MLX CUDA build): ``python bench/gpu_paged.py --out bench/results/gpu_paged.json``;
``--quick`` for a CPU smoke run (tiny preset; the CPU has no fused path, so it compares the
generic paged gather with the slot cache there).
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

from gpu_summary import step_floor_ms  # noqa: E402
from mlx_serving.models.generation import Engine  # noqa: E402
from mlx_serving.models.generation.kv_cache import kv_bytes_per_token  # noqa: E402
from mlx_serving.models.generation.sampling import SamplingParams  # noqa: E402
from mlx_serving.models.generation.kv_cache import init_paged_kv_cache  # noqa: E402
from mlx_serving.models.generation.slot_cache import init_kv_cache  # noqa: E402
from mlx_serving.models.loader import load  # noqa: E402
from mlx_serving.models.seeded_checkpoint import write_checkpoint  # noqa: E402
from mlx_serving.models.generation.attention import compiled_decode  # noqa: E402
from mlx_serving.models.generation import cuda_kernels as kernels  # noqa: E402
from mlx_serving.models.generation.decode_backends import decode_backend  # noqa: E402


def run(state: Any, prompts: list[list[int]], new: int, layout: str) -> dict[str, Any]:
    """One batch through a fresh engine of ``layout`` ("paged" or "slots")."""
    b, max_len = len(prompts), len(prompts[0]) + new + 8
    kv = {"kv_cache": init_kv_cache(state, max_len, b)} if layout == "slots" else {}
    eng = Engine(state, max_batch=b, max_len=max_len, prefill_chunk=512, compile_decode=True,
                 bucket_shapes=True, **kv)
    eng.warm_up()
    for i, p in enumerate(prompts):
        eng.add(i, p, SamplingParams(max_new_tokens=new, eos_token_ids=()))
    tokens: dict[int, list[int]] = {i: [] for i in range(b)}
    stamps: list[tuple[float, int]] = []  # (time, tokens landed) per step with events
    while eng.num_active:
        events = eng.step()
        if events:
            stamps.append((time.perf_counter(), len(events)))
        for ev in events:
            tokens[ev.seq_id].append(ev.token_id)
    decode = [s for s in stamps if s[1] == b][1:]  # full decode steps after the first
    span = decode[-1][0] - decode[0][0]
    steps = [t1 - t0 for (t0, _), (t1, _) in zip(decode, decode[1:])]
    return {"decode_tok_s": b * (len(decode) - 1) / span, "step_ms": statistics.median(steps) * 1e3,
            "tokens": tokens}


def device_step_ms(state: Any, b: int, pos: int, layout: str, iters: int = 30) -> float:
    """Median ms of one synchronous compiled decode forward of ``b`` rows at position ``pos``
    (no engine: the device time of the step plus its launch), on ``layout``."""
    max_len, bs = pos + 16, 16
    width = -(-max_len // bs)
    args = [mx.zeros((b, 1), dtype=mx.int32), mx.full((b,), pos, dtype=mx.int32), mx.ones((b,), dtype=mx.int32)]
    if layout == "slots":
        cache = init_kv_cache(state, max_len, b)
        fn = compiled_decode(state, max_len, 0)
    else:
        cache = init_paged_kv_cache(state, 1 + b * width, bs)
        fn = compiled_decode(state, max_len, 0, bs)
        args.append(mx.array(1 + np.arange(b * width, dtype=np.int32).reshape(b, width)))
    keys, values = cache.keys, cache.values
    times = []
    for _ in range(iters + 3):
        t0 = time.perf_counter()
        logits, keys, values = fn(*args, keys, values)
        mx.eval(logits, keys, values)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) * 1e3


def copy_bandwidth_gbs(nbytes: int = 1 << 32) -> float:
    """Measured device copy bandwidth, GB/s: bytes read + written by ``y = x + 0`` over a
    ``nbytes`` array (median of 5)."""
    x = mx.zeros((nbytes // 2 // 1024, 1024), dtype=mx.bfloat16)
    mx.eval(x)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        mx.eval(x + 0)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times[1:]) / 1e9


def context_study(state: Any, batches: list[int], positions: list[int], copy_bytes: int) -> list[dict[str, Any]]:
    """Device-only paged decode step (ms) by rows and context position, split-K on (the default
    heuristic) and off, against the floor: (weight bytes + live KV bytes) / copy bandwidth."""
    from gpu_step import step_weight_bytes  # gpu_step imports this module at its top

    weights = step_weight_bytes(state)  # each buffer once (no weight_t views), no embedding table
    kv_per_token = kv_bytes_per_token(state)
    bw = copy_bandwidth_gbs(copy_bytes)
    rows = []
    one = kernels.split_count
    for b in batches:
        for pos in positions:
            floor_ms = step_floor_ms(weights, kv_per_token, b * (pos + 1), bw)
            split = device_step_ms(state, b, pos, "paged")
            kernels.split_count = lambda r, h: 1
            try:
                unsplit = device_step_ms(state, b, pos, "paged")
            finally:
                kernels.split_count = one
            rows.append({"batch": b, "pos": pos, "split_k_ms": split, "one_split_ms": unsplit,
                         "floor_ms": floor_ms, "split_k_over_floor": split / floor_ms, "copy_gbs": bw})
            print(f"B={b:4d} pos={pos:5d}  split-K {split:6.2f} ms  one split {unsplit:6.2f} ms  "
                  f"floor {floor_ms:5.2f} ms  ({split / floor_ms:.2f}x floor)", flush=True)
    return rows


def compare(state: Any, b: int, prompt_len: int, new: int, repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(b)
    prompts = [rng.integers(0, 150000, prompt_len).tolist() for _ in range(b)]
    res: dict[str, list[dict[str, Any]]] = {"slots": [], "paged": []}
    for layout in res:  # warm-up (kernel builds, compiled traces)
        run(state, prompts[:b], new, layout)
    for _ in range(repeats):
        for layout in res:
            res[layout].append(run(state, prompts, new, layout))
    same = res["slots"][0]["tokens"] == res["paged"][0]["tokens"]
    out: dict[str, Any] = {"batch": b, "same_tokens": same}
    for layout, runs in res.items():
        out[layout] = {"decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
                       "step_ms": statistics.median(r["step_ms"] for r in runs),
                       "runs_tok_s": [round(r["decode_tok_s"], 1) for r in runs]}
    out["paged_over_slots"] = out["paged"]["decode_tok_s"] / out["slots"]["decode_tok_s"]
    pos = prompt_len + new // 2
    for layout in res:
        out[layout]["device_step_ms_at_mid"] = device_step_ms(state, b, pos, layout)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/qwen3-0.6b-bench"))
    ap.add_argument("--preset", default="0.6b")
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu_paged.json"))
    ap.add_argument("--quick", action="store_true", help="tiny preset, few tokens: a CPU smoke run")
    ap.add_argument("--copy-bytes", type=int, default=1 << 32, help="array size of the bandwidth probe")
    ap.add_argument("--context", default="", help="ROWS:POS,POS,... e.g. 1,128,256:200,800,1500: the "
                    "device-only context study (split-K on/off vs the floor) instead of the layout comparison")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.batches, args.prompt_len, args.new, args.repeats = "tiny", "1,4", 16, 8, 1
        args.ckpt, args.copy_bytes = Path("/tmp/qwen3-tiny-bench"), 1 << 26
    if not (args.ckpt / "config.json").is_file():
        write_checkpoint(args.ckpt, args.preset, seed=0)
    state = load(args.ckpt, dequantize=True)
    out: dict[str, Any] = {"device": str(mx.default_device()), "mlx": mx.__version__, "preset": args.preset,
                           "decode_path": decode_backend(state).name, "prompt_len": args.prompt_len, "new": args.new,
                           "results": []}
    if args.context:
        batches, positions = ([int(x) for x in part.split(",")] for part in args.context.split(":"))
        out["context"] = context_study(state, batches, positions, args.copy_bytes)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
        return
    for b in (int(x) for x in args.batches.split(",")):
        r = compare(state, b, args.prompt_len, args.new, args.repeats)
        out["results"].append(r)
        print(f"B={b:4d} slots {r['slots']['decode_tok_s']:9.1f} tok/s ({r['slots']['step_ms']:.2f} ms/step)  "
              f"paged {r['paged']['decode_tok_s']:9.1f} tok/s ({r['paged']['step_ms']:.2f} ms/step)  "
              f"paged/slots {r['paged_over_slots']:.3f}  same tokens {r['same_tokens']}  device-only step ms: "
              f"slots {r['slots']['device_step_ms_at_mid']:.2f} paged {r['paged']['device_step_ms_at_mid']:.2f}",
              flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
