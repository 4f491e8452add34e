import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mlx_serving.serving import (
    BackendError,
    Batch,
    DeadlineExceeded,
    Serving,
    ServingOverloaded,
    ServingStopped,
)
from serving_fakes import GateBackend, RecordingBackend, rows


def timed_call(handle, batch, **kw):
    start = time.monotonic()
    out = Serving.batched_run(handle, batch, **kw)
    return out, time.monotonic() - start


def test_first_arrival_timer_and_shared_batch(recording):
    with Serving.new(recording).start(batch_size=4, batch_timeout=0.5) as h, ThreadPoolExecutor(2) as pool:
        a = pool.submit(timed_call, h, rows(1))
        time.sleep(0.25)
        b = pool.submit(timed_call, h, rows(2))
        (out_a, lat_a), (out_b, lat_b) = a.result(5), b.result(5)
    assert out_a.tolist() == [2] and out_b.tolist() == [4]
    assert [b_[0] for b_ in recording.batches] == [[1, 2]]
    assert lat_a >= 0.45  # waited for the timer started by the first arrival
    assert lat_b < 0.45  # the second arrival did not restart it


def test_full_batch_runs_before_timeout(recording):
    with Serving.new(recording).start(batch_size=2, batch_timeout=30) as h, ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(timed_call, h, rows(i)) for i in (1, 2)]
        results = [f.result(5) for f in futures]
    assert sorted(r[0].tolist()[0] for r in results) == [2, 4]
    assert max(r[1] for r in results) < 5


def test_oversized_request_is_split_and_reassembled(recording):
    with Serving.new(recording).start(batch_size=3, batch_timeout=0.05) as h:
        out = Serving.batched_run(h, rows(1, 2, 3, 4, 5, 6, 7))
        assert out.tolist() == [2, 4, 6, 8, 10, 12, 14]
        assert [b[0] for b in recording.batches] == [[1, 2, 3], [4, 5, 6], [7]]
        assert h.stats().batches_run == 3


def test_batch_keys_have_their_own_stacks(recording):
    with Serving.new(recording).start(batch_size=4, batch_timeout=0.2, batch_keys=("a", "b")) as h:
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(Serving.batched_run, h, rows(i).key(k)) for i, k in [(1, "a"), (2, "b"), (3, "a")]]
            assert [f.result(5).tolist() for f in futures] == [[2], [4], [6]]
        assert sorted((b[1], sorted(b[0])) for b in recording.batches) == [("a", [1, 3]), ("b", [2])]
        with pytest.raises(ValueError, match="unknown batch key"):
            Serving.batched_run(h, rows(1).key("c"))


def test_stale_timer_is_ignored(recording):
    with Serving.new(recording).start(batch_size=2, batch_timeout=0.4) as h, ThreadPoolExecutor(3) as pool:
        first = [pool.submit(timed_call, h, rows(i)) for i in (1, 2)]  # fills a batch, runs at once
        [f.result(5) for f in first]
        time.sleep(0.2)
        _, latency = timed_call(h, rows(3))
    assert latency >= 0.35  # its own timer, not the earlier stack's


def test_partitions_run_batches_concurrently_on_their_own_threads():
    """Each partition's batch waits at a barrier of 2: the calls can finish only if two batches run
    at once, on two partition threads (no timing asserted: a busy machine cannot fail it)."""
    barrier = threading.Barrier(2, timeout=30)
    backend = RecordingBackend()
    handle_batch = backend.handle_batch

    def meet(batch, partition, state):
        barrier.wait()  # raises BrokenBarrierError after 30 s alone: the partitions would be serial
        return handle_batch(batch, partition, state)

    backend.handle_batch = meet
    with Serving.new(backend).start(name="parts", partitions=2, batch_size=1, batch_timeout=0) as h, \
            ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: Serving.batched_run("parts", rows(i)).tolist(), range(4)))
    assert outs == [[0], [2], [4], [6]]
    assert len(backend.threads) == 2 and all(t.startswith("parts-p") for t in backend.threads)
    assert {b[2] for b in backend.batches} == {0, 1}
    assert backend.inits == [("process", 2, "parts-p0")]


