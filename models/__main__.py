"""The ``mlx-serving`` command (also ``python -m mlx_serving``).

``mlx-serving generate "prompt" [--model DIR] [--max-new-tokens N] [--sampler S] [--chat] ...``
runs one generation through a Serving and prints the text and a timing line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..serving import Serving

from . import text_generation
from ._default_checkpoint import default_checkpoint
from .qwen3.sampling import SAMPLERS

__all__ = ["main"]

_RANDOM_NOTE = ("note: no --model given, so this uses the embedded default checkpoint: a seeded RANDOM "
                "Qwen3-0.6B-shaped MLX 4-bit checkpoint. Its text is meaningless; pass --model DIR "
                "(a real Qwen3 MLX 4-bit checkpoint directory) for real text.")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mlx-serving", description="Qwen3 (MLX) text generation through a Serving.")
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", type=Path, help="MLX checkpoint directory (default: the embedded random one)")
    gen.add_argument("--max-new-tokens", type=int, default=100)
    gen.add_argument("--max-len", type=int, default=2048, help="KV-cache positions (prompt + new tokens)")
    gen.add_argument("--sampler", choices=SAMPLERS, default="greedy")
    gen.add_argument("--temperature", type=float, default=0.95)
    gen.add_argument("--top-p", type=float, default=0.9)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="apply the chat template to the prompt")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    return ap


def _generate(args: argparse.Namespace) -> int:
    model = args.model
    if model is None:
        print(_RANDOM_NOTE, file=sys.stderr)
        model = default_checkpoint()
    serving = text_generation.from_mlx4bit(
        model, max_new_tokens=args.max_new_tokens, max_len=args.max_len, sampler=args.sampler,
        temperature=args.temperature, top_p=args.top_p, chat=args.chat, stop=args.stop, max_batch=1)
    request: dict[str, Any] = {"text": args.prompt}
    if args.seed is not None:
        request["seed"] = args.seed
    result = Serving.run(serving, request)["results"][0]
    print(result["generated_text"])
    print(_timing_line(result), file=sys.stderr)
    return 0


def _timing_line(result: dict[str, Any]) -> str:
    t = result.get("timing", {})
    n, decode_ms = result["num_tokens"], t.get("decode_ms", 0.0)
    tok_s = (n - 1) / decode_ms * 1e3 if n > 1 and decode_ms > 0 else float("nan")
    return (f"[prompt {result['token_summary']['input']} tokens | prefill {t.get('prefill_ms', float('nan')):.1f} ms"
            f" | {n} new tokens | decode {tok_s:.2f} tok/s | finish_reason {result['finish_reason']}]")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mlx-serving`` console script. Returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return _generate(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"mlx-serving: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
