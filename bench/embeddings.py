"""Text-embedding throughput: the serving with and without length buckets vs sentence-transformers.

One seeded random checkpoint in Qwen3-Embedding's layout (``write_embedding_checkpoint``: Qwen3-0.6B's
width, ``--layers`` layers, MLX 4-bit weights, last-token pooling, L2-normalized) and a float32 copy of
it (every matrix dequantized: the same weights, the values the 4-bit kernels multiply by) are embedded by:

- ``4-bit, buckets``: a started ``text_embedding`` serving (default buckets 16, 32, ..., ``--max-len``),
  every text its own request from ``--clients`` threads: the static batcher groups the requests by bucket;
- ``4-bit, no buckets``: the same with one bucket (``buckets=(max_len,)``): every request padded to
  ``--max-len``;
- ``float32, buckets`` (``--float32`` only): the serving on the float32 copy (slow on a CPU: MLX's dense
  float32 matmul runs at ~2 GFLOP/s on this machine's build, its 4-bit one in the native kernels);
- ``sentence-transformers``: ``SentenceTransformer(copy).encode(texts, batch_size=--batch)`` on the float32
  copy (torch on the CPU, its own length-sorted batching), run by ``--st-python`` (a venv with torch and
  sentence-transformers; skipped, saying so, when it cannot run).

Texts: ``--texts`` of mixed lengths (4 to ``--max-words`` words, log-uniform, seed 0). Each path runs
once to warm up (compiling every shape) and then ``--rounds`` timed rounds; the table shows the best
round: texts/s and real tokens/s (padding not counted), and the largest difference of a vector
from sentence-transformers'.

Run: ``.venv/bin/python bench/embeddings.py [--st-python /tmp/stvenv/bin/python]`` (writes
bench/results/embeddings.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# bench/ holds scripts named like the packages (bench/tokenization.py): keep it off sys.path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

_WORDS = ("the of and to in is was for on that with as by at from his her an which are be this had not "
          "but they have one were all their there been has when who will more no if out so said what "
          "up its about into than them can only other new some could time these two may then do first "
          "any my now such like our over man me even most made after also did many before must through "
          "river mountain language library garden window engine protocol silver harbour").split()


def texts(n: int, max_words: int, seed: int = 0) -> list[str]:
    """``n`` texts of 4 to ``max_words`` words (log-uniform), reproducible."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = int(math.exp(rng.uniform(math.log(4), math.log(max_words))))
        out.append(" ".join(rng.choice(_WORDS) for _ in range(k)))
    return out


def _ours(ckpt: Path, items: list[str], args: argparse.Namespace, buckets: tuple[int, ...] | None) -> dict:
    from mlx_serving import Serving, text_embedding

    serving = text_embedding.from_mlx4bit(ckpt, max_len=args.max_len, batch_size=args.batch, buckets=buckets,
                                          batch_timeout=0.005)
    with Serving.start(serving, max_queue=len(items)) as handle:
        vectors: dict[int, object] = {}
        times = [_round(handle, items, args.clients, vectors) for _ in range(args.rounds + 1)][1:]
        stats = handle.stats()
    serving.close()
    tokens = sum(r["num_tokens"] for r in vectors.values())
    best = min(times)
    return {"seconds": best, "texts_per_s": len(items) / best, "tokens_per_s": tokens / best, "tokens": tokens,
            "batches": stats.batches_run, "mean_batch_fill": stats.mean_batch_fill,
            "vectors": [vectors[i]["embedding"] for i in range(len(items))]}


def _round(handle: object, items: list[str], clients: int, out: dict[int, object]) -> float:
    """Wall seconds for every text as its own request from ``clients`` threads."""
    work: queue.Queue[int] = queue.Queue()
    for i in range(len(items)):
        work.put(i)

    def client() -> None:
        while True:
            try:
                i = work.get_nowait()
            except queue.Empty:
                return
            out[i] = handle.run(items[i])

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def st_worker(ckpt: str, texts_file: str, out_file: str, batch: int, rounds: int, max_len: int) -> None:
    """Run inside the sentence-transformers venv: encode, time, save the vectors (.npy) and times."""
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(os.cpu_count() or 1)
    model = SentenceTransformer(ckpt, device="cpu", model_kwargs={"torch_dtype": torch.float32})
    model.max_seq_length = max_len
    items = json.loads(Path(texts_file).read_text())
    times = []
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        vectors = model.encode(items, batch_size=batch, convert_to_numpy=True)
        times.append(time.perf_counter() - t0)
    np.save(out_file + ".npy", vectors.astype(np.float32))
    Path(out_file).write_text(json.dumps({"times": times[1:], "torch": torch.__version__,
                                          "threads": torch.get_num_threads()}))


