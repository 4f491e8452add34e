"""The README Quickstart stays within its memory bound on the paged KV cache (0.6B shape).

Runs the Quickstart's calls (``from_mlx4bit(path, max_new_tokens=16, max_len=512, max_batch=4)``,
inline then started) on the seeded random Qwen3-0.6B-shaped checkpoint (``seeded:qwen3-0.6b``) in
a fresh interpreter and checks its peak RSS < 3 GB. Marked slow: it needs that 335 MB checkpoint
(written once into the user cache).
The time from loading to the first inline result is printed (a measurement, not a bound: see
docs/benchmarks.md).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

QUICKSTART = r'''
import json, resource, sys, time
from mlx_serving import Serving, text_generation
from mlx_serving.models.sources import seeded_checkpoint

path = seeded_checkpoint("seeded:qwen3-0.6b")
t0 = time.perf_counter()
serving = text_generation.from_mlx4bit(path, max_new_tokens=16, max_len=512, max_batch=4)
t1 = time.perf_counter()
serving.run("Write a short story about a robot who learns to love.")
t2 = time.perf_counter()
with Serving.start(serving, batch_size=4, batch_timeout=0.01) as handle:
    handle.run({"text": "Hello", "temperature": 0.7, "seed": 7})
    with handle.stream("Tell me a joke") as stream:
        for item in stream:
            pass
serving.close()
print(json.dumps({"load_s": t1 - t0, "first_run_s": t2 - t1,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)}))
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quickstart_peak_rss_below_3gb():
    out = subprocess.run([sys.executable, "-c", QUICKSTART], check=True, capture_output=True, text=True,
                         timeout=570).stdout
    result = json.loads(out.strip().splitlines()[-1])
    print(result)
    assert result["peak_rss_mb"] < 3 * 1024
