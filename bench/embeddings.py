"""Text-embedding throughput: the serving's products and length buckets vs sentence-transformers.

One seeded random checkpoint in Qwen3-Embedding's layout (``write_embedding_checkpoint``: Qwen3-0.6B's
width, ``--layers`` layers, MLX 4-bit weights, last-token pooling, L2-normalized) and a float32 copy of
it (every matrix dequantized: the same weights, the values the 4-bit kernels multiply by) are embedded by:

- ``native, buckets``: a started ``text_embedding`` serving with its default products (on the CPU "native":
  a batch's texts packed into one sequence, the int8 GEMM of the text-generation prefill), default buckets
  16, 32, ..., ``--max-len``, every text its own request from ``--clients`` threads: the static batcher
  groups the requests by bucket;
- ``native, one bucket``: the same with one bucket (``buckets=(max_len,)``): every length in one queue (the
  packed forward computes no padding, so fewer, fuller batches);
- ``matmul, buckets`` (``--matmul`` only): ``products="matmul"``, the exact float forward over padded rows
  (slow on a CPU: MLX's float32 attention products run at ~6 GFLOP/s on one core);
- ``float32, buckets`` (``--float32`` only): the serving on the float32 copy;
- ``sentence-transformers``: ``SentenceTransformer(copy).encode(texts, batch_size=--batch)`` on the float32
  copy (torch on the CPU, its own length-sorted batching), run by ``--st-python`` (a venv with torch and
  sentence-transformers; skipped, saying so, when it cannot run) in a worker process kept alive.

Texts: ``--texts`` of mixed lengths (4 to ``--max-words`` words, log-uniform, seed 0). Each path runs
once to warm up (compiling every shape), then ``--rounds`` timed rounds, the paths and
sentence-transformers alternating round by round; the table shows each path's median round:
texts/s and real tokens/s (padding not counted), the ratio to sentence-transformers' median, and the
smallest cosine similarity of a vector with sentence-transformers' (same weights; the int8 products
and float summation order are the differences). The load average is printed before and after.

Run: ``.venv/bin/python bench/embeddings.py [--st-python /tmp/stvenv/bin/python]`` (writes
bench/results/embeddings.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

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


class _Ours:
    """A started serving over ``ckpt`` (its options ``options``), warmed up; :meth:`round` times one round."""

    def __init__(self, ckpt: Path, items: list[str], args: argparse.Namespace, **options: object) -> None:
        from mlx_serving import Serving, text_embedding

        self.items, self.clients = items, args.clients
        self.serving = text_embedding.from_mlx4bit(ckpt, max_len=args.max_len, batch_size=args.batch,
                                                   batch_timeout=0.005, **options)
        self.handle = Serving.start(self.serving, max_queue=len(items))
        self.vectors: dict[int, dict] = {}
        self.times: list[float] = []
        _round(self.handle, items, self.clients, self.vectors)  # warm-up: every shape compiled

    def round(self) -> None:
        self.times.append(_round(self.handle, self.items, self.clients, self.vectors))

    def result(self) -> dict:
        stats = self.handle.stats()
        self.handle.close()
        self.serving.close()
        tokens = sum(r["num_tokens"] for r in self.vectors.values())
        median = statistics.median(self.times)
        return {"seconds": median, "rounds_s": self.times, "texts_per_s": len(self.items) / median,
                "tokens_per_s": tokens / median, "tokens": tokens, "batches": stats.batches_run,
                "mean_batch_fill": stats.mean_batch_fill,
                "vectors": [self.vectors[i]["embedding"] for i in range(len(self.items))]}


def _round(handle: Any, items: list[str], clients: int, out: dict[int, dict]) -> float:
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


def st_worker(ckpt: str, texts_file: str, out_file: str, batch: int, max_len: int) -> None:
    """Run inside the sentence-transformers venv: load and warm up, print "ready", then encode once per
    "run" line on stdin (printing the seconds), and on "save" write the vectors (.npy) and exit."""
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(os.cpu_count() or 1)
    model = SentenceTransformer(ckpt, device="cpu", model_kwargs={"torch_dtype": torch.float32})
    model.max_seq_length = max_len
    items = json.loads(Path(texts_file).read_text())
    vectors = model.encode(items, batch_size=batch, convert_to_numpy=True)
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        if line.strip() == "save":
            break
        t0 = time.perf_counter()
        vectors = model.encode(items, batch_size=batch, convert_to_numpy=True)
        print(json.dumps(time.perf_counter() - t0), flush=True)
    np.save(out_file + ".npy", vectors.astype(np.float32))


class _Peer:
    """sentence-transformers in a worker process (:func:`st_worker`), or ``why`` it could not start."""

    def __init__(self, st_python: str, ckpt: Path, items: list[str], args: argparse.Namespace, tmp: Path) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.items, self.out = items, tmp / "st"
        self.times: list[float] = []
        self.why = "" if Path(st_python).exists() else \
            f"skipped: {st_python} not found (a venv with torch and sentence-transformers)"
        if self.why:
            return
        (tmp / "texts.json").write_text(json.dumps(items))
        command = [st_python, __file__, "--st-worker", str(ckpt), str(tmp / "texts.json"), str(self.out),
                   "--batch", str(args.batch), "--max-len", str(args.max_len)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        ready = self.proc.stdout.readline() if self.proc.stdout else ""
        if not ready:
            self.why = f"skipped: sentence-transformers failed: {self.proc.communicate()[1].strip().splitlines()[-1:]}"
            self.proc = None
        else:
            self.info = json.loads(ready)

    def round(self) -> None:
        if self.proc is not None and self.proc.stdin and self.proc.stdout:
            self.proc.stdin.write("run\n")
            self.proc.stdin.flush()
            self.times.append(json.loads(self.proc.stdout.readline()))

    def result(self) -> dict | str:
        import numpy as np

        if self.proc is None:
            return self.why
        self.proc.communicate("save\n")
        median = statistics.median(self.times)
        return {"seconds": median, "rounds_s": self.times, "texts_per_s": len(self.items) / median, **self.info,
                "vectors": np.load(str(self.out) + ".npy")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--texts", type=int, default=128)
    ap.add_argument("--max-words", type=int, default=180)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--matmul", action="store_true",
                    help="also run products='matmul', the exact float forward (slow on a CPU)")
    ap.add_argument("--float32", action="store_true",
                    help="also run the serving on the float32 copy (slow on a CPU: MLX's dense float32 matmul)")
    ap.add_argument("--st-python", default="/tmp/stvenv/bin/python")
    ap.add_argument("--st-worker", nargs=3, metavar=("CKPT", "TEXTS", "OUT"))
    args = ap.parse_args()
    if args.st_worker:
        st_worker(*args.st_worker, batch=args.batch, max_len=args.max_len)
        return
    run(args)


def run(args: argparse.Namespace) -> None:
    from mlx_serving.models.text_embedding import write_embedding_checkpoint

    items = texts(args.texts, args.max_words)
    overrides = {"num_hidden_layers": args.layers, "max_window_layers": args.layers}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        q4 = write_embedding_checkpoint(tmp / "q4", "0.6b", config_overrides=overrides)
        dense = dequantized_copy(q4, tmp / "dense")  # the same weights in float32: what the peer reads
        paths = {"native, buckets": _Ours(q4, items, args),
                 "native, one bucket": _Ours(q4, items, args, buckets=(args.max_len,))}
        if args.matmul:
            paths["matmul, buckets"] = _Ours(q4, items, args, products="matmul")
        if args.float32:
            paths["float32, buckets"] = _Ours(dense, items, args)
        peer = _Peer(args.st_python, dense, items, args, tmp)
        for _ in range(args.rounds):  # alternating: every path, then the peer, round by round
            for p in paths.values():
                p.round()
            peer.round()
        rows = {name: p.result() for name, p in paths.items()}
        st = peer.result()
    if isinstance(st, dict):
        rows["sentence-transformers"] = {**st, "tokens_per_s": rows["native, buckets"]["tokens"] / st["seconds"]}
    _report(rows, st, args, (load_before, os.getloadavg()))


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


def _report(rows: dict[str, dict], peer: dict | str, args: argparse.Namespace,
            load: tuple[tuple[float, ...], tuple[float, ...]]) -> None:
    import numpy as np

    reference = peer["vectors"] if isinstance(peer, dict) else None
    print(f"{args.texts} texts, 4-{args.max_words} words, {rows['native, buckets']['tokens']} tokens; Qwen3-0.6B "
          f"width, {args.layers} layers; max_len {args.max_len}, batch {args.batch}, {args.clients} clients; "
          f"{os.cpu_count()} CPU cores; {args.rounds} alternating rounds, medians; load average (1, 5, 15 min) "
          f"before {_load(load[0])}, after {_load(load[1])}")
    print(f"{'path':24} {'texts/s':>9} {'tokens/s':>10} {'vs ST':>7} {'min cos vs ST':>14}")
    summary = {}
    for name, r in rows.items():
        cos = None
        if reference is not None and name != "sentence-transformers":
            ours = np.stack(r["vectors"])
            cos = float(((ours * reference).sum(1) / np.linalg.norm(ours, axis=1)
                         / np.linalg.norm(reference, axis=1)).min())
        ratio = r["texts_per_s"] / peer["texts_per_s"] if isinstance(peer, dict) else None
        print(f"{name:24} {r['texts_per_s']:9.1f} {r['tokens_per_s']:10.0f} "
              f"{'' if ratio is None else f'{ratio:6.2f}x':>7} {'' if cos is None else f'{cos:.6f}':>14}")
        summary[name] = {k: v for k, v in r.items() if k != "vectors"} | {"min_cos_vs_st": cos}
    if not isinstance(peer, dict):
        print(f"sentence-transformers: {peer}")
    out = Path(__file__).resolve().parent / "results" / "embeddings.json"
    out.write_text(json.dumps({"args": vars(args), "load_average": load, "rows": summary,
                               "peer": peer if isinstance(peer, str) else None}, indent=2, default=str))
    print(f"wrote {out}")


def _load(avg: tuple[float, ...]) -> str:
    return " ".join(f"{a:.1f}" for a in avg)


if __name__ == "__main__":
    main()
