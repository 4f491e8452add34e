import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mlx_serving.serving import BackendError, Batch, Serving

from serving_fakes import RecordingBackend, rows


def test_run_function_both_call_styles():
    s = Serving.new(lambda b: b.data + 1)
    assert Serving.run(s, rows(1, 2)).tolist() == [2, 3]
    assert s.run(rows(5)).tolist() == [6]


def test_split_by_batch_size_and_reassemble_in_order(recording):
    s = Serving.new(recording, "arg").batch_size(2)
    out = s.run(rows(1, 2, 3, 4, 5))
    assert out.tolist() == [2, 4, 6, 8, 10]
    assert [b[0] for b in recording.batches] == [[1, 2], [3, 4], [5]]


def test_init_once_thread_safe_and_model_work_on_one_thread(recording):
    s = Serving.new(recording, "arg")
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: s.run(rows(i)).tolist(), range(16)))
    assert outs == [[2 * i] for i in range(16)]
    assert len(recording.inits) == 1 and recording.inits[0][:2] == ("inline", 1)
    assert recording.threads == {recording.inits[0][2]}
    assert recording.inits[0][2] != threading.current_thread().name


def test_builders_are_immutable(recording):
    s = Serving.new(recording)
    s2 = s.batch_size(1).client_postprocessing(lambda r, info: r[0].sum())
    assert s.run(rows(1, 2)).tolist() == [2, 4]
    assert [len(b[0]) for b in recording.batches] == [2]
    assert s2.run(rows(1, 2)) == 6
    assert [len(b[0]) for b in recording.batches] == [2, 1, 1]


def test_client_pre_and_postprocessing_and_metadata(recording):
    seen = {}

    def post(result, info):
        seen["metadata"], seen["info"] = result[1], info
        return result[0].tolist()

    s = (
        Serving.new(recording)
        .client_preprocessing(lambda xs: (Batch.concatenate([np.array(xs, dtype=float)]), len(xs)))
        .client_postprocessing(post)
    )
    assert s.run([1, 2, 3]) == [2, 4, 6]
    assert seen == {"metadata": {"partition": 0, "rows": 3}, "info": 3}


def test_list_outputs_for_ragged_rows():
    s = Serving.new(lambda b: [len(r) for r in b.data]).batch_size(2)
    assert s.run(Batch.stack([[1, 2, 3], [4], [5, 6]])) == [3, 1, 2]


def test_backend_error_is_chained_and_serving_keeps_working():
    backend = RecordingBackend(fail_on=7)
    s = Serving.new(backend)
    with pytest.raises(BackendError) as info:
        s.run(rows(1, 7))
    assert isinstance(info.value.__cause__, RuntimeError)
    assert s.run(rows(3)).tolist() == [6]


def test_bad_inputs_raise_typed_errors_at_the_boundary():
    s = Serving.new(lambda b: b.data)
    with pytest.raises(TypeError, match="must be a Batch"):
        s.run([1, 2])
    with pytest.raises(TypeError, match="return"):
        s.client_preprocessing(lambda x: x).run(rows(1))
    with pytest.raises(BackendError, match="rows"):
        Serving.new(lambda b: b.data[:1]).run(rows(1, 2))
    with pytest.raises(ValueError):
        s.batch_size(0)
    with pytest.raises(TypeError):
        Serving.new(42)
