"""The fused decode path's wiring (models/decoder/decode_backends.py::FusedDecode) on any device: the three
CUDA kernels are replaced by pure-MLX implementations of their documented contracts
(kernel_refs.py, passed as the backend's kernels), and whole continuous-batching generations must
equal the generic path's. The
kernels themselves are checked against the same references on a GPU (test_qwen3_kernels_cuda.py)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from kernel_refs import ref_add_rms_norm, ref_attention_o_proj, ref_decode_attention, ref_qmv, ref_swiglu

from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams
from mlx_serving.models.decoder.decode_backends import FusedDecode, GenericDecode, decode_backend, qmv_fits

#: The fused backend over the kernels' reference implementations.
REFERENCE = FusedDecode(attention=ref_decode_attention, add_rms_norm=ref_add_rms_norm, swiglu=ref_swiglu)


def _generate(state, compiled: bool, decode=REFERENCE) -> dict[int, list[int]]:
    """Greedy ids of a staggered continuous batch on the paged KV cache (4-token blocks: rows span several)."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 151000, n).tolist() for n in (4, 19, 1, 11, 7)]
    engine = Engine(state, EngineConfig.of(max_batch=3, max_len=48, prefill_chunk=8, compile_decode=compiled,
                                           bucket_shapes=True, decode_path=decode, block_size=4))
    assert engine.decode_backend is decode
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    arrivals = {0: [0, 1], 2: [2], 5: [3, 4]}  # staggered, more requests than slots
    for step in range(300):
        for i in arrivals.get(step, []):
            engine.add(i, prompts[i], SamplingParams(max_new_tokens=9, eos_token_ids=()))
        for ev in engine.step():
            out[ev.seq_id].append(ev.token_id)
        if step > 5 and not engine.num_active:
            return out
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_wiring_equals_generic_path(tiny32, compiled):
    """The fused decode reads the paged cache through the block table and generates what the
    generic path does."""
    fused = _generate(tiny32, compiled)
    generic = _generate(tiny32, False, decode=GenericDecode())
    assert fused == generic
    assert all(len(ids) == 9 for ids in fused.values())


def test_fused_path_is_taken(tiny32):
    """Guard against the test above passing vacuously: a broken kernel changes the output."""
    broken = FusedDecode(attention=ref_decode_attention, add_rms_norm=ref_add_rms_norm,
                         swiglu=lambda gu: ref_swiglu(gu) * 0.5)
    assert _generate(tiny32, False, decode=broken) != _generate(tiny32, False, decode=GenericDecode())


def test_decode_backend_is_chosen_once_by_name_or_default(tiny32):
    """The default is the fused path where the kernels run, else the matmul path; names pick a backend; "fused" falls
    back to the generic path for a config the kernels do not implement; a bad name is refused."""
    from mlx_serving.models.decoder import cuda_kernels

    assert decode_backend(tiny32).name == ("fused" if cuda_kernels.kernels_available() else "matmul")
    assert decode_backend(tiny32, "sdpa") == GenericDecode(sdpa=True)
    assert isinstance(decode_backend(tiny32, "fused"), FusedDecode)  # Qwen3: q/k norm, plain RoPE
    assert decode_backend(tiny32, REFERENCE) is REFERENCE
    llama_like = SimpleNamespace(config=replace(tiny32.config, qk_norm=False))
    assert isinstance(decode_backend(llama_like, "fused"), FusedDecode)  # no q/k norm: the kernels skip it
    scaled = SimpleNamespace(config=replace(tiny32.config, rope_traditional=True))
    assert decode_backend(scaled, "fused") == GenericDecode()
    with pytest.raises(ValueError, match="decode_path must be one of"):
        decode_backend(tiny32, "flash")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_wiring_serves_a_family_without_qk_norm(tmp_path, compiled):
    """A Llama-family model (no q/k norm, attention and MLP biases, untied head) through the fused
    backend (reference kernels) generates what the generic path does."""
    from mlx_serving.models.loader import load
    from mlx_serving.models.seeded_checkpoint import write_checkpoint

    path = write_checkpoint(tmp_path / "llama", family="llama", quantized=False, dtype="float32", seed=2,
                            tie_word_embeddings=False,
                            config_overrides={"attention_bias": True, "mlp_bias": True, "rope_scaling": None,
                                                "num_attention_heads": 2, "num_key_value_heads": 1})
    llama = load(path)
    assert not llama.config.qk_norm
    assert _generate(llama, compiled) == _generate(llama, False, decode=GenericDecode())


def quantized_256(tmp_path, dtype: str):
    """A tiny Qwen3 whose projections :func:`cuda_gemv.qmv` takes: 4-bit, inputs multiples of 256."""
    from mlx_serving.models.loader import load
    from mlx_serving.models.seeded_checkpoint import write_checkpoint

    return load(write_checkpoint(tmp_path / f"q256-{dtype}", "tiny", seed=4, dtype=dtype,
                                 config_overrides={"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_qmv_wiring_equals_generic_path(tmp_path, compiled):
    """With 4-bit weights and few rows the fused backend folds norms, residual adds and SwiGLU into
    its products (reference qmv here): the same greedy ids as the generic path; the folded path is
    taken (a broken qmv changes them)."""
    state = quantized_256(tmp_path, "float32")
    assert qmv_fits(state, 1, state.dtype) and not qmv_fits(state, 2, state.dtype)
    folded = replace(REFERENCE, qmv=ref_qmv, attention_o=ref_attention_o_proj)
    generic = _generate(state, False, decode=GenericDecode())
    assert _generate(state, compiled, decode=folded) == generic

    def broken(x, lin, **kw):
        return ref_qmv(x, lin, **kw) * (0.5 if kw.get("glu") else 1.0)

    assert _generate(state, False, decode=replace(folded, qmv=broken)) != generic
