"""Arrivals (issues 17, 37): Poisson arrivals, streamed clients, per rate.

Workload per rate r (requests/s): arrival times are a seeded Poisson process (exponential gaps of
mean 1/r seconds) over ``--duration`` seconds. ``--workload shared-prefix`` (issue 17, the
default): each request is plain text = a shared system part of ``--system-tokens`` tokens (one per
rate run, so each rate starts with it uncached) followed by its own ``--user-tokens`` unique tokens,
``--new`` greedy new tokens. ``--workload chat`` (issue 37): chat-like lengths, each request's
own prompt of P tokens and N new tokens, P and N seeded log-normal (P: median 200, sigma 0.8,
clipped to 16-1,024; N: median 100, sigma 0.6, clipped to 16-512; means ~270 and ~115), no
shared prefix. Prompts are random one-token words that round-trip through the tokenizer
(``gpu_throughput.word_prompts``); EOS is ignored. Each client awaits its arrival time, then calls
``Serving.stream_async`` on one event loop with ``deadline=--deadline``. Our text-generation
serving: ``max_batch`` = ``--max-batch``, prefix caching on (unless ``--no-prefix-caching``),
seeded Qwen3-0.6B-shaped checkpoint, projections dequantized, the library's step budget and
warm-up. ``--fresh``: the first rate starts the moment ``Serving.start`` returns (no warm-up drive,
no quiet period: what a server sees when traffic is waiting for it); the load -> ready time and the
shapes the runner built on a request's path (``cold_shapes``) are reported. ``--kv-cache-dtype``
(auto, int8, int4, ...) and ``--decode-path`` set the serving's KV blocks and decode path (the JSON
records both under ``config``, and the path they resolve to as ``decode_path``). Issue 42:
``bench/gpu_kv_quant.py`` runs this per KV dtype, alternating.

Measured per rate, all from the client's stream (times in ms):

- TTFT of a request = its submission (just before ``stream_async`` is awaited) -> the first item its
  stream yields; p50 / p99 / max over requests;
- ITL = gaps between consecutive text items of one request (one item per token, except that a token
  completing no UTF-8 character yields none: ``tokens`` and ``text_events`` are reported); p50 / p99
  over all gaps of all requests;
- goodput = fraction of arrived requests with TTFT <= ``--ttft-slo`` (1 s) and their own ITL p99 <=
  ``--itl-slo`` (50 ms); a request past its deadline counts as missing it; the rate "meets goodput"
  when that fraction is >= ``--goodput-target`` (0.9);
- peak memory MLX allocated during the rate (``mx.get_peak_memory()`` after
  ``mx.reset_peak_memory()``, bytes: device memory on a GPU; the process's peak RSS, MB, is
  reported once for the whole run as ``peak_rss_mb_process``), the largest KV
  blocks in use, sequences running / waiting (``handle.stats().backend`` sampled every 50 ms) and
  the prefix-cache counters of the rate (``prefix_queries``, ``prefix_hits``, ``prefix_query_tokens``,
  ``prefix_hit_tokens``, ``preemptions``, ``evictions``: differences over the rate);
- client scheduling lag (actual submission - scheduled arrival), p99, to show when the client loop
  itself fell behind; generated tok/s = tokens / (last item - first arrival).

Search: the listed ``--rates`` run in ascending order; then ``--search-steps`` more rates, each the
midpoint of the highest rate that met goodput and the lowest above it that did not (or double the
highest when none failed, half the lowest when none passed). Reported: the highest rate that met
goodput and that bracket. Total time is bounded: each rate takes at most duration + deadline.

Prints one table; writes JSON (``--out``, default bench/results/gpu_arrivals.json) with issue 17's
targets (at 8 and 16 requests/s: ITL p99 <= 25 ms, TTFT p99 <= 300 ms) marked met or not where run.
Run (MLX CUDA build): ``python bench/gpu_arrivals.py``; on CPU ``--quick`` (tiny preset, 2 and 4
requests/s for 4 s each, short prompts, one search step) is a smoke run of under a minute.
"""

