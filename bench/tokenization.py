"""Tokenization benchmark: encode throughput (single vs batch) and streaming detokenizer cost.

Run:  .venv/bin/python bench/tokenization.py [--quick]

Encode: tokens/s of ``Tokenizer.encode`` in a loop vs ``Tokenizer.encode_batch`` over the same
corpus; peers in the same run: the raw ``tokenizers`` library (same calls, no wrapper) and
transformers' Qwen2 tokenizer loaded offline from the shipped files.

Streaming: microseconds per ``add()`` over a whole stream of 10 and of 4,000 generated ids (a
mixed English/CJK/emoji/code text, so multi-byte characters split across tokens, encoded and
repeated), best of several streams; and for 4,000, the median per-call cost over the first and
over the last repetition (the same ids: a flat cost gives head == tail; these per-call timings
include one ``perf_counter`` call each). Peers: mlx-lm's
``BPEStreamingDetokenizer`` and ``NaiveStreamingDetokenizer`` (``add_token`` + ``last_segment``)
and the naive "decode everything again and diff" loop.

Prints a table and writes bench/results/tokenization.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

# This file is named like the package it measures: drop its own folder from the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import tokenizers  # noqa: E402

from mlx_serving.tokenization import StreamingDetokenizer, Tokenizer, data_path  # noqa: E402

Key = TypeVar("Key")
RESULTS = Path(__file__).resolve().parent / "results" / "tokenization.json"
PARAGRAPHS = [
    "Serving large language models efficiently requires batching requests, managing the KV cache, "
    "and streaming tokens back to clients as soon as they are decoded. ",
    "大型语言模型的推理服务需要批处理请求、管理键值缓存，并在解码后立即将结果流式返回给客户端。",
    "Emoji stress: 👩🏽‍🚀🚀 👨‍👩‍👧‍👦 🇯🇵 ✨ — and combining marks: é ñ ü. ",
    "def prefill(ids: list[int]) -> None:\n    for chunk in split(ids, 512):\n        model(chunk)\n",
    "Les modèles génèrent du texte jeton par jeton; chaque étape de décodage ajoute un jeton. ",
]


def _corpus(n_texts: int) -> list[str]:
    """``n_texts`` texts of about 600 tokens, each a different rotation of the paragraphs."""
    return ["".join(PARAGRAPHS[(i + k) % len(PARAGRAPHS)] for k in range(12)) + f" #{i}" for i in range(n_texts)]


def _best_times(repeats: int, cases: dict[Key, Callable[[], object]]) -> dict[Key, float]:
    """Best wall time in seconds per case; the cases take turns in each round, so a change in
    load on the shared cores hits every case alike."""
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _hf_tokenizer(tmp: Path):
    from transformers import AutoTokenizer

    (tmp / "tokenizer.json").write_bytes(gzip.decompress(data_path("tokenizer.json.gz").read_bytes()))
    shutil.copy(data_path("tokenizer_config.json"), tmp / "tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(tmp), local_files_only=True)


def bench_encode(tok: Tokenizer, hf, texts: list[str], repeats: int) -> list[dict]:
    raw = tokenizers.Tokenizer.from_str(
        gzip.decompress(data_path("tokenizer.json.gz").read_bytes()).decode()
    )
    raw.encode_special_tokens = True
    n_tokens = sum(map(len, tok.encode_batch(texts)))
    cases = {
        ("ours", "single"): lambda: [tok.encode(t) for t in texts],
        ("ours", "batch"): lambda: tok.encode_batch(texts),
        ("tokenizers", "single"): lambda: [raw.encode(t, add_special_tokens=False).ids for t in texts],
        ("tokenizers", "batch"): lambda: [e.ids for e in raw.encode_batch_fast(texts, add_special_tokens=False)],
        ("transformers", "single"): lambda: [hf.encode(t, add_special_tokens=False) for t in texts],
        ("transformers", "batch"): lambda: hf(texts, add_special_tokens=False)["input_ids"],
    }
    rows = []
    for (impl, mode), seconds in _best_times(repeats, cases).items():
        rows.append({"impl": impl, "mode": mode, "texts": len(texts), "tokens": n_tokens,
                     "seconds": seconds, "tokens_per_s": n_tokens / seconds})
    return rows


Feed = Callable[[int], str]


def _ours(tok: Tokenizer) -> Callable[[], Feed]:
    return lambda: StreamingDetokenizer(tok).add


def _mlx_lm(make) -> Callable[[], Feed]:
    def start() -> Feed:
        detok = make()
        detok.reset()

        def feed(token: int) -> str:
            detok.add_token(token)
            return detok.last_segment

        return feed

    return start


def _redecode(tok: Tokenizer) -> Callable[[], Feed]:
    def start() -> Feed:
        seen: list[int] = []
        emitted = 0

        def feed(token: int) -> str:
            nonlocal emitted
            seen.append(token)
            text = tok.decode(seen)
            stable = len(text.rstrip("\ufffd"))
            piece, emitted = text[emitted:stable], max(emitted, stable)
            return piece

        return feed

    return start


def _stream_seconds(start: Callable[[], Feed], ids: Sequence[int]) -> float:
    feed = start()
    begin = time.perf_counter()
    for token in ids:
        feed(token)
    return time.perf_counter() - begin


def _per_call_seconds(start: Callable[[], Feed], ids: Sequence[int]) -> list[float]:
    feed, costs = start(), []
    for token in ids:
        begin = time.perf_counter()
        feed(token)
        costs.append(time.perf_counter() - begin)
    return costs


def bench_stream(tok: Tokenizer, hf, lengths: Sequence[int], repeats: int) -> list[dict]:
    """Per-token cost at each length: the best of several whole streams, divided by the length.
    The ids repeat one block (the paragraphs, encoded), so at the longest length the first and the
    last whole block hold the same ids; ``head``/``tail`` are the median per-call cost over those
    blocks (median: robust to scheduler spikes on shared cores), the same work early and late."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, NaiveStreamingDetokenizer

    block = tok.encode("".join(PARAGRAPHS))
    longest = max(lengths)
    ids = (block * (longest // len(block) + 1))[:longest]
    last_block = (longest // len(block) - 1) * len(block)
    bpe = BPEStreamingDetokenizer(hf)  # its token map is built once, like our byte table
    tok.byte_table()
    impls = {
        "ours": _ours(tok),
        "mlx-lm BPEStreaming": _mlx_lm(lambda: bpe),
        "mlx-lm NaiveStreaming": _mlx_lm(lambda: NaiveStreamingDetokenizer(hf)),
        "re-decode all": _redecode(tok),
    }
    rows = []
    for impl, start in impls.items():
        for n in lengths:
            reps = max(repeats, 4000 // n)  # short sequences: more repetitions
            seconds = min(_stream_seconds(start, ids[:n]) for _ in range(reps))
            row = {"impl": impl, "generated_tokens": n, "us_per_token": 1e6 * seconds / n}
            if n == longest:
                costs = _per_call_seconds(start, ids)
                row["block_tokens"] = len(block)
                row["us_head_block_median"] = 1e6 * statistics.median(costs[: len(block)])
                row["us_tail_block_median"] = 1e6 * statistics.median(costs[last_block : last_block + len(block)])
            rows.append(row)
    return rows


def _print_table(title: str, rows: list[dict], keys: Sequence[str]) -> None:
    print(f"\n{title}")
    print(" | ".join(keys))
    for r in rows:
        cells = (r.get(k, "") for k in keys)
        print(" | ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small corpus, one repeat (smoke run)")
    args = parser.parse_args()
    n_texts, repeats = (16, 1) if args.quick else (256, 5)
    tok = Tokenizer.qwen3()
    with tempfile.TemporaryDirectory() as tmp:
        hf = _hf_tokenizer(Path(tmp))
    encode_rows = bench_encode(tok, hf, _corpus(n_texts), repeats)
    stream_rows = bench_stream(tok, hf, (10, 4000), repeats)
    _print_table("encode throughput", encode_rows, ["impl", "mode", "texts", "tokens", "tokens_per_s"])
    _print_table("streaming detokenizer", stream_rows,
                 ["impl", "generated_tokens", "us_per_token", "us_head_block_median",
                  "us_tail_block_median"])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "tokenizers": tokenizers.__version__},
        "quick": args.quick, "encode": encode_rows, "stream": stream_rows}, indent=2))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
