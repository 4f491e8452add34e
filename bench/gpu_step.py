"""GPU decode-step study: where the time of one decode step goes, per attention path and
with or without ``mx.compile``.

One seeded Qwen3-0.6B-shaped 4-bit checkpoint (as bench/gpu_throughput.py), a paged cache of 128
rows (a fixed block table per row), every row at position ``--pos`` (attention span ``--pos + 1``). For B rows, a loop
of pipelined decode steps as the Engine runs them (build step n+1, ``mx.async_eval`` it,
then read step n's tokens on the host), greedy tokens fed back. Reports per variant the
median host time to build one step's graph (``build_ms``), to encode it into MLX's CUDA graphs
(``encode_ms``: the ``mx.async_eval`` call), the wall time per step (``step_ms``) and the
primitives one step records (``ops``); ``--engine``: the Engine's one-stream decode tok/s and greedy ids
per backend too (:func:`engine_rounds`). Variants: the decode backend (``decode_backend(state, name)``) "matmul" / "sdpa" / "fused", eager or
through one ``mx.compile``d step (forward + argmax) ("compiled-" prefix; "fusedmm": the fused
kernels with MLX's matmuls, without :func:`cuda_gemv.qmv`'s folded products), with the 4-bit
weights or dequantized to dense matrices ("-dequant" suffix), and, at B = 1, the dense path
(no mask, sliced cache) of the generic path. Also checks the fused path against the
generic one (logits on ragged rows, greedy tokens of an Engine run; float32 and
bfloat16), times mlx-lm's ``generate_step`` (one stream), and with ``--micro`` only the
projection shapes as 4-bit vs dequantized matmuls.

The physical floor (issue 17: bytes of weights + live KV per step / measured copy bandwidth):
the copy bandwidth is measured once (``y = x + 0`` over a ``--copy-bytes`` array, bytes read +
written, median of 5: ``gpu_paged.copy_bandwidth_gbs``) and recorded under ``floor`` with the
weight bytes one step reads in each format (:func:`step_weight_bytes`) and the KV bytes per
token; every timed row gets ``floor_ms`` = (weights of its format + rows x (pos + 1) x KV bytes
per token) / bandwidth. ``--context ROWS:POS,...`` also times the bare compiled paged decode
forward (``gpu_paged.device_step_ms``: dequantized projections, the split-K heuristic, median of
30 synchronous steps) at those points, for issue 17's decode-attention targets (one row at
position 1,500 under 1 ms; 256 rows at 1,500 within 1.3x of the floor).

Run (MLX CUDA build): ``python bench/gpu_step.py --tag NAME``; JSON to
bench/results/gpu_step_NAME.json (or ``--out``). ``MLX_MAX_OPS_PER_BUFFER`` (MLX's CUDA-graph
size) is read from the environment and recorded. On CPU ``--quick`` (tiny preset, 1 and 4 rows,
no parity check, a 64 MiB bandwidth probe) is a smoke run; the fused variants record their error
there (no CUDA kernels).
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import re
import statistics
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_paged import copy_bandwidth_gbs, device_step_ms  # noqa: E402
from gpu_summary import step_floor_ms  # noqa: E402
from gpu_throughput import default_ckpt, save  # noqa: E402
from mlx_serving.models._weights import Fused, Linear  # noqa: E402
from mlx_serving.models.loader import load  # noqa: E402
from mlx_serving.models.decoder.decode_backends import DecodeBackend, FusedDecode, decode_backend  # noqa: E402
from mlx_serving.models.decoder.cuda_kernels import kernels_available  # noqa: E402
from mlx_serving.models.decoder.kv_cache import (PagedKVCache, init_paged_kv_cache, kv_bytes_per_token,  # noqa: E402
                                                    row_blocks)
from mlx_serving.models.seeded_checkpoint import write_checkpoint  # noqa: E402
from mlx_serving.models.decoder.attention import Rows  # noqa: E402
from mlx_serving.models.decoder.layers import forward  # noqa: E402

__all__ = ["step_weight_bytes"]

StepFn = Callable[[mx.array], mx.array]


def paged_cache(state: Any, max_len: int, rows: int) -> tuple[PagedKVCache, np.ndarray]:
    """A paged cache of ``rows`` rows x ``max_len`` positions and its fixed block table."""
    table = row_blocks(rows, max_len)
    return init_paged_kv_cache(state, table.size), table


def eager_step(state: Any, cache: PagedKVCache, table: np.ndarray, b: int, pos: int, dense: bool,
               decode: DecodeBackend) -> StepFn:
    start, n_valid, blocks = mx.full((b,), pos, dtype=mx.int32), mx.ones((b,), dtype=mx.int32), mx.array(table[:b])
    span = pos + 1

    def step(tokens: mx.array) -> mx.array:
        rows = Rows(tokens[:, None], start, n_valid, span, mx.zeros((b,), dtype=mx.int32), blocks, dense=dense)
        return mx.argmax(forward(state, cache, rows, decode), axis=-1).astype(mx.int32)

    return step


def compiled_step(state: Any, cache: PagedKVCache, table: np.ndarray, b: int, pos: int,
                  decode: DecodeBackend) -> StepFn:
    start, n_valid, blocks = mx.full((b,), pos, dtype=mx.int32), mx.ones((b,), dtype=mx.int32), mx.array(table[:b])
    span = pos + 1

    def inner(tokens: mx.array, keys: list[mx.array], values: list[mx.array]) -> tuple:
        c = PagedKVCache(list(keys), list(values), cache.block_size)
        rows = Rows(tokens[:, None], start, n_valid, span, mx.zeros((b,), dtype=mx.int32), blocks)
        return mx.argmax(forward(state, c, rows, decode), axis=-1).astype(mx.int32), c.keys, c.values

    fn = mx.compile(inner)

    def step(tokens: mx.array) -> mx.array:
        out, keys, values = fn(tokens, cache.keys, cache.values)
        cache.keys[:], cache.values[:] = keys, values
        return out

    return step


def run(step: StepFn, b: int, n: int, warm: int = 3) -> dict[str, float]:
    tokens = mx.zeros((b,), dtype=mx.int32)
    t_first = time.perf_counter()
    for _ in range(warm):
        tokens = step(tokens)
        mx.eval(tokens)
    first_ms = (time.perf_counter() - t_first) * 1e3
    builds: list[float] = []
    encodes: list[float] = []
    prev = None
    t0 = time.perf_counter()
    for _ in range(n):
        a = time.perf_counter()
        tokens = step(tokens)
        e = time.perf_counter()
        mx.async_eval(tokens)
        builds.append(e - a)
        encodes.append(time.perf_counter() - e)
        if prev is not None:
            np.array(prev)
        prev = tokens
    np.array(prev)
    wall = time.perf_counter() - t0
    return {"warm_ms": first_ms, "build_ms": statistics.median(builds) * 1e3,
            "encode_ms": statistics.median(encodes) * 1e3, "step_ms": wall / n * 1e3}


def graph_ops(step: StepFn, b: int) -> dict[str, int]:
    """The primitives MLX records for one step (``mx.export_to_dot`` of its output, before evaluation),
    by name, with their ``total``: each is encoded on the host per step; most launch one kernel."""
    out = step(mx.zeros((b,), dtype=mx.int32))
    buf = io.StringIO()
    mx.export_to_dot(buf, out)
    mx.eval(out)
    names = collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', buf.getvalue()))
    return dict(names.most_common()) | {"total": sum(names.values())}


def engine_one_stream(state: Any, decode: DecodeBackend, new: int = 128) -> dict[str, Any]:
    """Decode tokens per second of one request (128-token prompt, ``new`` greedy tokens) through the
    Engine with ``decode`` (the Engine's defaults otherwise): the best of three runs, and the ids."""
    from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams
    eng = Engine(state, EngineConfig.of(max_batch=1, max_len=512, decode_path=decode))
    best, ids = 0.0, []
    for r in range(3):
        eng.add(r, list(range(100, 228)), SamplingParams(max_new_tokens=new, eos_token_ids=()))
        stamps, ids = [], []
        while eng.num_active:
            for ev in eng.step():
                stamps.append(time.perf_counter())
                ids.append(ev.token_id)
        best = max(best, (len(stamps) - 2) / (stamps[-1] - stamps[1]))
    eng.close()
    return {"decode_tok_s": best, "ids": ids}


def path_parity(ckpt: Path, dtype: str, seed: int = 0) -> dict[str, Any]:
    """The "fused" decode path vs the generic "matmul" one: logits of one decode forward
    over ragged rows (random cache contents, a quarter of the rows padding), and the greedy
    tokens of two Engine runs (8 prompts of 5..200 tokens, 32 new tokens each)."""
    from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams
    state = load(ckpt, dtype=dtype)
    out: dict[str, Any] = {"dtype": dtype}
    cache, table = paged_cache(state, 512, 128)
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    for b in (1, 8, 128):
        for i in range(len(cache.keys)):
            cache.keys[i] = mx.random.normal(cache.keys[i].shape).astype(state.dtype)
            cache.values[i] = mx.random.normal(cache.values[i].shape).astype(state.dtype)
        real = np.ones(b, dtype=np.int32)
        real[rng.permutation(b)[: b // 4]] = 0
        start = mx.array(rng.integers(0, 400, size=b).astype(np.int32))
        rows = Rows(mx.array(rng.integers(0, 5000, size=(b, 1)).astype(np.int32)), start, mx.array(real),
                    int(np.array(start).max()) + 1, mx.zeros((b,), dtype=mx.int32), mx.array(table[:b]))
        logits = {}
        for mode in ("matmul", "fused"):
            logits[mode] = forward(state, cache, rows, decode_backend(state, mode)).astype(mx.float32)[
                mx.array(np.flatnonzero(real))]
            mx.eval(logits[mode])
        diff = mx.abs(logits["fused"] - logits["matmul"]).max().item()
        same = (mx.argmax(logits["fused"], -1) == mx.argmax(logits["matmul"], -1)).astype(mx.float32).mean().item()
        out[f"forward B={b}"] = {"max_abs_diff": diff, "logit_scale": mx.abs(logits["matmul"]).max().item(),
                                 "argmax_equal": same}
    prompts = [rng.integers(100, 5000, size=int(n)).tolist() for n in rng.integers(5, 200, size=8)]
    tokens = {}
    for name, mode, compiled in (("matmul", "matmul", False), ("fused", "fused", False),
                                 ("fused+compile", "fused", True)):
        eng = Engine(state, EngineConfig.of(max_batch=8, max_len=256, compile_decode=compiled, decode_path=mode))
        for i, p in enumerate(prompts):
            eng.add(i, p, SamplingParams(max_new_tokens=32, eos_token_ids=()))
        got: dict[int, list[int]] = {i: [] for i in range(8)}
        while eng.num_active:
            for ev in eng.step():
                got[ev.seq_id].append(ev.token_id)
        tokens[name] = got
    same = sum(a == b for i in range(8) for a, b in zip(tokens["fused"][i], tokens["matmul"][i]))
    out["engine_tokens_equal"] = same / (8 * 32)
    out["engine_compiled_equals_eager"] = tokens["fused+compile"] == tokens["fused"]
    out["engine_first_divergence"] = [next((k for k, (a, b) in enumerate(zip(tokens["fused"][i], tokens["matmul"][i]))
                                            if a != b), None) for i in range(8)]
    return out


def linear_micro(state: Any, calls: int = 200) -> dict[str, Any]:
    """Per-call wall time (us) of each projection shape of layer 0 and the head, as 4-bit
    ``quantized_matmul`` and as a dequantized bfloat16 matmul, at several row counts
    (``calls`` independent calls, one eval)."""
    layer = state.layers[0]
    mods = {"qkv": layer.qkv.merged, "o_proj": layer.o_proj, "gate_up": layer.gate_up.merged,
            "down": layer.down_proj, "head": state.lm_head}
    res: dict[str, Any] = {}
    for name, lin in mods.items():
        if lin.scales is None:
            continue
        w = mx.dequantize(lin.weight, lin.scales, lin.biases, group_size=lin.spec.group_size,
                          bits=lin.spec.bits).astype(state.dtype)
        k = w.shape[1]
        for m in (1, 8, 32, 128, 256):
            x = mx.random.normal((m, k)).astype(state.dtype)
            for kind, fn in (("q4", lin), ("bf16", lambda a, w=w: a @ w.T)):
                mx.eval(fn(x))
                t0 = time.perf_counter()
                mx.eval([fn(x + i) for i in range(calls)])
                res[f"{name} M={m} {kind}"] = (time.perf_counter() - t0) / calls * 1e6
        print({k_: round(v, 1) for k_, v in res.items() if k_.startswith(name)}, flush=True)
    return res


def mlxlm_single(path: Path, new: int) -> dict[str, float]:
    from mlx_lm import load as mlxlm_load
    from mlx_lm.generate import generate_step
    model, _ = mlxlm_load(str(path))
    prompt = mx.array(np.arange(100, 228, dtype=np.int32))
    res = {}
    for _ in range(2):
        t0 = time.perf_counter()
        stamps = [time.perf_counter() for _ in generate_step(prompt, model, max_tokens=new)]
        res = {"ttft_ms": (stamps[0] - t0) * 1e3, "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}
    return res


def _part_bytes(part: Any) -> int:
    """Bytes of one weight part: a matrix (packed weight, scales, biases, bias; ``weight_t`` is a
    view of ``weight`` and holds no memory of its own), fused matrices, or a vector."""
    if isinstance(part, Fused):
        return sum(_part_bytes(lin) for lin in part.linears())
    if isinstance(part, Linear):
        return sum(a.nbytes for a in (part.weight, part.scales, part.biases, part.bias) if a is not None)
    return part.nbytes if isinstance(part, mx.array) else 0


def step_weight_bytes(state: Any) -> int:
    """Bytes of weights one decode step reads: every layer's matrices and norms, the final norm
    and the head. The embedding table is left out (a step reads one row of it per sequence)
    unless it is the head (tied embeddings: ``lm_head is embed_tokens``, counted once)."""
    layers = sum(_part_bytes(getattr(layer, f.name)) for layer in state.layers for f in fields(layer))
    return layers + _part_bytes(state.norm) + _part_bytes(state.lm_head)


def floor_info(state: Any, dense_state: Any, copy_bytes: int) -> dict[str, Any]:
    """The measured copy bandwidth and the byte counts the floors of every bench are built from."""
    return {"copy_gbs": copy_bandwidth_gbs(copy_bytes), "copy_bytes": copy_bytes,
            "weight_bytes": {"4bit": step_weight_bytes(state), "dequantized": step_weight_bytes(dense_state)},
            "kv_bytes_per_token": kv_bytes_per_token(state), "kv_dtype": str(state.dtype),
            "formula": "(weight_bytes + rows x cached tokens x kv_bytes_per_token) / copy_gbs"}


def step_study(args: argparse.Namespace, state: Any, dense_state: Any, floor: dict[str, Any]) -> dict[str, Any]:
    """Every variant at every ``--batches`` value (and "dense" at one row), with its floor."""
    cache, table = paged_cache(state, max(512, args.pos + 16), max(128, *args.batch_list))
    results: dict[str, Any] = {}
    for b in args.batch_list:
        for variant in args.variants.split(",") + (["dense"] if b == 1 else []):
            dequant = variant.endswith("-dequant")
            try:
                compiled = variant.startswith("compiled-")
                path = variant.removeprefix("compiled-").removesuffix("-dequant")
                st = dense_state if dequant else state
                decode = (FusedDecode() if path == "fusedmm"  # the kernels with MLX's matmuls (no qmv)
                          else decode_backend(st, "matmul" if variant == "dense" else path))
                fn = (compiled_step(st, cache, table, b, args.pos, decode) if compiled
                      else eager_step(st, cache, table, b, args.pos, variant == "dense", decode))
                r = run(fn, b, args.steps)
                r["ops"] = graph_ops(fn, b)
                fl = step_floor_ms(floor["weight_bytes"]["dequantized" if dequant else "4bit"],
                                   floor["kv_bytes_per_token"], b * (args.pos + 1), floor["copy_gbs"])
                r |= {"floor_ms": fl, "over_floor": r["step_ms"] / fl}
            except Exception as e:  # noqa: BLE001 - a study: record and go on
                r = {"error": repr(e)[:300]}
            results[f"{variant} B={b}"] = r
            print(f"{variant:>16} B={b:<4} {r}", flush=True)
    return results


def engine_rounds(state: Any, rounds: int) -> dict[str, Any]:
    """The Engine's one-stream decode tok/s per backend ("matmul": the generic path; "fusedmm": the
    fused kernels with MLX's matmuls; "fused": with the folded 4-bit products), ``rounds`` alternating
    rounds, each a fresh Engine: every round's figure, the median, and whether each backend's greedy
    ids equal the generic path's."""
    backends = {"matmul": decode_backend(state, "matmul")}
    if kernels_available():  # the fused backends run only on MLX's CUDA build
        backends |= {"fusedmm": FusedDecode(), "fused": decode_backend(state, "fused")}
    runs: dict[str, list[float]] = {k: [] for k in backends}
    ids: dict[str, list[int]] = {}
    for _ in range(rounds):
        for name, decode in backends.items():
            r = engine_one_stream(state, decode)
            runs[name].append(r["decode_tok_s"])
            ids[name] = r["ids"]
    out = {k: {"tok_s": v, "median_tok_s": statistics.median(v), "ids_equal_matmul": ids[k] == ids["matmul"],
               "first_divergence": next((i for i, (a, b) in enumerate(zip(ids[k], ids["matmul"])) if a != b), None)}
           for k, v in runs.items()}
    print("engine one stream", json.dumps(out), flush=True)
    return out


def context_study(dense_state: Any, spec: str, floor: dict[str, Any]) -> list[dict[str, Any]]:
    """Device-only compiled paged decode step (``gpu_paged.device_step_ms``, split-K heuristic on)
    at each (rows, position) of ``spec`` ("ROWS,...:POS,..."), against its floor."""
    batches, positions = ([int(x) for x in part.split(",")] for part in spec.split(":"))
    rows = []
    for b in batches:
        for pos in positions:
            ms = device_step_ms(dense_state, b, pos)
            fl = step_floor_ms(floor["weight_bytes"]["dequantized"], floor["kv_bytes_per_token"], b * (pos + 1),
                               floor["copy_gbs"])
            rows.append({"batch": b, "pos": pos, "step_ms": ms, "floor_ms": fl, "over_floor": ms / fl})
            print(f"paged device step B={b} pos={pos}: {ms:.2f} ms, floor {fl:.2f} ms ({ms / fl:.2f}x)", flush=True)
    return rows


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, default=None, help="default /tmp/qwen3-<preset>-bench (written if missing)")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--variants", default="matmul,sdpa,fused,compiled-matmul,compiled-fused")
    ap.add_argument("--pos", type=int, default=200)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--tag", default="default")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/gpu_step_<tag>.json)")
    ap.add_argument("--preset", default="0.6b", help="checkpoint shape written when --ckpt is missing")
    ap.add_argument("--micro", action="store_true", help="only the projection micro-benchmark")
    ap.add_argument("--no-parity", action="store_true", help="skip the fused vs generic parity check")
    ap.add_argument("--no-mlx-lm", action="store_true", help="skip mlx-lm's one-stream generate_step")
    ap.add_argument("--context", default="", help="ROWS:POS,... e.g. 1,256:1500: device-only paged decode steps")
    ap.add_argument("--copy-bytes", type=int, default=1 << 32, help="array size of the bandwidth probe")
    ap.add_argument("--engine", action="store_true", help="also the Engine's one-stream tok/s: matmul, fusedmm, fused alternating, 3 rounds")
    ap.add_argument("--quick", action="store_true", help="tiny preset, 1 and 4 rows, no parity: a CPU smoke run")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.batches, args.steps, args.pos, args.no_parity = "tiny", "1,4", 4, 32, True
        args.copy_bytes = 1 << 26
    args.ckpt = args.ckpt or default_ckpt(args.preset)
    args.out = args.out or Path(f"bench/results/gpu_step_{args.tag}.json")
    args.batch_list = [int(x) for x in args.batches.split(",")]
    return args


def main() -> None:
    args = parse_args()
    if not (args.ckpt / "config.json").is_file():
        write_checkpoint(args.ckpt, args.preset, seed=0)
    state = load(args.ckpt)
    out: dict[str, Any] = {"mlx": mx.__version__, "device": str(mx.default_device()), "pos": args.pos,
                           "MLX_MAX_OPS_PER_BUFFER": os.environ.get("MLX_MAX_OPS_PER_BUFFER", "default"),
                           "dtype": str(state.dtype), "preset": args.preset}
    if args.micro:
        out["linear_us"] = linear_micro(state)
        save(args.out, out)
        return
    dense_state = load(args.ckpt, dequantize=True)  # the same weights as dense matrices
    out["floor"] = floor = floor_info(state, dense_state, args.copy_bytes)
    print(f"copy bandwidth {floor['copy_gbs']:.0f} GB/s; weights per step {floor['weight_bytes']}; "
          f"KV {floor['kv_bytes_per_token']} B/token", flush=True)
    save(args.out, out)
    if not args.no_parity:
        for dtype in ("float32", "bfloat16"):
            try:
                out[f"parity_{dtype}"] = path_parity(args.ckpt, dtype)
            except Exception as e:  # noqa: BLE001 - a study: record and go on
                out[f"parity_{dtype}"] = repr(e)[:2000]
            print(json.dumps(out[f"parity_{dtype}"], indent=1), flush=True)
    out["steps"] = step_study(args, state, dense_state, floor)
    save(args.out, out)
    if args.context:
        out["context"] = context_study(dense_state, args.context, floor)
        save(args.out, out)
    if args.engine:
        out["engine_one_stream"] = engine_rounds(state, 3)
        save(args.out, out)
    if not args.no_mlx_lm:
        out["mlx_lm_generate_step"] = mlxlm_single(args.ckpt, 128)
        print("mlx-lm", out["mlx_lm_generate_step"], flush=True)
    save(args.out, out)


if __name__ == "__main__":
    main()
