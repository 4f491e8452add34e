"""The model a text-generation serving keeps (``_backend.kept_model``, issue 42): on the native CPU
decode path the packed one, MLX's copy of the projections freed once the loaded model is dropped,
every partition's engine sharing the packed matrices and generating what an engine over the loaded
model generates, bit for bit; the exact "matmul" path keeps the loaded model and stays exact."""

from __future__ import annotations

import gc
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_serving.models import native
from mlx_serving.models.decoder.cpu import NativeDecode
from mlx_serving.models.decoder.cpu.prefill import packed_matrix
from mlx_serving.models.decoder.layers import State
from mlx_serving.models.generation import Engine, SamplingParams
from mlx_serving.models.loader import load
from mlx_serving.models.text_generation._backend import GenerationBackend, kept_model
from mlx_serving.models.text_generation._options import GenerationOptions
from mlx_serving.models.text_generation._prompt_logprobs import prompt_logprobs
from engine_runs import run_to_end

pytestmark = pytest.mark.skipif(native.cpu_decode_module() is None or mx.default_device() != mx.cpu,
                                reason=f"the native CPU kernels are not available: {native.unavailable_reason()}")

PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [7, 7, 300, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def _options(**extra: object) -> GenerationOptions:
    return GenerationOptions(max_new_tokens=8, max_len=64, max_batch=4, **extra)


def _tokens(engine: Engine) -> dict[int, list[int]]:
    return run_to_end(engine, PROMPTS, [SamplingParams(max_new_tokens=8, eos_token_ids=())] * len(PROMPTS))


def _projections(state: State) -> list:
    return [m for ly in state.layers for m in (ly.qkv.merged, ly.o_proj, ly.gate_up.merged, ly.down_proj)]


def test_the_native_path_keeps_the_packed_model_and_frees_mlxs_projections_and_table(tiny_ckpt: Path) -> None:
    state = load(tiny_ckpt)
    released = sum(a.nbytes for m in _projections(state) for a in (m.weight, m.scales, m.biases))
    backend = GenerationBackend(state, _options())
    kept = backend._model
    assert kept is not state and all(m.weight.size == 0 and m.scales.size == 0 and packed_matrix(m) is not None
                                     for m in _projections(kept))
    assert kept.lm_head is kept.embed_tokens and kept.lm_head.weight.size == 0  # the tied head: its lookup packed too
    released += sum(a.nbytes for a in (state.lm_head.weight, state.lm_head.scales, state.lm_head.biases))
    before = mx.get_active_memory()
    del state
    gc.collect()
    assert before - mx.get_active_memory() >= released  # MLX's copy of the projections is gone
    engine = backend.init("", None, 1)
    try:
        assert isinstance(engine.decode_backend, NativeDecode) and engine.state is kept
    finally:
        backend.close(engine)


def test_every_engine_shares_the_packed_matrices_and_generates_what_the_loaded_model_does(tiny: State) -> None:
    """Two partitions' engines over the kept model: each its own decoder over the same packed
    matrices, each the tokens of an engine over the loaded model, bit for bit."""
    opts = _options()
    reference = Engine(tiny, opts.engine)
    assert isinstance(reference.decode_backend, NativeDecode)
    expected = _tokens(reference)
    reference.close()
    backend = GenerationBackend(tiny, opts)
    kept = backend._model
    engines = [backend.init("", None, 2) for _ in range(2)]
    try:
        first, second = (e.decode_backend for e in engines)
        assert isinstance(first, NativeDecode) and isinstance(second, NativeDecode)
        assert first.decoder is not second.decoder  # a thread pool per engine
        for e in engines:
            ours = [packed_matrix(m) for m in _projections(e.runner.state)]
            assert all(a is b for a, b in zip(ours, (packed_matrix(m) for m in _projections(kept)), strict=True))
            assert _tokens(e) == expected
    finally:
        for e in engines:
            backend.close(e)


def test_the_exact_path_keeps_the_loaded_model_and_stays_exact(tiny: State) -> None:
    """``decode_path="matmul"``: the loaded model itself is kept (nothing packed), its engine
    generates what an engine over the loaded model does and its prompt log-probabilities are the
    exact ones; the native path's differ (int8 activations)."""
    opts = _options(decode_path="matmul")
    assert kept_model(tiny, opts.engine) is tiny
    backend = GenerationBackend(tiny, opts)
    engine = backend.init("", None, 1)
    try:
        assert engine.decode_backend.name == "matmul" and engine.state is tiny
        reference = Engine(tiny, opts.engine)
        assert _tokens(engine) == _tokens(reference)
        reference.close()
    finally:
        backend.close(engine)
    exact = prompt_logprobs(tiny, PROMPTS[2], 2)
    packed = kept_model(tiny, _options().engine)
    assert prompt_logprobs(backend._model, PROMPTS[2], 2) == exact
    assert prompt_logprobs(packed, PROMPTS[2], 2) != exact
