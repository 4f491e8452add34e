"""Where the Serving's time goes on the GPU: the same Engine driven bare vs through the Serving.

0.6B-shaped seeded 4-bit checkpoint, 128-token prompts, ``--new`` tokens, greedy, EOS ignored.
One stream: bare Engine loop on the main thread, the same loop on another thread (thread-local
MLX stream), ``Serving.stream``, ``Serving.batched_run``; and the same with the interpreter's
GIL switch interval lowered to 0.1 ms. Concurrency ``--n``: bare Engine vs ``batched_run_async``.
Prints a table and writes JSON. Run: ``python bench/gpu_serving_overhead.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from gpu_throughput import serving_concurrent, word_prompts  # noqa: E402

from mlx_serving.models import text_generation  # noqa: E402
from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams  # noqa: E402
from mlx_serving.models.loader import load  # noqa: E402
from mlx_serving.models.seeded_checkpoint import write_checkpoint  # noqa: E402
from mlx_serving.serving import Serving  # noqa: E402
from mlx_serving.tokenization import Tokenizer  # noqa: E402


def engine_run(state: Any, prompts: list[list[int]], new: int) -> float:
    """Aggregate tok/s of a bare Engine loop over ``prompts`` (all added at once)."""
    eng = Engine(state, EngineConfig.of(max_batch=len(prompts), max_len=len(prompts[0]) + new + 8))
    for i, p in enumerate(prompts):
        eng.add(i, p, SamplingParams(max_new_tokens=new, eos_token_ids=()))
    t0, n = time.perf_counter(), 0
    while eng.num_active:
        n += len(eng.step())
    return n / (time.perf_counter() - t0)


def in_thread(fn: Any, *args: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join()
    return out[0]


def stream_tok_s(handle: Any, text: str) -> float:
    t0 = time.perf_counter()
    n = sum(isinstance(it, str) for it in Serving.stream(handle, text))
    return n / (time.perf_counter() - t0)


def run_tok_s(handle: Any, text: str) -> float:
    t0 = time.perf_counter()
    n = Serving.batched_run(handle, text)["results"][0]["num_tokens"]
    return n / (time.perf_counter() - t0)


def twice(fn: Any, *args: Any) -> float:
    fn(*args)
    return fn(*args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/qwen3-0.6b-bench"))
    ap.add_argument("--preset", default="0.6b")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu_serving_overhead.json"))
    args = ap.parse_args()
    if not (args.ckpt / "config.json").is_file():
        write_checkpoint(args.ckpt, args.preset, seed=0)
    raw = tokenizers.Tokenizer.from_file(str(args.ckpt / "tokenizer.json"))
    tok, state = Tokenizer(raw, eos_token_ids=()), load(args.ckpt)
    prompts = word_prompts(raw, args.n, 128, seed=0)
    texts = [raw.decode(p) for p in prompts]
    res: dict[str, float] = {}
    res["engine_main_thread"] = twice(engine_run, state, prompts[:1], args.new)
    res["engine_other_thread"] = twice(in_thread, engine_run, state, prompts[:1], args.new)
    gen = text_generation.serving(tok, state, max_new_tokens=args.new, max_len=128 + args.new + 8,
                                  max_batch=args.n)
    for interval in (sys.getswitchinterval(), 1e-4):
        sys.setswitchinterval(interval)
        tag = f"switch_{interval * 1e3:g}ms"
        with Serving.start(gen, batch_size=1, batch_timeout=0.0) as h:
            res[f"serving_stream_{tag}"] = twice(stream_tok_s, h, texts[0])
            res[f"serving_batched_run_{tag}"] = twice(run_tok_s, h, texts[0])
        with Serving.start(gen, batch_size=args.n, batch_timeout=0.002) as h:
            anyio.run(serving_concurrent, h, texts)
            res[f"serving_async_n{args.n}_{tag}"] = anyio.run(serving_concurrent, h, texts)["tok_s"]
    sys.setswitchinterval(0.005)
    res[f"engine_n{args.n}"] = twice(engine_run, state, prompts, args.new)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    for k, v in res.items():
        print(f"{k:<40}{v:>10.1f} tok/s")


if __name__ == "__main__":
    main()