def _peer(st_python: str, ckpt: Path, items: list[str], args: argparse.Namespace, tmp: Path) -> dict | str:
    """sentence-transformers' result, or why it could not run."""
    import numpy as np

    if not Path(st_python).exists():
        return f"skipped: {st_python} not found (a venv with torch and sentence-transformers)"
    (tmp / "texts.json").write_text(json.dumps(items))
    out = tmp / "st.json"
    command = [st_python, __file__, "--st-worker", str(ckpt), str(tmp / "texts.json"), str(out),
               "--batch", str(args.batch), "--rounds", str(args.rounds), "--max-len", str(args.max_len)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return f"skipped: sentence-transformers failed: {done.stderr.strip().splitlines()[-1:]}"
    result = json.loads(out.read_text())
    best = min(result["times"])
    return {"seconds": best, "texts_per_s": len(items) / best, "torch": result["torch"],
            "threads": result["threads"], "vectors": np.load(str(out) + ".npy")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--texts", type=int, default=128)
    ap.add_argument("--max-words", type=int, default=180)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--float32", action="store_true",
                    help="also run the serving on the float32 copy (slow on a CPU: MLX's dense float32 matmul)")
    ap.add_argument("--st-python", default="/tmp/stvenv/bin/python")
    ap.add_argument("--st-worker", nargs=3, metavar=("CKPT", "TEXTS", "OUT"))
    args = ap.parse_args()
    if args.st_worker:
        st_worker(*args.st_worker, batch=args.batch, rounds=args.rounds, max_len=args.max_len)
        return
    run(args)


def run(args: argparse.Namespace) -> None:
    from mlx_serving.models.text_embedding import write_embedding_checkpoint

    items = texts(args.texts, args.max_words)
    overrides = {"num_hidden_layers": args.layers, "max_window_layers": args.layers}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        q4 = write_embedding_checkpoint(tmp / "q4", "0.6b", config_overrides=overrides)
        dense = dequantized_copy(q4, tmp / "dense")  # the same weights in float32: what the peer reads
        rows = {"4-bit, buckets": _ours(q4, items, args, None),
                "4-bit, no buckets": _ours(q4, items, args, (args.max_len,))}
        if args.float32:
            rows["float32, buckets"] = _ours(dense, items, args, None)
        peer = _peer(args.st_python, dense, items, args, tmp)
    if isinstance(peer, dict):
        rows["sentence-transformers"] = {**peer, "tokens_per_s": rows["4-bit, buckets"]["tokens"] / peer["seconds"]}
    _report(rows, peer, args)


def dequantized_copy(src: Path, out: Path) -> Path:
    """A copy of MLX 4-bit checkpoint ``src`` with every quantized matrix dequantized to float32
    (``mx.dequantize``: the values the 4-bit kernels multiply by) and no quantization block."""
    import shutil

    import mlx.core as mx

    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    q = config.pop("quantization")
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = mx.load(str(out / "model.safetensors"))
    dense = {}
    for name, w in weights.items():
        if name.endswith((".scales", ".biases")) and name.rsplit(".", 1)[0] + ".weight" in weights:
            continue
        base = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and base + ".scales" in weights:
            w = mx.dequantize(w, weights[base + ".scales"], weights[base + ".biases"], group_size=q["group_size"],
                              bits=q["bits"])
        dense[name] = w.astype(mx.float32)
    mx.save_safetensors(str(out / "model.safetensors"), dense, metadata={"format": "mlx"})
    return out


def _report(rows: dict[str, dict], peer: dict | str, args: argparse.Namespace) -> None:
    import numpy as np

    reference = peer["vectors"] if isinstance(peer, dict) else None
    print(f"{args.texts} texts, 4-{args.max_words} words, {rows['4-bit, buckets']['tokens']} tokens; Qwen3-0.6B width, "
          f"{args.layers} layers; max_len {args.max_len}, batch {args.batch}, {args.clients} clients; "
          f"{os.cpu_count()} CPU cores")
    print(f"{'path':24} {'texts/s':>9} {'tokens/s':>10} {'vs ST':>7} {'max |diff| vs ST':>17}")
    summary = {}
    for name, r in rows.items():
        diff = (float(np.abs(np.stack(r["vectors"]) - reference).max())
                if reference is not None and name != "sentence-transformers" else None)
        ratio = r["texts_per_s"] / peer["texts_per_s"] if isinstance(peer, dict) else None
        print(f"{name:24} {r['texts_per_s']:9.1f} {r['tokens_per_s']:10.0f} "
              f"{'' if ratio is None else f'{ratio:6.2f}x':>7} {'' if diff is None else f'{diff:.1e}':>17}")
        summary[name] = {k: v for k, v in r.items() if k != "vectors"} | {"max_diff_vs_st": diff}
    if not isinstance(peer, dict):
        print(f"sentence-transformers: {peer}")
    out = Path(__file__).resolve().parent / "results" / "embeddings.json"
    out.write_text(json.dumps({"args": vars(args), "rows": summary, "peer": peer if isinstance(peer, str) else None},
                              indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
