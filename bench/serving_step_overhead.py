"""Host overhead per decode step of the text-generation Serving, with a zero-cost engine.

The text-generation serving (scheduler, GenerationBackend, per-request channels, the
client-side GenerationTransducer with its streaming detokenizer) runs over a stand-in for
``models.generation.Engine`` whose ``step()`` returns the next token of every active sequence at
once, with no model behind it. N concurrent ``batched_run_async`` requests of ``--new`` tokens
each: wall / steps is the host time the serving spends per step at N rows, which a GPU step
has to cover (it is serial with the engine's own host work on the same interpreter).
Peer in the same run: the bare loop over the same stand-in engine (no Serving); ``bare/serving``
is the throughput ratio (issue 17's target: >= 0.9 at 128 rows on the GPU).

Columns beside the wall: ``CPU us/step``, the process's CPU time (every thread) per step, less
disturbed than the wall by other processes on a shared machine; ``engine thread CPU us/step``,
the CPU time of the serving's engine thread per step (``time.thread_time`` between its "step"
telemetry events: admission, the stand-in's step, delivery of the events to the channels), the
host work that is serial with a GPU step, to compare with the bare loop's CPU.

Options: ``--stream``: the callers read ``stream_async`` (the HTTP server's path: a wake-up per
token) instead of ``batched_run_async`` (one burst at the end). ``--device-us``: each stand-in
step first sleeps that long with the GIL released, as a GPU step waits for the device (~3,000
us at 128 rows on an H200); the callers' event loop runs meanwhile, so the wall shows the host
work that does not overlap the device.

Run: ``python bench/serving_step_overhead.py [--stream] [--device-us 3000]`` (CPU; JSON to
bench/results/serving_step_overhead.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_serving.models.text_generation._backend as backend_module  # noqa: E402
from mlx_serving.models import text_generation  # noqa: E402
from mlx_serving.models.generation import EngineConfig, FinishReason, SamplingParams, SeqEvent  # noqa: E402
from mlx_serving.models.loader import load  # noqa: E402
from mlx_serving.models.seeded_checkpoint import write_checkpoint  # noqa: E402
from mlx_serving.serving import Serving  # noqa: E402
from mlx_serving.tokenization import Tokenizer  # noqa: E402


class ZeroCostEngine:
    """The Engine interface the backend uses; every step yields one token per sequence. With
    ``device_s`` > 0 each step first sleeps that long, releasing the GIL as a GPU step's wait for
    the device does (the callers' event loop runs meanwhile)."""

    device_s = 0.0

    def __init__(self, state: Any, config: EngineConfig, **kwargs: Any):
        self._seqs: dict[int, list[int]] = {}
        self._max_batch = config.scheduler.max_batch
        self.runner = SimpleNamespace(warm_shapes_left=0, cold_shapes=0)  # no shapes to build
        self.iteration_tokens = SimpleNamespace(stats=dict)

    def warm_up(self, limit: int | None = None) -> int:
        """Nothing to warm: 0 shapes left."""
        return 0

    def close(self) -> None:
        """Nothing to release."""

    @property
    def num_active(self) -> int:
        return len(self._seqs)

    @property
    def num_waiting(self) -> int:
        return 0

    @property
    def free_slots(self) -> int:
        return self._max_batch - len(self._seqs)

    def kv_stats(self) -> None:
        return None

    def add(self, seq_id: int, prompt_ids: list[int], params: SamplingParams, *, priority: int = 0) -> None:
        self._seqs[seq_id] = [params.max_new_tokens, 0]

    def cancel(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def step(self) -> list[SeqEvent]:
        if self.device_s:
            time.sleep(self.device_s)
        events = []
        for seq_id, s in list(self._seqs.items()):
            s[1] += 1
            done = s[1] >= s[0]
            events.append(SeqEvent(seq_id, 1000 + s[1] % 64, 0.0, FinishReason.LENGTH if done else None))
            if done:
                del self._seqs[seq_id]
        return events


async def concurrent(handle: Any, texts: list[str], stream: bool = False) -> tuple[float, float]:
    """Wall and process CPU seconds (every thread) of one round of concurrent requests."""

    async def one(text: str) -> None:
        if not stream:
            await Serving.batched_run_async(handle, text)
            return
        async with await handle.stream_async(text) as items:
            async for _ in items:
                pass

    t0, c0 = time.perf_counter(), time.process_time()
    async with anyio.create_task_group() as tg:
        for t in texts:
            tg.start_soon(one, t)
    return time.perf_counter() - t0, time.process_time() - c0


def bare(n: int, new: int) -> tuple[float, float]:
    eng = ZeroCostEngine(None, EngineConfig.of(max_batch=n))
    for i in range(n):
        eng.add(i, [1], SamplingParams(max_new_tokens=new))
    t0, c0 = time.perf_counter(), time.process_time()
    while eng.num_active:
        eng.step()
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/mlx-serving-tiny"))
    ap.add_argument("--rows", default="1,32,128")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stream", action="store_true", help="read stream_async instead of batched_run_async")
    ap.add_argument("--device-us", type=float, default=0.0,
                    help="a GPU step's wait for the device: each stand-in step sleeps this long (GIL released)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/serving_step_overhead.json"))
    args = ap.parse_args()
    if not (args.ckpt / "config.json").is_file():
        write_checkpoint(args.ckpt, "tiny", seed=0)
    backend_module.Engine = ZeroCostEngine  # the stand-in behind the real backend
    ZeroCostEngine.device_s = args.device_us * 1e-6
    state = load(args.ckpt)
    tok = Tokenizer.from_dir(args.ckpt)
    out: dict[str, Any] = {"new_tokens": args.new, "stream": args.stream, "device_us": args.device_us, "rows": {}}
    print(f"{'rows':>6}{'serving us/step':>17}{'bare us/step':>14}{'bare/serving':>14}"
          f"{'serving us/row-token':>22}{'CPU us/step serving, bare':>27}{'engine thread CPU us/step':>27}")
    for n in (int(x) for x in args.rows.split(",")):
        marks: list[float] = []  # the engine thread's CPU clock after each step (its telemetry)
        gen = text_generation.serving(tok, state, max_new_tokens=args.new, max_len=args.new + 64, max_batch=n)
        gen = gen.telemetry(lambda ev: marks.append(time.thread_time()) if ev.kind == "step" and ev.rows else None)
        texts = [f"request {i}: the quick brown fox jumps over the lazy dog" for i in range(n)]
        runs, engine_cpu = [], []
        with Serving.start(gen, batch_size=n, batch_timeout=0.002) as h:
            anyio.run(concurrent, h, texts, args.stream)  # warm-up
            for _ in range(args.rounds):
                marks.clear()
                runs.append(anyio.run(concurrent, h, texts, args.stream))
                engine_cpu.append((marks[-1] - marks[0]) / (len(marks) - 1))
        bares = [bare(n, args.new) for _ in range(args.rounds)]
        wall, cpu = (statistics.median(r[k] for r in runs) for k in (0, 1))
        bare_wall, bare_cpu = (statistics.median(r[k] for r in bares) for k in (0, 1))
        row = {"serving_us_per_step": wall / args.new * 1e6, "bare_us_per_step": bare_wall / args.new * 1e6,
               "bare_over_serving": bare_wall / wall, "serving_us_per_row_token": wall / (args.new * n) * 1e6,
               "serving_cpu_us_per_step": cpu / args.new * 1e6, "bare_cpu_us_per_step": bare_cpu / args.new * 1e6,
               "engine_thread_cpu_us_per_step": statistics.median(engine_cpu) * 1e6}
        out["rows"][str(n)] = row
        print(f"{n:>6}{row['serving_us_per_step']:>17.0f}{row['bare_us_per_step']:>14.0f}"
              f"{row['bare_over_serving']:>14.2f}{row['serving_us_per_row_token']:>22.2f}"
              f"{row['serving_cpu_us_per_step']:>19.0f}{row['bare_cpu_us_per_step']:>8.0f}"
              f"{row['engine_thread_cpu_us_per_step']:>27.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
