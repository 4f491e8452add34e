"""What a static backend's ``handle_batch`` may return: one row per real row, plus padding up to
``batch_size`` rounded up to a power of two; fewer rows, or more than padding explains, fail the
batch's callers with a BackendError naming the counts (more rows used to be accepted silently)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mlx_serving import Backend, BackendError, Batch, Serving


class Rows(Backend):
    """Returns ``extra`` rows more than the batch holds (negative: fewer)."""

    def __init__(self, extra: int):
        self.extra = extra

    def init(self, mode: str, arg: Any, partitions: int) -> None:
        return None

    def handle_batch(self, batch: Batch, partition: int, state: Any) -> tuple[Any, Any]:
        return np.arange(batch.size + self.extra, dtype=float), None


def _serving(extra: int) -> Serving:
    return (Serving.new(Rows(extra))
            .client_preprocessing(lambda n: (Batch.concatenate([np.zeros(n)]), n))
            .client_postprocessing(lambda out_meta, n: out_meta[0][:n].tolist()))


@pytest.mark.parametrize("extra", [0, 1, 5])  # 3 rows in a batch of 6 may be padded to 8
def test_padding_up_to_the_power_of_two_of_batch_size_is_sliced_off(extra: int):
    serving = _serving(extra).batch_size(6)
    assert serving.run(3) == [0.0, 1.0, 2.0]
    with serving.start(batch_timeout=0) as handle:
        assert handle.run(3) == [0.0, 1.0, 2.0]
    serving.close()


@pytest.mark.parametrize("extra", [-1, 6, 1000])
def test_rows_padding_cannot_explain_fail_the_batch(extra: int):
    serving = _serving(extra).batch_size(6)
    with pytest.raises(BackendError, match="handle_batch returned .* rows for a batch of 3"):
        serving.run(3)
    with serving.start(batch_timeout=0) as handle:
        with pytest.raises(BackendError, match="handle_batch returned .* rows for a batch of 3"):
            handle.run(3)
        assert handle.stats().failed == 1
    serving.close()