from __future__ import annotations

import argparse
import platform
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_mixed import add_checkpoint_args, load_ours, summary  # noqa: E402
from gpu_summary import ARRIVAL_ITL_P99_MS, ARRIVAL_RATES, ARRIVAL_TTFT_P99_MS  # noqa: E402
from gpu_throughput import default_ckpt, save, word_prompts  # noqa: E402
from mlx_serving.models import text_generation  # noqa: E402
from mlx_serving.models.decoder.decode_backends import DECODE_PATHS, decode_backend  # noqa: E402
from mlx_serving.models.decoder.kv_cache import KV_CACHE_DTYPES  # noqa: E402
from mlx_serving.serving import DeadlineExceeded, Serving  # noqa: E402
from mlx_serving.tokenization import Tokenizer  # noqa: E402

__all__ = ["Client", "next_rate", "poisson_arrivals"]

COUNTERS = ("prefix_queries", "prefix_hits", "prefix_query_tokens", "prefix_hit_tokens", "preemptions", "evictions")
SAMPLE_S = 0.05  # backend stats sampling period


@dataclass
class Client:
    """What one streamed client saw (perf_counter seconds)."""

    scheduled: float
    submitted: float = 0.0
    first: float | None = None
    text_times: list[float] = field(default_factory=list)
    tokens: int = 0
    expired: bool = False

    def gaps(self) -> list[float]:
        """Seconds between consecutive text items."""
        t = self.text_times
        return [b - a for a, b in zip(t, t[1:])]

    def good(self, ttft_slo: float, itl_slo: float) -> bool:
        """TTFT <= ``ttft_slo`` and this request's ITL p99 <= ``itl_slo`` (seconds); False if expired."""
        if self.expired or self.first is None or self.first - self.submitted > ttft_slo:
            return False
        gaps = self.gaps()
        return not gaps or float(np.percentile(gaps, 99)) <= itl_slo


def poisson_arrivals(rate: float, duration: float, rng: np.random.Generator) -> list[float]:
    """Arrival offsets (s) of a Poisson process of ``rate`` per second within ``[0, duration)``."""
    gaps = rng.exponential(1.0 / rate, size=int(rate * duration * 2 + 20))
    times = np.cumsum(gaps)
    return times[times < duration].tolist()


def next_rate(results: dict[float, bool]) -> float:
    """The next rate to try given ``{rate: met goodput}``: midpoint of the highest passing and the
    lowest failing rate above it; double the highest if none failed; half the lowest if none passed."""
    passed = [r for r, ok in results.items() if ok]
    lo = max(passed) if passed else None
    failed = [r for r, ok in results.items() if not ok and (lo is None or r > lo)]
    hi = min(failed) if failed else None
    if lo is None:
        return round(hi / 2, 2)
    return round(2 * lo if hi is None else (lo + hi) / 2, 2)


async def one_client(handle: Any, c: Client, text: str, new: int, deadline: float) -> None:
    """Wait for ``c.scheduled``, stream the request and note what arrives when, into ``c``."""
    await anyio.sleep(max(0.0, c.scheduled - time.perf_counter()))
    c.submitted = time.perf_counter()
    try:
        async with await Serving.stream_async(handle, {"text": text, "max_new_tokens": new}, deadline=deadline) as s:
            async for item in s:
                now = time.perf_counter()
                c.first = c.first or now
                if isinstance(item, str):
                    c.text_times.append(now)
                else:
                    c.tokens = item["num_tokens"]
    except DeadlineExceeded:
        c.expired = True


async def sample_backend(handle: Any, peaks: dict[str, float], stop: anyio.Event) -> None:
    """Largest ``blocks_used`` / ``seqs_running`` / ``seqs_waiting`` seen until ``stop``."""
    while not stop.is_set():
        backend = handle.stats().backend
        for key in ("blocks_used", "seqs_running", "seqs_waiting"):
            peaks[key] = max(peaks.get(key, 0), backend.get(key, 0))
        await anyio.sleep(SAMPLE_S)


