"""Start-up cost of the paged KV cache on the 0.6B shape (issue 13): time from a loaded checkpoint
to a ready engine, and to the first inline ``Serving.run`` result.

``Engine(state, EngineConfig.of(max_batch=32, max_len=2048))`` (the text-generation defaults, max_batch 32, max_len 2048) allocates
its block pool for the default budget (1 GiB on the CPU) instead of the slot design's
32 x 2,049 positions (15 GB in float32); ``text_generation.from_mlx4bit(seeded_checkpoint("seeded:qwen3-0.6b"),
max_new_tokens=1)`` then ``run("Hello")`` times building the partition's engine plus one prefill
and one token. Checkpoint: ``seeded_checkpoint("seeded:qwen3-0.6b")`` (335 MB seeded-random 0.6B).

Run: ``.venv/bin/python bench/kv_startup.py`` (writes bench/results/kv_startup.json).
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

from mlx_serving import text_generation
from mlx_serving.models.sources import seeded_checkpoint
from mlx_serving.models.generation import Engine, EngineConfig
from mlx_serving.models.loader import load


def main() -> None:
    path = seeded_checkpoint("seeded:qwen3-0.6b")
    t0 = time.perf_counter()
    state = load(path)
    t1 = time.perf_counter()
    engine = Engine(state, EngineConfig.of(max_batch=32, max_len=2048))
    t2 = time.perf_counter()
    stats, kv_mb = engine.kv_stats(), engine.cache.nbytes / 2**20
    del engine
    serving = text_generation.from_mlx4bit(path, max_new_tokens=1)
    t3 = time.perf_counter()
    serving.run("Hello")
    t4 = time.perf_counter()
    serving.close()
    out = {"command": "python bench/kv_startup.py", "load_s": round(t1 - t0, 2), "engine_init_s": round(t2 - t1, 3),
           "kv_blocks": stats.blocks_total, "kv_reserved_mb": round(kv_mb, 1),
           "first_run_s_max_new_1": round(t4 - t3, 2),
           "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
    Path(__file__).resolve().parent.joinpath("results", "kv_startup.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