def test_names_are_registered_once_and_released_on_stop(recording):
    h = Serving.new(recording).start(name="dup")
    with pytest.raises(ValueError, match="already running"):
        Serving.new(recording).start(name="dup")
    assert Serving.batched_run("dup", rows(4)).tolist() == [8]
    h.close()
    with pytest.raises(ServingStopped):
        Serving.batched_run("dup", rows(4))
    Serving.new(recording).start(name="dup").close()


def test_batch_failure_fails_exactly_its_callers():
    backend = RecordingBackend(fail_on=99)
    with Serving.new(backend).start(batch_size=2, batch_timeout=0.3) as h, ThreadPoolExecutor(3) as pool:
        # x's rows fill one batch exactly; y's [3, 99] form the next (failing) batch.
        x = pool.submit(Serving.batched_run, h, rows(1, 2))
        time.sleep(0.1)
        y = pool.submit(Serving.batched_run, h, rows(3, 99))
        assert x.result(5).tolist() == [2, 4]
        with pytest.raises(BackendError) as info:
            y.result(5)
        assert isinstance(info.value.__cause__, RuntimeError)
        # batchmates in one failing batch both fail, with the cause chained
        a = pool.submit(Serving.batched_run, h, rows(99))
        b = pool.submit(Serving.batched_run, h, rows(5))
        for f in (a, b):
            with pytest.raises(BackendError):
                f.result(5)
        assert Serving.batched_run(h, rows(6)).tolist() == [12]
        assert h.stats().failed == 3


def test_preprocessing_error_fails_only_that_caller(recording):
    def pre(x):
        if x == "bad":
            raise KeyError("bad input")
        return rows(x), None

    with Serving.new(recording).client_preprocessing(pre).start(batch_size=2, batch_timeout=0.2) as h:
        with ThreadPoolExecutor(3) as pool:
            good = [pool.submit(Serving.batched_run, h, i) for i in (1, 2)]
            bad = pool.submit(Serving.batched_run, h, "bad")
            assert sorted(f.result(5).tolist()[0] for f in good) == [2, 4]
            with pytest.raises(KeyError):
                bad.result(5)


def test_max_queue_rejects_at_once_without_enqueueing():
    backend = GateBackend()
    with Serving.new(backend).start(batch_size=1, batch_timeout=0, max_queue=2) as h, ThreadPoolExecutor(3) as pool:
        running = pool.submit(Serving.batched_run, h, rows(1))
        backend.wait_started()
        queued = [pool.submit(Serving.batched_run, h, rows(i)) for i in (2, 3)]
        _wait_for(lambda: h.stats().queued == 2)
        with ThreadPoolExecutor(1) as other, pytest.raises(ServingOverloaded):  # at once: waiting for room
            other.submit(Serving.batched_run, h, rows(4)).result(timeout=30)  # would wait for the closed gate
        stats = h.stats()
        assert (stats.queued, stats.running, stats.rows_in_flight, stats.rejected) == (2, 1, 3, 1)
        backend.gate.set()
        assert [f.result(5).tolist() for f in [running, *queued]] == [[2], [4], [6]]


def test_stop_fails_queued_at_once_and_lets_running_finish():
    backend = GateBackend()
    h = Serving.new(backend).start(batch_size=1, batch_timeout=0, name="stopper")
    with ThreadPoolExecutor(4) as pool:
        running = pool.submit(Serving.batched_run, h, rows(1))
        backend.wait_started()
        queued = [pool.submit(Serving.batched_run, h, rows(i)) for i in (2, 3)]
        _wait_for(lambda: h.stats().queued == 2)
        stopper = pool.submit(h.close)
        for f in queued:
            with pytest.raises(ServingStopped):
                f.result(5)
        assert not running.done()
        backend.gate.set()
        assert running.result(5).tolist() == [2]
        stopper.result(5)
    with pytest.raises(ServingStopped):
        Serving.batched_run(h, rows(5))