async def drive(handle: Any, arrivals: list[float], texts: list[str], news: list[int],
                deadline: float) -> tuple[list[Client], dict[str, float]]:
    """Run every client at its arrival offset; return the clients and the sampled backend peaks."""
    start = time.perf_counter() + 0.05
    clients = [Client(start + a) for a in arrivals]
    peaks: dict[str, float] = {}
    stop = anyio.Event()
    async with anyio.create_task_group() as outer:
        outer.start_soon(sample_backend, handle, peaks, stop)
        async with anyio.create_task_group() as tg:
            for c, text, new in zip(clients, texts, news):
                tg.start_soon(one_client, handle, c, text, new, deadline)
        stop.set()
    return clients, peaks


#: Chat-like lengths (``--workload chat``): log-normal medians, sigmas and clips of prompt and new tokens.
CHAT_PROMPT = (200, 0.8, 16, 1024)
CHAT_NEW = (100, 0.6, 16, 512)


def chat_lengths(n: int, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """``n`` (prompt tokens, new tokens) pairs of the chat workload (see the module docstring)."""
    def draw(median: float, sigma: float, lo: int, hi: int) -> list[int]:
        return np.clip(np.round(median * np.exp(sigma * rng.standard_normal(n))), lo, hi).astype(int).tolist()
    return draw(*CHAT_PROMPT), draw(*CHAT_NEW)


def requests(raw: tokenizers.Tokenizer, tok: Tokenizer, n: int, index: int,
             args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """The texts and new-token counts of one rate's ``n`` requests (see the module docstring)."""
    if args.workload == "chat":
        rng = np.random.default_rng(30_000 + args.seed + index)
        lengths, news = chat_lengths(n, rng)
        ids = [word_prompts(raw, 1, p, seed=10**6 * (index + 1) + args.seed * 10**4 + i)[0]  # no shared prefixes
               for i, p in enumerate(lengths)]
    else:
        system = word_prompts(raw, 1, args.system_tokens, seed=10_000 + args.seed + index)[0]
        ids = [system + u for u in word_prompts(raw, n, args.user_tokens, seed=20_000 + args.seed + index)]
        news = [args.new] * n
    texts = [raw.decode(i) for i in ids]
    if texts and tok.encode(texts[0]) != ids[0]:
        raise ValueError("the prompt does not round-trip through the tokenizer")
    return texts, news


def run_rate(handle: Any, raw: tokenizers.Tokenizer, tok: Tokenizer, rate: float, index: int,
             args: argparse.Namespace) -> dict[str, Any]:
    """One rate: its requests, Poisson arrivals, metrics (see the module docstring)."""
    rng = np.random.default_rng(args.seed + 1 + index)
    arrivals = poisson_arrivals(rate, args.duration, rng)
    texts, news = requests(raw, tok, len(arrivals), index, args)
    before = handle.stats().backend
    mx.reset_peak_memory()
    clients, peaks = anyio.run(drive, handle, arrivals, texts, news, args.deadline)
    after = handle.stats().backend
    return metrics(rate, clients, args) | {
        "peak_memory_bytes": mx.get_peak_memory(), "peaks": peaks,
        "cold_shapes": after.get("cold_shapes", 0) - before.get("cold_shapes", 0),
        "prefix": {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}}


def metrics(rate: float, clients: list[Client], args: argparse.Namespace) -> dict[str, Any]:
    """Client-side metrics of one rate (TTFT, ITL, goodput, lag, tok/s)."""
    done = [c for c in clients if c.first is not None]
    good = sum(c.good(args.ttft_slo, args.itl_slo) for c in clients)
    fraction = good / len(clients) if clients else float("nan")
    tokens = sum(c.tokens for c in clients)
    end = max((c.text_times[-1] for c in done if c.text_times), default=float("nan"))
    span = end - clients[0].scheduled if clients else float("nan")
    return {"rate": rate, "requests": len(clients), "expired": sum(c.expired for c in clients),
            "ttft_ms": summary([c.first - c.submitted for c in done]),
            "itl_ms": summary([g for c in done for g in c.gaps()]),
            "goodput": fraction, "meets_goodput": fraction >= args.goodput_target,
            "lag_ms": summary([c.submitted - c.scheduled for c in clients]),
            "tokens": tokens, "text_events": sum(len(c.text_times) for c in clients),
            "tok_s": tokens / span if span > 0 else float("nan")}


def warm_up(handle: Any, raw: tokenizers.Tokenizer, args: argparse.Namespace) -> None:
    """A few concurrent requests with another system part, so kernel builds are not timed."""
    system = word_prompts(raw, 1, args.system_tokens, seed=99_999)[0]
    texts = [raw.decode(system + u) for u in word_prompts(raw, 4, args.user_tokens, seed=99_998)]
    anyio.run(drive, handle, [0.0] * len(texts), texts, [args.new] * len(texts), args.deadline * 4)


def targets(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 17's arrival targets at 8 and 16 requests/s, where run."""
    res: dict[str, Any] = {}
    for r in runs:
        if r["rate"] in ARRIVAL_RATES:
            itl, ttft = r["itl_ms"]["p99"], r["ttft_ms"]["p99"]
            res[f"rate_{r['rate']:g}"] = {"itl_p99_ms": itl, "ttft_p99_ms": ttft,
                                         "met": itl <= ARRIVAL_ITL_P99_MS and ttft <= ARRIVAL_TTFT_P99_MS}
    return res


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_checkpoint_args(ap)
    ap.add_argument("--rates", default="8,16,32", help="requests/s, comma-separated")
    ap.add_argument("--workload", choices=("shared-prefix", "chat"), default="shared-prefix")
    ap.add_argument("--fresh", action="store_true",
                    help="no warm-up drive: the first rate starts the moment Serving.start returns")
    ap.add_argument("--duration", type=float, default=20.0, help="arrival window per rate, seconds")
    ap.add_argument("--system-tokens", type=int, default=1000, help="shared system part, tokens")
    ap.add_argument("--user-tokens", type=int, default=64, help="unique user part, tokens")
    ap.add_argument("--new", type=int, default=128, help="new tokens per request (EOS ignored)")
    ap.add_argument("--max-batch", type=int, default=128)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES), help="what the KV blocks hold")
    ap.add_argument("--decode-path", default=None, choices=DECODE_PATHS, help="default: the library's")
    ap.add_argument("--ttft-slo", type=float, default=1.0, help="goodput: TTFT bound, seconds")
    ap.add_argument("--itl-slo", type=float, default=0.05, help="goodput: per-request ITL p99 bound, seconds")
    ap.add_argument("--goodput-target", type=float, default=0.9, help="fraction of requests meeting both bounds")
    ap.add_argument("--search-steps", type=int, default=2, help="extra rates tried after --rates")
    ap.add_argument("--deadline", type=float, default=30.0, help="per-request deadline, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu_arrivals.json"))
    ap.add_argument("--quick", action="store_true", help="tiny preset, short prompts, 2 rates x 4 s: a CPU smoke run")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.rates, args.duration, args.search_steps = "tiny", "2,4", 4.0, 1
        args.system_tokens, args.user_tokens, args.new, args.max_batch, args.deadline = 128, 16, 8, 8, 15.0
    args.ckpt = args.ckpt or default_ckpt(args.preset)
    return args


