"""Memory admission (issue 44) with simulated device budgets: no configuration reserves more KV
than its budget, a budget that holds no sequence of ``max_len`` is refused naming the flags to
change, a model whose weights do not fit the device is refused before a weight is read, a
ServingPool's workers share one budget, and shape bucketing is the CUDA build's default only."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_serving.models.decoder import memory
from mlx_serving.models.decoder import kv_cache
from mlx_serving.models.decoder.decode_backends import decode_backend, kv_cache_dtype_for
from mlx_serving.models.decoder.kv_cache import kv_bytes_per_token, plan_blocks
from mlx_serving.models.generation import DecodeConfig
from mlx_serving.models.generation import config as generation_config
from mlx_serving.models.loader import load
from mlx_serving.models.text_generation import from_mlx4bit
from mlx_serving.serving import POOL_WORKERS_ENV, Serving, ServingPool


@settings(max_examples=300, deadline=None)
@given(max_batch=st.integers(1, 64), max_len=st.integers(1, 5000), block_size=st.sampled_from([8, 16, 32]),
       budget=st.integers(1, 1 << 26))
def test_the_plan_never_exceeds_the_budget(tiny, max_batch: int, max_len: int, block_size: int, budget: int):
    per_block = kv_bytes_per_token(tiny) * block_size
    try:
        blocks = plan_blocks(tiny, max_batch, max_len, kv_cache_bytes=budget, block_size=block_size)
    except ValueError as exc:
        assert "holds no sequence of max_len" in str(exc) and "--max-len" in str(exc)
        assert "--kv-cache-memory-bytes" in str(exc)
        return
    assert blocks * per_block <= budget
    assert blocks >= -(-max_len // block_size)  # at least one whole sequence


def test_the_default_budget_is_not_exceeded_either(tiny, monkeypatch: pytest.MonkeyPatch):
    """The old plan reserved one sequence of max_len whatever the budget (16 GiB for a large model at
    a long max_len): now the default budget refuses instead, naming the flags."""
    monkeypatch.setattr(kv_cache, "DEFAULT_CPU_BYTES", kv_bytes_per_token(tiny) * 100)
    with pytest.raises(ValueError, match="the default CPU budget holds no sequence of max_len=4096"):
        plan_blocks(tiny, 1, 4096)
    assert plan_blocks(tiny, 1, 64) * 16 * kv_bytes_per_token(tiny) <= kv_bytes_per_token(tiny) * 100


def test_on_a_simulated_gpu_the_budget_is_what_is_left_after_the_weights(tiny, monkeypatch: pytest.MonkeyPatch):
    per_token = kv_bytes_per_token(tiny)
    monkeypatch.setattr(memory, "device_limit", lambda: per_token * 16 * 40)  # 40 blocks' worth in all
    monkeypatch.setattr(memory.mx, "get_active_memory", lambda: per_token * 16 * 8)  # "weights": 8 blocks
    assert plan_blocks(tiny, 64, 64) == (40 - 8) // 2  # the default: half of what is left
    assert plan_blocks(tiny, 64, 64, kv_cache_fraction=1.0) == 32
    with pytest.raises(ValueError, match=r"kv_cache_bytes=.* needs .* GiB but the device has .* lower kv_cache_bytes"):
        plan_blocks(tiny, 64, 64, kv_cache_bytes=per_token * 16 * 33)


def test_weights_that_do_not_fit_are_refused_before_loading(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(memory, "device_limit", lambda: 4096)
    monkeypatch.setattr(memory.mx, "get_active_memory", lambda: 0)
    with pytest.raises(ValueError, match=r"the weights of tiny needs .* GiB but the device has"):
        load(tiny_ckpt)
    monkeypatch.setattr(memory, "device_limit", lambda: None)  # the CPU: the OS pages
    assert load(tiny_ckpt).config.num_hidden_layers > 0


def test_a_pools_workers_split_one_budget(tiny, tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch):
    kv = kv_cache_dtype_for(decode_backend(tiny), "auto")  # the cache the engine builds (float16 natively)
    budget = kv_bytes_per_token(tiny, kv) * 16 * 48  # 48 blocks; max_len 64 needs 4 per sequence
    factory = functools.partial(from_mlx4bit, tiny_ckpt, max_new_tokens=4, max_len=64, max_batch=32,
                                kv_cache_bytes=budget)
    with Serving.start(factory()) as solo:
        alone = solo.stats().backend["blocks_total"]
    with ServingPool(factory, workers=2) as pool:
        assert pool.run({"text": "hi"})["results"]
        shared = pool.stats().backend["blocks_total"]  # summed over the workers
    assert alone == 48 and shared == 48
    monkeypatch.setenv(POOL_WORKERS_ENV, "4")
    assert memory.pool_share() == 4 and plan_blocks(tiny, 32, 64, kv_cache_bytes=budget, kv_cache_dtype=kv) == 12
    monkeypatch.setenv(POOL_WORKERS_ENV, "junk")
    assert memory.pool_share() == 1


def test_bucketing_is_the_cuda_builds_default_only(monkeypatch: pytest.MonkeyPatch):
    assert DecodeConfig().bucketed() is memory.on_cuda()  # False here: the CPU
    monkeypatch.setattr(generation_config, "on_cuda", lambda: True)
    assert DecodeConfig().bucketed() is True
    monkeypatch.setattr(generation_config, "on_cuda", lambda: False)  # Metal, the CPU: packed, unpadded
    assert DecodeConfig().bucketed() is False and DecodeConfig(bucket_shapes=True).bucketed() is True


def test_wiring_is_metal_only():
    assert memory.wire() is None  # no Metal here: nothing wired
