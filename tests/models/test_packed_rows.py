"""The tied embedding's lookup read from the head's packed copy (issue 42): ``packed_rows``
(``decoder/cpu/embed_rows.cpp``) is bit for bit MLX's dequantized rows of the table the matrix was
packed from, for every layout the native path packs; the native path's kept model holds no MLX
table of a tied head, and its lookup equals the loaded model's."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_serving.models import native
from mlx_serving.models.decoder.cpu import native_decode
from mlx_serving.models.decoder.cpu.prefill import PackedEmbedding
from mlx_serving.models.decoder.layers import State
from mlx_serving.models.loader import load

pytestmark = pytest.mark.skipif(native.cpu_decode_module() is None or mx.default_device() != mx.cpu,
                                reason=f"the native CPU kernels are not available: {native.unavailable_reason()}")


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).view(np.uint32)  # -0.0 and 0.0 differ here


@pytest.mark.parametrize(("bits", "group", "half", "k"),
                         [(8, 32, False, 320), (4, 32, True, 448), (8, 64, True, 320), (4, 128, False, 384)])
def test_packed_rows_are_mlxs_dequantized_rows_bit_for_bit(bits: int, group: int, half: bool, k: int) -> None:
    """Rows of a (103, k) table (a last tile of 3 columns; k / 32 blocks: a whole group of 8 and a
    last one of 2, 6 or 4), ids of several shapes, negative ids counting from the end."""
    module = native.cpu_decode_module()
    table = mx.random.normal((103, k), key=mx.random.key(bits + group))
    w, scales, biases = mx.quantize(table, group_size=group, bits=bits)
    if half:  # as a GGUF's or an MLX float16 checkpoint's: float16 exactly
        scales, biases = (a.astype(mx.float16).astype(mx.float32) for a in (scales, biases))
    matrix = module.QMatrix(w, scales.astype(mx.float16) if half else scales,
                            biases.astype(mx.float16) if half else biases, None, bits, group)
    for ids in (mx.arange(103, dtype=mx.int32), mx.array([[5, 102], [0, -1]], mx.int32), mx.array([7], mx.uint32)):
        want = mx.dequantize(w[ids], scales[ids], biases[ids], group_size=group, bits=bits)
        got = module.packed_rows(matrix, ids)
        assert got.shape == (*ids.shape, k) and got.dtype == mx.float32
        assert np.array_equal(_bits(got), _bits(want))
    outside = module.packed_rows(matrix, mx.array([103, -104], mx.int32))
    assert not mx.any(outside).item()  # outside [-N, N): zeros, never a read past the matrix


def test_packed_rows_refuses_ids_that_are_not_integers() -> None:
    module = native.cpu_decode_module()
    w, s, b = mx.quantize(mx.ones((4, 32)), group_size=32, bits=8)
    with pytest.raises(ValueError, match="ids must be integers"):
        module.packed_rows(module.QMatrix(w, s, b, None, 8, 32), mx.array([0.5]))


def _check_kept_lookup(state: State) -> None:
    """The native path's model of ``state``: a tied head whose lookup is the packed head's rows (no
    MLX table), every row of the vocabulary bit for bit ``state``'s lookup."""
    assert state.embed_tokens is state.lm_head
    backend = native_decode(state)
    assert backend is not None
    kept = backend.prefill_state
    assert isinstance(kept.embed_tokens, PackedEmbedding) and kept.embed_tokens is kept.lm_head
    assert kept.lm_head.weight.size == kept.lm_head.scales.size == kept.lm_head.biases.size == 0
    ids = mx.arange(state.config.vocab_size, dtype=mx.int32)
    assert np.array_equal(_bits(kept.embed_tokens.rows(ids)), _bits(state.embed_tokens.rows(ids)))
    again = native_decode(kept)  # a model this made: its packed matrices (and lookup) kept
    assert again is not None and isinstance(again.prefill_state.embed_tokens, PackedEmbedding)


def test_the_kept_model_looks_up_the_tied_table_in_the_packed_head(tiny: State) -> None:
    """The tiny 4-bit checkpoint (bfloat16 scales in the file)."""
    _check_kept_lookup(tiny)


def test_smollm2s_8_bit_table_is_looked_up_in_the_packed_head(smollm2_dir: Path) -> None:
    """SmolLM2-135M's GGUF: an 8-bit tied table (Q8_0, float32 scales in MLX, float16 in the
    packed head), all 49,152 rows."""
    _check_kept_lookup(load(smollm2_dir))