def max_len(args: argparse.Namespace) -> int:
    """Positions per sequence the workload needs."""
    if args.workload == "chat":
        return CHAT_PROMPT[3] + CHAT_NEW[3] + 8
    return args.system_tokens + args.user_tokens + args.new + 8


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    raw, tok, state = load_ours(args.ckpt, args.preset, args.weights)
    mx.eval(state.embed_tokens.weight)
    loaded = time.perf_counter()
    new = CHAT_NEW[3] if args.workload == "chat" else args.new
    gen = text_generation.serving(tok, state, max_new_tokens=new, max_batch=args.max_batch, max_len=max_len(args),
                                  prefill_chunk=args.prefill_chunk, prefix_caching=not args.no_prefix_caching,
                                  kv_cache_dtype=args.kv_cache_dtype, decode_path=args.decode_path)
    out: dict[str, Any] = {"device": str(mx.default_device()), "mlx": mx.__version__, "host": platform.node(),
                           "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "command": " ".join(["python", "bench/gpu_arrivals.py", *sys.argv[1:]]), "runs": [],
                           "decode_path": decode_backend(state, args.decode_path, args.kv_cache_dtype).name}
    with Serving.start(gen, batch_timeout=0.002) as handle:
        out["load_s"], out["start_s"] = loaded - t0, time.perf_counter() - loaded
        out["cold_shapes_at_start"] = handle.stats().backend.get("cold_shapes", 0)
        print(f"load {out['load_s']:.2f} s, Serving.start {out['start_s']:.2f} s", flush=True)
        if not args.fresh:
            warm_up(handle, raw, args)
        plan = sorted(float(r) for r in args.rates.split(","))
        print(HEADER)
        for i in range(len(plan) + args.search_steps):
            rate = plan[i] if i < len(plan) else next_rate({r["rate"]: r["meets_goodput"] for r in out["runs"]})
            out["runs"].append(run_rate(handle, raw, tok, rate, i, args))
            print_row(out["runs"][-1])
            save(args.out, conclude(out))
    print(f"highest rate meeting goodput (>= {args.goodput_target:.0%} of requests with TTFT <= {args.ttft_slo:g} s "
          f"and ITL p99 <= {args.itl_slo * 1e3:g} ms): {out['max_goodput_rate']} requests/s; bracket {out['bracket']}")
    for name, t in out["targets"].items():
        print(f"target {name}: ITL p99 {t['itl_p99_ms']:.1f} ms (<= {ARRIVAL_ITL_P99_MS:g}), TTFT p99 "
              f"{t['ttft_p99_ms']:.0f} ms (<= {ARRIVAL_TTFT_P99_MS:g}) -> {'met' if t['met'] else 'NOT met'}")


