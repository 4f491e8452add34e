"""Issues 17's and 28's targets from one GPU session's JSON files: value, target, met, and the
bandwidth floor.

Reads the files ``bash bench/gpu_session.sh all`` leaves in a folder (any missing file leaves its
targets with ``met`` null and is listed under ``missing``):

- ``gpu_step.json`` (bench/gpu_step.py): ``floor`` (the measured copy bandwidth, GB/s; the weight
  bytes one decode step reads, 4-bit and dequantized; KV bytes per cached token), the compiled
  fused steps and the paged device-only steps at position 1,500 (``context``);
- ``gpu_throughput.json`` (one stream, concurrency 1 / 128 with bare engine, 4-bit and mlx-lm rows);
- ``gpu_mixed.json`` (ragged workload; per-request ``prompt_lens`` / ``new_lens``);
- ``prefix_cache_0.6b.json`` (prefix caching on vs off);
- ``gpu_arrivals.json`` (Poisson arrivals per rate);
- ``gpu_llamacpp_tools.json`` and ``gpu_llamacpp_server.json`` (bench/gpu_llamacpp.py: llama-bench,
  llama-batched-bench, llama-server vs ``mlx-serving serve``; issue 28's rows);
- ``gpu_tests.log`` (the CUDA kernel tests' pytest tail) and ``parts.tsv`` (each part's exit status
  and wall seconds), when there.

The floor (issue 17: "bytes of weights + live KV per step / measured copy bandwidth"): one decode
step can take no less than (weight bytes of the measured run's format + cached tokens of the live
rows x KV bytes per token) / copy bandwidth. For a workload, :func:`decode_floor` adds those step
floors over a first-come-first-served schedule of its requests at the run's batch (every live row
gains one token per step; prefill's compute and every host cost are left out), which gives a
floor on its wall time, so on its aggregate tok/s and on each request's first-token time.
``over_floor`` = measured / floor for times and floor / measured for rates (>= 1; 1 is the floor).

Writes ``<folder>/gpu_all.json`` (or ``--out``) and prints one table. Run:
``python bench/gpu_summary.py FOLDER``. Needs only the standard library and numpy (no MLX).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["decode_floor", "step_floor_ms", "summarize"]

# issue 17's targets
ONE_STREAM_RATIO = 2.5  # Serving.stream decode tok/s / mlx-lm generate_step, median of 3 alternating runs
UNIFORM_RATIO = 15.0  # 128 concurrent batched_run_async / mlx-lm batch_generate
SERVING_OVER_ENGINE = 0.9  # the Serving / the bare engine, same process, 128 concurrent
MIXED_RATIO = 15.0  # mixed workload at batch 256 / mlx-lm batch_generate
MIXED_TTFT_P99_S = 3.0  # mixed workload at batch 128
PREFIX_RATIO = 0.25  # TTFT p50 with prefix caching / without, 128 requests x 2,048-token system prompt
ARRIVAL_ITL_P99_MS, ARRIVAL_TTFT_P99_MS, ARRIVAL_RATES = 25.0, 300.0, (8.0, 16.0)
ONE_ROW_1500_MS = 1.0  # one row at position 1,500: decode step under 1 ms
ROWS_256_1500_OVER_FLOOR = 1.3  # 256 rows at position 1,500: within 1.3x of the floor
# issue 28's targets beside llama.cpp's CUDA build (bench/gpu_llamacpp.py)
OVER_LLAMA_TG128 = 1.0  # one stream: Serving.stream decode tok/s / llama-bench tg128, same (bf16) weights
OVER_LLAMA_SERVER_128 = 1.5  # 128 clients: mlx-serving serve / llama-server --parallel 128, output tok/s
GOODPUT_RATE, GOODPUT_FRACTION = 64.0, 0.9  # arrivals: at 64 req/s, >= 90% of requests meet the SLOs


def step_floor_ms(weight_bytes: float, kv_token_bytes: float, cached_tokens: float, gbs: float) -> float:
    """Floor of one decode step, ms: (weights + ``cached_tokens`` of KV) / ``gbs`` GB/s."""
    return (weight_bytes + cached_tokens * kv_token_bytes) / (gbs * 1e9) * 1e3


def decode_floor(prompt_lens: list[int], new_lens: list[int], batch: int, weight_bytes: float,
                 kv_token_bytes: float, gbs: float) -> dict[str, Any]:
    """Bandwidth floor of a workload, all requests submitted at t = 0 and admitted first come
    first served into ``batch`` rows: each step every live row gains one token and costs
    :func:`step_floor_ms` of the live rows' cached tokens. Returns the floor wall (s), aggregate
    tok/s, and first-token times (ms, end of each request's first step) p50 / p99."""
    queue = deque(range(len(prompt_lens)))
    live: dict[int, int] = {}  # request -> tokens generated
    first = np.zeros(len(prompt_lens))
    t_ms = 0.0
    while queue or live:
        while queue and len(live) < batch:
            live[queue.popleft()] = 0
        cached = sum(prompt_lens[i] + g for i, g in live.items())
        t_ms += step_floor_ms(weight_bytes, kv_token_bytes, cached, gbs)
        for i in list(live):
            live[i] += 1
            if live[i] == 1:
                first[i] = t_ms
            if live[i] >= new_lens[i]:
                del live[i]
    total = sum(new_lens)
    return {"wall_s": t_ms / 1e3, "tok_s": total / (t_ms / 1e3), "ttft_ms_p50": float(np.percentile(first, 50)),
            "ttft_ms_p99": float(np.percentile(first, 99))}


def target(name: str, value: float | None, op: str, goal: float, unit: str, source: str,
           floor: float | None = None, figure: float | None = None, figure_unit: str | None = None,
           note: str = "") -> dict[str, Any]:
    """One target row (``op`` ">=" or "<="). ``figure`` (in ``figure_unit``) is our own measured
    quantity that ``floor`` bounds: the value itself (in ``unit``) when not given."""
    met = None if value is None else (value >= goal if op == ">=" else value <= goal)
    row: dict[str, Any] = {"name": name, "value": value, "op": op, "target": goal, "unit": unit, "met": met,
                           "source": source}
    fig, fig_unit = (value, unit) if figure is None else (figure, figure_unit or unit)
    if floor is not None and fig:
        rate = fig_unit.endswith("/s")
        row |= {"figure": fig, "floor": floor, "floor_unit": fig_unit,
                "over_floor": floor / fig if rate else fig / floor}
    if note:
        row["note"] = note
    return row


def _get(doc: dict[str, Any] | None, *keys: Any) -> Any:
    """``doc[k0][k1]...``, None where any level is missing."""
    for k in keys:
        if not isinstance(doc, dict) or k not in doc:
            return None
        doc = doc[k]
    return doc


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


class Floor:
    """The floor inputs of ``gpu_step.json`` (None everywhere when it is missing)."""

    def __init__(self, step: dict[str, Any] | None):
        f = _get(step, "floor") or {}
        self.gbs, self.kv = f.get("copy_gbs"), f.get("kv_bytes_per_token")
        self.weights = f.get("weight_bytes") or {}

    def ok(self, fmt: str) -> bool:
        return self.gbs is not None and self.kv is not None and fmt in self.weights

    def step_ms(self, fmt: str, cached_tokens: float) -> float | None:
        return step_floor_ms(self.weights[fmt], self.kv, cached_tokens, self.gbs) if self.ok(fmt) else None

    def workload(self, fmt: str, prompts: list[int], news: list[int], batch: int) -> dict[str, Any] | None:
        return decode_floor(prompts, news, batch, self.weights[fmt], self.kv, self.gbs) if self.ok(fmt) else None


def throughput_targets(doc: dict[str, Any] | None, fl: Floor) -> list[dict[str, Any]]:
    src = "gpu_throughput.json"
    fmt = _get(doc, "ours_weights") or "dequantized"
    p, n = _get(doc, "prompt_len"), _get(doc, "new_tokens")
    serving = _get(doc, "single", "ours_serving", "decode_tok_s")
    one_floor = None
    if p is not None and fl.ok(fmt):
        one_floor = 1e3 / fl.step_ms(fmt, p + n / 2)  # tok/s at the mean cached length
    row = _get(doc, "curve", "128") or {}
    ours = _get(row, "ours", "tok_s")
    uni = fl.workload(fmt, [p] * 128, [n] * 128, 128) if p is not None else None
    return [
        target("one stream: Serving.stream / mlx-lm generate_step (decode tok/s, median of alternating runs)",
               _ratio(serving, _get(doc, "single", "mlx_lm_generate_step", "decode_tok_s")), ">=", ONE_STREAM_RATIO,
               "x", src, one_floor, serving, "tok/s"),
        target("uniform 128 concurrent: batched_run_async / mlx-lm batch_generate (aggregate tok/s)",
               _ratio(ours, _get(row, "mlx_lm_batch_generate", "tok_s")), ">=", UNIFORM_RATIO, "x", src,
               uni and uni["tok_s"], ours, "tok/s",
               note=f"vs batch_generate with completion_batch_size=128: "
                    f"{_fmt(_ratio(ours, _get(row, 'mlx_lm_batch_generate_cbs_n', 'tok_s')))}x"),
        target("uniform 128 concurrent: the Serving / the bare engine (aggregate tok/s)",
               _ratio(ours, _get(row, "ours_engine", "tok_s")), ">=", SERVING_OVER_ENGINE, "x", src),
    ]


def mixed_targets(doc: dict[str, Any] | None, fl: Floor) -> list[dict[str, Any]]:
    src = "gpu_mixed.json"
    fmt = _get(doc, "ours_weights") or "dequantized"
    prompts, news = _get(doc, "prompt_lens"), _get(doc, "new_lens")
    floors = {b: fl.workload(fmt, prompts, news, b) if prompts else None for b in (256, 128)}
    ours256 = _get(doc, "ours", "256", "tok_s")
    p99 = _get(doc, "ours", "128", "ttft_ms", "p99")
    f128 = floors[128]
    return [
        target("mixed workload, batch 256: ours / mlx-lm batch_generate (aggregate tok/s)",
               _ratio(ours256, _get(doc, "mlx_lm_batch_generate", "tok_s")), ">=", MIXED_RATIO, "x", src,
               floors[256] and floors[256]["tok_s"], ours256, "tok/s"),
        target("mixed workload, batch 128: TTFT p99 (from the stream)", None if p99 is None else p99 / 1e3, "<=",
               MIXED_TTFT_P99_S, "s", src, f128 and f128["ttft_ms_p99"] / 1e3,
               note="floor: first-token time p99 of the bandwidth-floor schedule (prefill compute left out)"),
    ]


def prefix_targets(doc: dict[str, Any] | None) -> list[dict[str, Any]]:
    by = {r["regime"]: r for r in (_get(doc, "results") or [])}
    on, off = _get(by, "on", "ttft_ms_p50"), _get(by, "off", "ttft_ms_p50")
    args = _get(doc, "args") or {"requests": 128, "system": 2048}  # the workload (the all case's)
    return [target(f"prefix caching: TTFT p50 on / off ({args.get('requests')} requests x "
                   f"{args.get('system')}-token system prompt)", _ratio(on, off), "<=", PREFIX_RATIO, "x",
                   "prefix_cache_0.6b.json", note=f"TTFT p50 on {on} ms, off {off} ms")]


def arrival_targets(doc: dict[str, Any] | None, fl: Floor) -> list[dict[str, Any]]:
    src = "gpu_arrivals.json"
    cfg = _get(doc, "config") or {}
    fmt = cfg.get("weights", "dequantized")
    runs = {r["rate"]: r for r in (_get(doc, "runs") or [])}
    rows = []
    for rate in ARRIVAL_RATES:
        r = runs.get(rate)
        itl_floor = None
        if r is not None and cfg:
            live = max(1, _get(r, "peaks", "seqs_running") or 1)
            ctx = cfg["system_tokens"] + cfg["user_tokens"] + cfg["new"] / 2
            itl_floor = fl.step_ms(fmt, live * ctx)
        rows.append(target(f"arrivals {rate:g} req/s: ITL p99", _get(r, "itl_ms", "p99"), "<=", ARRIVAL_ITL_P99_MS,
                           "ms", src, itl_floor, note="floor: one step at the peak running rows, mean context"))
        rows.append(target(f"arrivals {rate:g} req/s: TTFT p99", _get(r, "ttft_ms", "p99"), "<=",
                           ARRIVAL_TTFT_P99_MS, "ms", src))
    return rows


def llamacpp_targets(tools: dict[str, Any] | None, srv: dict[str, Any] | None, thr: dict[str, Any] | None,
                     fl: Floor) -> list[dict[str, Any]]:
    """Ours beside llama.cpp: one stream vs llama-bench tg128 (bf16), 128 clients vs llama-server."""
    tg = {fmt: next((r["avg_ts"] for r in rows if r.get("n_gen") == 128), None)
          for fmt, rows in (_get(tools, "llama_bench") or {}).items()}
    serving = _get(thr, "single", "ours_serving", "decode_tok_s")
    engine4 = _get(thr, "single", "ours_engine_4bit", "decode_tok_s")
    p, n = _get(thr, "prompt_len"), _get(thr, "new_tokens")
    one_floor = 1e3 / fl.step_ms("dequantized", p + n / 2) if p is not None and fl.ok("dequantized") else None
    level = _get(srv, "levels", "128") or {}
    fastest = _get(level, "fastest_llama_server") or "llama_server"
    ours, llama = _get(level, "ours", "tok_s"), _get(level, fastest, "tok_s")
    prompt, new = _get(srv, "prompt_tokens") or 128, _get(srv, "new_tokens") or 128
    uni = fl.workload("dequantized", [prompt] * 128, [new] * 128, 128)
    return [
        target("one stream: Serving.stream / llama-bench tg128, bf16 weights (decode tok/s)",
               _ratio(serving, tg.get("bf16")), ">=", OVER_LLAMA_TG128, "x", "gpu_llamacpp_tools.json", one_floor,
               serving, "tok/s", note=f"llama.cpp tg128 tok/s: {', '.join(f'{k} {_fmt(v)}' for k, v in tg.items())}; "
                                      f"our 4-bit engine {_fmt(engine4)} = {_fmt(_ratio(engine4, tg.get('q4_0')))}x q4_0"),
        target("128 clients over HTTP: mlx-serving serve / llama-server --parallel 128 (output tok/s)",
               _get(level, "ours_over_llama_server"), ">=", OVER_LLAMA_SERVER_128, "x", "gpu_llamacpp_server.json",
               uni and uni["tok_s"], ours, "tok/s",
               note=f"ours {_fmt(ours)} vs {fastest} {_fmt(llama)} tok/s; TTFT p50 {_fmt(_get(level, 'ours', 'ttft_ms_p50'))}"
                    f" vs {_fmt(_get(level, fastest, 'ttft_ms_p50'))} ms; floor: the bf16 weights"),
    ]


def goodput_target(doc: dict[str, Any] | None) -> dict[str, Any]:
    run = next((r for r in (_get(doc, "runs") or []) if r["rate"] == GOODPUT_RATE), None)
    return target(f"arrivals {GOODPUT_RATE:g} req/s: goodput (TTFT <= 1 s and ITL p99 <= 50 ms)",
                  _get(run, "goodput"), ">=", GOODPUT_FRACTION, "fraction", "gpu_arrivals.json",
                  note=f"ITL p99 {_fmt(_get(run, 'itl_ms', 'p99'))} ms, TTFT p99 {_fmt(_get(run, 'ttft_ms', 'p99'))} ms")


def step_targets(doc: dict[str, Any] | None) -> list[dict[str, Any]]:
    src = "gpu_step.json"
    ctx = {(r["batch"], r["pos"]): r for r in (_get(doc, "context") or [])}
    one, many = ctx.get((1, 1500)), ctx.get((256, 1500))
    return [
        target("decode step, 1 row at position 1,500 (paged, device-only)", _get(one, "step_ms"), "<=",
               ONE_ROW_1500_MS, "ms", src, _get(one, "floor_ms")),
        target("decode step, 256 rows at position 1,500: step / floor", _get(many, "over_floor"), "<=",
               ROWS_256_1500_OVER_FLOOR, "x", src, _get(many, "floor_ms"), _get(many, "step_ms"), "ms"),
    ]


def tests_target(log: str | None) -> dict[str, Any]:
    """The CUDA kernel tests passed: a pytest tail with "N passed" and no failure or error."""
    passed = re.search(r"(\d+) passed", log or "")
    bad = re.search(r"(\d+) (failed|error)", log or "")
    value = None if log is None else float(passed.group(1)) if passed and not bad else 0.0
    row = target("CUDA kernel and fused-path tests pass (tests passed)", value, ">=", 1, "tests", "gpu_tests.log")
    if log is not None:
        row["met"], row["note"] = bool(passed) and not bad, log.strip().splitlines()[-1] if log.strip() else ""
    return row


def weights_info(doc: dict[str, Any] | None) -> dict[str, Any]:
    """4-bit vs dequantized numbers of the throughput run, and the library's default."""
    single, curve = _get(doc, "single") or {}, _get(doc, "curve") or {}
    deq_name = "ours" if _get(doc, "ours_weights") == "dequantized" else None
    rows = {"one stream, bare engine, decode tok/s": (_get(single, "ours_engine_4bit", "decode_tok_s"),
                                                      _get(single, "ours_engine", "decode_tok_s"))}
    for n in ("1", "128"):
        rows[f"{n} concurrent through the Serving, tok/s"] = (_get(curve, n, "ours_4bit", "tok_s"),
                                                             _get(curve, n, deq_name, "tok_s") if deq_name else None)
    table = {k: {"4bit": a, "dequantized": b, "dequantized_over_4bit": _ratio(b, a)} for k, (a, b) in rows.items()}
    return {"library_default": _get(doc, "library_default_weights"), "comparison": table}


def summarize(folder: Path) -> dict[str, Any]:
    """Every target of issues 17 and 28 from the JSON files in ``folder`` (see the module docstring)."""
    names = ("gpu_step.json", "gpu_throughput.json", "gpu_mixed.json", "prefix_cache_0.6b.json", "gpu_arrivals.json",
             "gpu_llamacpp_tools.json", "gpu_llamacpp_server.json")
    docs = {n: json.loads((folder / n).read_text()) if (folder / n).is_file() else None for n in names}
    log = (folder / "gpu_tests.log").read_text() if (folder / "gpu_tests.log").is_file() else None
    fl = Floor(docs["gpu_step.json"])
    targets = (throughput_targets(docs["gpu_throughput.json"], fl) + mixed_targets(docs["gpu_mixed.json"], fl)
               + prefix_targets(docs["prefix_cache_0.6b.json"]) + arrival_targets(docs["gpu_arrivals.json"], fl)
               + step_targets(docs["gpu_step.json"]) + [tests_target(log)]
               + llamacpp_targets(docs["gpu_llamacpp_tools.json"], docs["gpu_llamacpp_server.json"],
                                  docs["gpu_throughput.json"], fl) + [goodput_target(docs["gpu_arrivals.json"])])
    arrivals = docs["gpu_arrivals.json"] or {}
    parts = []
    if (folder / "parts.tsv").is_file():
        for line in (folder / "parts.tsv").read_text().splitlines():
            name, rc, wall = line.split("\t")
            parts.append({"part": name, "exit": rc, "wall_s": int(wall)})
    return {
        "device": _get(docs["gpu_step.json"], "device"), "mlx": _get(docs["gpu_step.json"], "mlx"),
        "floor_inputs": {"copy_gbs": fl.gbs, "weight_bytes": fl.weights, "kv_bytes_per_token": fl.kv},
        "targets": targets,
        "goodput": {"max_rate_meeting_goodput": arrivals.get("max_goodput_rate"), "bracket": arrivals.get("bracket"),
                    "peak_memory_gb_by_rate": {str(r["rate"]): r["peak_memory_bytes"] / 1e9
                                               for r in arrivals.get("runs", [])}},
        "weights": weights_info(docs["gpu_throughput.json"]),
        "decode_steps": {k: {f: v.get(f) for f in ("step_ms", "floor_ms", "over_floor", "error") if f in v}
                         for k, v in (_get(docs["gpu_step.json"], "steps") or {}).items()},
        "mlx_lm_generate_step_tok_s": _get(docs["gpu_step.json"], "mlx_lm_generate_step", "decode_tok_s"),
        "parts": parts, "missing": [n for n, d in docs.items() if d is None] + ([] if log else ["gpu_tests.log"]),
    }


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def print_table(s: dict[str, Any]) -> None:
    f = s["floor_inputs"]
    print(f"copy bandwidth {_fmt(f['copy_gbs'])} GB/s; weight bytes per step {f['weight_bytes']}; "
          f"KV {f['kv_bytes_per_token']} B/token")
    print(f"{'target':<100}{'value':>9}{'goal':>10}{'met':>6}{'figure':>10}{'floor':>10}{'unit':>6}{'x floor':>8}")
    for t in s["targets"]:
        met = {True: "yes", False: "NO", None: "-"}[t["met"]]
        print(f"{t['name'][:99]:<100}{_fmt(t['value']):>9}{t['op'] + _fmt(t['target']):>10}{met:>6}"
              f"{_fmt(t.get('figure')):>10}{_fmt(t.get('floor')):>10}{t.get('floor_unit', ''):>6}"
              f"{_fmt(t.get('over_floor')):>8}")
    g = s["goodput"]
    print(f"goodput: highest rate meeting it {g['max_rate_meeting_goodput']} req/s (bracket {g['bracket']}); "
          f"peak memory GB by rate {({k: round(v, 1) for k, v in g['peak_memory_gb_by_rate'].items()})}")
    w = s["weights"]
    print(f"weights: library default {w['library_default']}; " + "; ".join(
        f"{k}: 4-bit {_fmt(v['4bit'])} vs dequantized {_fmt(v['dequantized'])}" for k, v in w["comparison"].items()))
    if s["parts"]:
        print("parts (exit, wall s): " + ", ".join(f"{p['part']} {p['exit']} {p['wall_s']}" for p in s["parts"]))
    if s["missing"]:
        print(f"missing: {', '.join(s['missing'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("folder", type=Path, help="where gpu_session.sh all wrote its JSON ($OUT)")
    ap.add_argument("--out", type=Path, default=None, help="default FOLDER/gpu_all.json")
    args = ap.parse_args()
    summary = summarize(args.folder)
    (args.out or args.folder / "gpu_all.json").write_text(json.dumps(summary, indent=2))
    print_table(summary)


if __name__ == "__main__":
    main()
