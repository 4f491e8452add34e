import subprocess
import sys
import time
from pathlib import Path

SCRIPT = """
import sys, threading, time
sys.path.insert(0, {fakes!r})
from mlx_serving.serving import Serving
from serving_fakes import CountdownBackend, RecordingBackend, countdown, rows
it = Serving.new(CountdownBackend(step_delay=0.01)).start(batch_size=2, batch_timeout=0)
st = Serving.new(RecordingBackend()).start(batch_size=4, batch_timeout=60)
threading.Thread(target=Serving.batched_run, args=(it, countdown(100000)), daemon=True).start()
threading.Thread(target=Serving.batched_run, args=(st, rows(1)), daemon=True).start()
Serving.new(RecordingBackend()).run(rows(1))
print("started", time.monotonic(), flush=True)  # CLOCK_MONOTONIC: one clock for every process
"""


def test_interpreter_exit_ends_handles_left_running():
    script = SCRIPT.format(fakes=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    exited = time.monotonic()
    assert done.returncode == 0, done.stderr
    word, started = done.stdout.split()
    assert word == "started"
    # From the script's end to the process's end (not its start-up and imports, which load on the
    # machine stretches): the executors' exit hook ends the handles instead of waiting out its 5 s.
    assert exited - float(started) < 4.5