def conclude(out: dict[str, Any]) -> dict[str, Any]:
    """Add the highest rate that met goodput, its bracket, the targets and the process's peak RSS
    (MB) to ``out`` from the runs so far; returns ``out``."""
    outcome = {r["rate"]: r["meets_goodput"] for r in out["runs"]}
    best = max((r for r, ok in outcome.items() if ok), default=None)
    above = min((r for r, ok in outcome.items() if not ok and (best is None or r > best)), default=None)
    out.update(max_goodput_rate=best, bracket=[best, above], targets=targets(out["runs"]),
               peak_rss_mb_process=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return out


HEADER = (f"{'req/s':>7}{'reqs':>6}{'TTFT p50':>10}{'p99 ms':>9}{'ITL p50':>9}{'p99 ms':>9}{'goodput':>9}"
          f"{'tok/s':>8}{'peak GB':>9}{'hit tok':>9}{'of':>9}{'lag p99':>9}{'cold':>6}")


def print_row(r: dict[str, Any]) -> None:
    """One table line per rate (under ``HEADER``)."""
    p = r["prefix"]
    print(f"{r['rate']:>7g}{r['requests']:>6}{r['ttft_ms']['p50']:>10.0f}{r['ttft_ms']['p99']:>9.0f}"
          f"{r['itl_ms']['p50']:>9.1f}{r['itl_ms']['p99']:>9.1f}{r['goodput']:>9.2f}{r['tok_s']:>8.0f}"
          f"{r['peak_memory_bytes'] / 1e9:>9.2f}{p['prefix_hit_tokens']:>9}{p['prefix_query_tokens']:>9}"
          f"{r['lag_ms']['p99']:>9.1f}{r.get('cold_shapes', 0):>6}")


if __name__ == "__main__":
    main()
