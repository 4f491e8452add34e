"""Qwen3 generation on this machine: ours (models.generation) vs mlx-lm, in the same run.

(a) Single stream, 0.6B-shaped seeded 4-bit checkpoint (mlx-community layout), greedy,
    a ``--prompt``-token prompt and ``--new`` new tokens: prefill tok/s (prompt tokens /
    time to first token) and decode ms/token (mean gap between later tokens) for
    ``models.generation.generate`` and for mlx-lm's ``generate_step`` on the same checkpoint.
    mlx-lm runs twice: as it loads the checkpoint (bfloat16 compute) and with its
    floating parameters cast to float32 (our CPU default compute dtype), so the ratio
    is also given at equal precision. Target (issue 4): ours / mlx-lm >= 1.0.
(b) Batch, tiny seeded 4-bit checkpoint: 16 prompts of 8..40 tokens, ``--batch-new`` new
    tokens each, greedy, EOS ignored: one batched ``generate`` call vs 16 sequential
    calls (and mlx-lm's ``generate_step`` run 16 times sequentially, bf16 as loaded and
    float32, as the peer).
    Aggregate tok/s = new tokens / wall time. Target: batched / sequential >= 4x.
    Ours (batched, sequential) and mlx-lm float32 alternate; best of ``--rounds``.

Run: ``.venv/bin/python bench/generate.py`` (writes bench/results/generate.json;
checkpoints are made once under --ckpt-dir).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

# bench/ holds scripts named like the packages (bench/tokenization.py): keep it off sys.path
sys.path[:] = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlx_serving.models.generation import generate  # noqa: E402
from mlx_serving.models.loader import load  # noqa: E402
from mlx_serving.models.seeded_checkpoint import write_checkpoint  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "generate.json"


def _checkpoint(root: Path, preset: str) -> Path:
    path = root / f"qwen3-{preset}-seed0-4bit"
    if not (path / "config.json").is_file():
        write_checkpoint(path, preset, seed=0)
    return path


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 151000, n)]


def _mlx_lm(path: Path, dtype: mx.Dtype | None):
    from mlx_lm.utils import load_model

    model = load_model(path)[0]
    if dtype is not None:
        model.set_dtype(dtype)
    return model


def _peer_stream(model, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    """mlx-lm generate_step: (tokens, time to first token ms, mean decode ms/token)."""
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    stamps, toks = [], []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        stamps.append(time.perf_counter())
        toks.append(int(tok))
    return toks, (stamps[0] - t0) * 1e3, (stamps[-1] - stamps[0]) * 1e3 / max(1, len(stamps) - 1)


def _ours_stream(state, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    ids, info = generate(prompt, state, max_new_tokens=n, eos_token_ids=[])
    t = info["timing"]
    return ids, t["prefill_ms"], float(np.mean(t["per_token_ms"]))


def single_stream(path: Path, prompt_len: int, new: int, rounds: int) -> list[dict[str, Any]]:
    """Ours and mlx-lm float32 alternate for ``rounds`` rounds (best of each kept, so
    background load hits both alike); mlx-lm bf16 (10x slower here) runs once."""
    prompt = _prompt(prompt_len)
    state = load(path)
    peer32 = _mlx_lm(path, mx.float32)
    _ours_stream(state, prompt[:4], 2)  # warm-up
    _peer_stream(peer32, prompt[:4], 2)
    best: dict[str, tuple[list[int], float, float]] = {}
    for _ in range(rounds):
        for name, fn, obj in (("ours", _ours_stream, state), ("peer32", _peer_stream, peer32)):
            toks, ttft, per = fn(obj, prompt, new)
            old = best.get(name)
            best[name] = (toks, min(ttft, old[1]) if old else ttft, min(per, old[2]) if old else per)
    del state, peer32
    bf16 = _mlx_lm(path, None)
    _peer_stream(bf16, prompt[:4], 2)
    best["peer16"] = _peer_stream(bf16, prompt, new)
    names = {"ours": ("ours (models.generation.generate)", "float32 (CPU default)"),
             "peer16": ("mlx-lm generate_step", "bfloat16 (as loaded)"),
             "peer32": ("mlx-lm generate_step", "float32 (params cast)")}
    return [dict(impl=names[k][0], dtype=names[k][1], tokens=best[k][0], ttft_ms=best[k][1],
                 decode_ms_per_token=best[k][2], prefill_tok_s=prompt_len / (best[k][1] / 1e3))
            for k in ("ours", "peer16", "peer32")]


def batch(path: Path, new: int, rounds: int, n_prompts: int = 16) -> list[dict[str, Any]]:
    """Ours batched, ours sequential and mlx-lm float32 sequential alternate for ``rounds``
    rounds (best of each kept); mlx-lm bf16 (several times slower here) runs once."""
    rng = np.random.default_rng(1)
    prompts = [_prompt(int(n), seed=i) for i, n in enumerate(rng.integers(8, 41, n_prompts))]
    state = load(path)
    peer32 = _mlx_lm(path, mx.float32)
    generate(prompts[:2], state, max_new_tokens=2, eos_token_ids=[])  # warm-up
    _peer_stream(peer32, prompts[0][:4], 2)

    batched, _ = generate(prompts, state, max_new_tokens=new, eos_token_ids=[])
    seq = [generate(p, state, max_new_tokens=new, eos_token_ids=[])[0] for p in prompts]
    assert batched == seq, "batched rows differ from sequential runs"
    runs = {
        f"ours, one batched generate ({n_prompts} prompts)":
            lambda: generate(prompts, state, max_new_tokens=new, eos_token_ids=[]),
        f"ours, {n_prompts} sequential generate calls":
            lambda: [generate(p, state, max_new_tokens=new, eos_token_ids=[]) for p in prompts],
        f"mlx-lm generate_step x{n_prompts} (float32)": lambda: [_peer_stream(peer32, p, new) for p in prompts],
    }
    best = {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    bf16 = _mlx_lm(path, None)
    t0 = time.perf_counter()
    for p in prompts:
        _peer_stream(bf16, p, new)
    best[f"mlx-lm generate_step x{n_prompts} (bf16 as loaded)"] = time.perf_counter() - t0
    total = new * n_prompts
    return [dict(impl=name, seconds=sec, tok_s=total / sec) for name, sec in best.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt-dir", type=Path, default=Path.home() / ".cache" / "mlx-serving" / "bench")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens, single stream")
    ap.add_argument("--new", type=int, default=6, help="new tokens, single stream")
    ap.add_argument("--batch-new", type=int, default=32, help="new tokens per prompt, batch part")
    ap.add_argument("--rounds", type=int, default=2, help="single stream: best of N rounds (ours, mlx-lm f32)")
    args = ap.parse_args()
    stream = single_stream(_checkpoint(args.ckpt_dir, "0.6b"), args.prompt, args.new, args.rounds)
    ours = stream[0]
    print(f"(a) single stream, 0.6B-shaped 4-bit, prompt {args.prompt}, {args.new} new tokens, greedy")
    print(f"{'impl':30} {'compute':22} {'prefill tok/s':>13} {'decode ms/tok':>13} {'ours/peer decode':>16} {'ours/peer prefill':>17}")
    for r in stream:
        dec = r["decode_ms_per_token"] / ours["decode_ms_per_token"]
        pre = ours["prefill_tok_s"] / r["prefill_tok_s"]
        r["ours_over_peer_decode"], r["ours_over_peer_prefill"] = dec, pre
        print(f"{r['impl']:30} {r['dtype']:22} {r['prefill_tok_s']:13.2f} {r['decode_ms_per_token']:13.1f} "
              f"{dec:16.2f} {pre:17.2f}")
    same = [r["tokens"] == ours["tokens"] for r in stream[1:]]
    print(f"greedy ids equal to ours: {same}")
    rows = batch(_checkpoint(args.ckpt_dir, "tiny"), args.batch_new, args.rounds)
    print(f"\n(b) batch, tiny 4-bit, 16 prompts of 8..40 tokens, {args.batch_new} new tokens each")
    print(f"{'impl':48} {'seconds':>8} {'tok/s':>8} {'vs ours sequential':>18}")
    for r in rows:
        r["vs_ours_sequential"] = r["tok_s"] / rows[1]["tok_s"]
        print(f"{r['impl']:48} {r['seconds']:8.2f} {r['tok_s']:8.1f} {r['vs_ours_sequential']:18.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "machine": platform.platform(), "mlx": mx.__version__, "args": {k: str(v) for k, v in vars(args).items()},
        "single_stream": [{k: v for k, v in r.items() if k != "tokens"} | {"greedy_ids_equal_ours": r["tokens"] == ours["tokens"]}
                          for r in stream],
        "batch": rows,
    }, indent=2))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