def test_running_batch_past_shutdown_timeout_fails_with_stopped():
    backend = GateBackend()
    h = Serving.new(backend).start(batch_timeout=0, shutdown_timeout=0.2)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(Serving.batched_run, h, rows(1))
        backend.wait_started()
        h.close()
        with pytest.raises(ServingStopped):
            running.result(5)
        backend.gate.set()


def test_caller_that_gives_up_never_breaks_the_scheduler():
    backend = GateBackend()
    with Serving.new(backend).start(batch_size=1, batch_timeout=0) as h, ThreadPoolExecutor(2) as pool:
        running = pool.submit(Serving.batched_run, h, rows(1))
        backend.wait_started()
        with pytest.raises(DeadlineExceeded):
            Serving.batched_run(h, rows(2), deadline=0.2)
        assert h.stats().queued == 0 and h.stats().expired == 1
        abandoned = pool.submit(Serving.batched_run, h, rows(3))  # nobody will read its result
        backend.gate.set()
        assert running.result(5).tolist() == [2]
        assert Serving.batched_run(h, rows(4)).tolist() == [8]
        del abandoned
    assert [b[0] for b in backend.batches] == [[1], [3], [4]]  # the expired request never ran


def test_different_row_shapes_with_one_key_do_not_fail_each_other(recording):
    with Serving.new(recording).start(batch_size=4, batch_timeout=0.2) as h, ThreadPoolExecutor(2) as pool:
        a = pool.submit(Serving.batched_run, h, Batch.stack([np.ones(3)]))
        b = pool.submit(Serving.batched_run, h, Batch.stack([np.ones(2)]))
        assert a.result(5).shape == (1, 3) and b.result(5).shape == (1, 2)


def test_telemetry_events_and_stats(recording):
    events = []
    serving = Serving.new(recording).telemetry(events.append).client_preprocessing(lambda x: (rows(*x), None))
    with serving.start(batch_size=2, batch_timeout=0.05) as h:
        Serving.batched_run(h, [1, 2, 3])
        stats = h.stats()
    kinds = [e.kind for e in events]
    assert kinds.count("preprocessing") == 1 and kinds.count("postprocessing") == 1
    assert kinds.count("execute") == 2
    assert all(e.duration_s >= 0 for e in events)
    assert sorted(e.rows for e in events if e.kind == "execute") == [1, 2]
    assert (stats.batches_run, stats.completed, stats.queued, stats.running) == (2, 1, 0, 0)
    assert stats.mean_batch_fill == pytest.approx(0.75)


def test_failing_telemetry_callback_is_contained(recording):
    def broken(event):
        raise RuntimeError("telemetry down")

    with Serving.new(recording).telemetry(broken).start(batch_timeout=0) as h:
        assert Serving.batched_run(h, rows(2)).tolist() == [4]


def test_batch_size_disagreement_and_option_validation(recording):
    with pytest.raises(ValueError, match="disagrees"):
        Serving.new(recording).batch_size(2).start(batch_size=3)
    with pytest.raises(ValueError, match="never fill"):
        Serving.new(recording).start(batch_size=4, max_queue=2)
    with pytest.raises(TypeError):
        Serving.new(recording).start(bogus=1)
    with pytest.raises(TypeError, match="client"):
        Serving.batched_run(42, rows(1))
    served = Serving.new(recording).process_options(batch_size=2, batch_timeout=0.01, max_queue=8)
    with served.start(max_queue=None) as h:
        assert (h.options.batch_size, h.options.batch_timeout, h.options.max_queue) == (2, 0.01, None)


def test_init_failure_raises_from_start():
    class Broken(RecordingBackend):
        def init(self, mode, arg, partitions):
            raise OSError("no weights")

    with pytest.raises(OSError, match="no weights"):
        Serving.new(Broken()).start(name="broken")
    Serving.new(RecordingBackend()).start(name="broken").close()  # name was released


def _wait_for(predicate, timeout=5.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition never became true"
        threading.Event().wait(0.01)
