"""Checkpoints are untrusted input: a hostile or broken config.json, weight file, shard index or
symlink is refused at load with a typed error naming the field, tensor or file (ValueError;
KeyError / FileNotFoundError for what is missing), quickly and before anything is allocated
from it; never a segfault, a huge allocation or a raw TypeError / JSONDecodeError."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_serving.models.loader import load
from mlx_serving.models._checkpoint import LIMITS, MissingFieldError
from mlx_serving.models.families import read_config
from mlx_serving.models.families.qwen3 import config_from_dict
from mlx_serving.tokenization import data_path
from portable import peak_rss_kib

REF_CONFIG = json.loads(data_path("config.qwen3-0.6b-mlx-4bit.json").read_text())
FILES = ("config.json", "generation_config.json", "model.safetensors")


def _copy(src: Path, dst: Path) -> Path:
    """The model files of ``src`` (no tokenizer) copied into ``dst``."""
    dst.mkdir(parents=True)
    for name in FILES:
        shutil.copyfile(src / name, dst / name)
    return dst


def _config(d: Path) -> dict[str, Any]:
    return json.loads((d / "config.json").read_text())


def _set_config(d: Path, drop: tuple[str, ...] = (), **fields: Any) -> None:
    cfg = _config(d)
    cfg.update(fields)
    for k in drop:
        cfg.pop(k, None)
    (d / "config.json").write_text(json.dumps(cfg))


def _tensors(d: Path) -> dict[str, mx.array]:
    return dict(mx.load(str(d / "model.safetensors")))


def _save(d: Path, tensors: dict[str, mx.array]) -> None:
    mx.save_safetensors(str(d / "model.safetensors"), tensors, metadata={"format": "mlx"})


def _refused(d: Path, exc: type[BaseException], *patterns: str) -> str:
    """load(d) raises ``exc`` whose message holds every pattern, within a second of CPU time (not
    wall-clock time: other work on the cores cannot fail it)."""
    t0 = time.process_time()
    with pytest.raises(exc) as info:
        load(d)
    assert time.process_time() - t0 < 1.0
    message = str(info.value)
    for p in patterns:
        assert p in message, (p, message)
    return message


@pytest.fixture
def ckpt(tiny_ckpt: Path, tmp_path: Path) -> Path:
    return _copy(tiny_ckpt, tmp_path / "ckpt")


@pytest.fixture
def ckpt32(tiny32_ckpt: Path, tmp_path: Path) -> Path:
    return _copy(tiny32_ckpt, tmp_path / "ckpt32")


def test_the_copy_loads(ckpt):
    state = load(ckpt)
    assert state.config.vocab_size == state.embed_tokens.weight.shape[0] == 151936


# ---- config.json values ----------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
BAD_VALUES = [
    # absurd sizes: used to size the KV cache (10**6 KV heads tried ~66 GB and segfaulted)
    ("num_key_value_heads", 10**6), ("head_dim", 10**7), ("num_hidden_layers", 10**9),
    ("vocab_size", 10**12), ("hidden_size", 2**40), ("intermediate_size", 10**8),
    ("max_position_embeddings", 10**30), ("num_attention_heads", 10**5),
    # zero / negative
    ("num_attention_heads", 0), ("num_key_value_heads", -2), ("hidden_size", -64), ("head_dim", 0),
    ("vocab_size", 0),
    # wrong types: strings, floats, bools, containers
    ("hidden_size", "64"), ("hidden_size", 64.0), ("hidden_size", True), ("num_hidden_layers", [2]),
    ("intermediate_size", None), ("vocab_size", {"n": 151936}), ("head_dim", 32.5),
    ("tie_word_embeddings", "false"), ("tie_word_embeddings", 1),
    ("bos_token_id", "151643"), ("bos_token_id", -1),
    ("eos_token_id", "151645"), ("eos_token_id", [151645, 1.5]), ("eos_token_id", -3), ("eos_token_id", True),
    ("eos_token_id", {"id": 1}),
    # floats that are not finite / positive / numbers
    ("rope_theta", NAN), ("rope_theta", INF), ("rope_theta", -INF), ("rope_theta", -1e6), ("rope_theta", 0),
    ("rope_theta", "1e6"), ("rope_theta", True), ("rope_theta", 10**400),
    ("rms_norm_eps", NAN), ("rms_norm_eps", INF), ("rms_norm_eps", -1e-6), ("rms_norm_eps", 0),
    ("rms_norm_eps", 2.0), ("rms_norm_eps", "1e-6"),
    # structure
    ("num_key_value_heads", 3),  # does not divide 4 query heads
    ("head_dim", 33),  # odd: RoPE rotates pairs
    ("architectures", "Qwen3ForCausalLM"), ("architectures", [1, 2]), ("architectures", {"a": 1}),
    ("rope_parameters", "yarn"), ("rope_parameters", {"rope_type": "yarn", "factor": 4.0}),
    ("rope_scaling", {"type": "yarn", "factor": 4.0}),
]
QUANT_VALUES = [
    ({"group_size": 64, "bits": 7}, "bits"), ({"group_size": 64, "bits": 16}, "bits"),
    ({"group_size": 64, "bits": 0}, "bits"), ({"group_size": 64, "bits": "4"}, "bits"),
    ({"group_size": 64, "bits": 4.0}, "bits"), ({"group_size": 48, "bits": 4}, "group_size"),
    ({"group_size": 0, "bits": 4}, "group_size"), ({"group_size": -64, "bits": 4}, "group_size"),
    ({"group_size": 2**40, "bits": 4}, "group_size"), ({"group_size": None, "bits": 4}, "group_size"),
    ({"group_size": 64, "bits": 4, "mode": "mxfp4"}, "mxfp4"),
    ({"group_size": 64, "bits": 4, "mode": ["affine"]}, "mode"),
    ({"group_size": 64, "bits": 4, "lm_head": {"bits": 3.5}}, "bits"),
    ({"group_size": 64, "bits": 4, "model.embed_tokens": {"group_size": "64"}}, "group_size"),
    ([64, 4], "quantization"), ("4bit", "quantization"),
]


@pytest.mark.parametrize("field,value", BAD_VALUES, ids=[f"{f}={v!r}"[:40] for f, v in BAD_VALUES])
def test_bad_config_value_is_named(ckpt, field, value):
    _set_config(ckpt, **{field: value})
    message = _refused(ckpt, ValueError, "config.json", field)
    assert not isinstance(value, str) or len(message) < 500


@pytest.mark.parametrize("value,field", QUANT_VALUES, ids=[repr(v)[:40] for v, _ in QUANT_VALUES])
def test_bad_quantization_block_is_named(ckpt, value, field):
    _set_config(ckpt, quantization=value)
    _refused(ckpt, ValueError, "config.json", field)


def test_hidden_size_not_divisible_by_heads_without_head_dim(ckpt):
    _set_config(ckpt, drop=("head_dim",), num_attention_heads=6, num_key_value_heads=2)
    _refused(ckpt, ValueError, "hidden_size", "num_attention_heads")


def test_missing_field_is_a_key_error_and_a_value_error(ckpt):
    _set_config(ckpt, drop=("hidden_size",))
    _refused(ckpt, KeyError, "hidden_size")
    _refused(ckpt, ValueError, "hidden_size")
    assert issubclass(MissingFieldError, KeyError) and issubclass(MissingFieldError, ValueError)


def test_null_optional_fields_take_their_defaults(ckpt):
    """JSON null for an optional field means "absent", as before."""
    _set_config(ckpt, rms_norm_eps=None, max_position_embeddings=None, tie_word_embeddings=True,
                rope_theta=None, rope_scaling=None, quantization_config=None, architectures=None)
    c = load(ckpt).config
    assert (c.rms_norm_eps, c.rope_theta, c.max_position_embeddings) == (1e-6, 1_000_000.0, 40960)


# ---- config.json / generation_config.json files ----------------------------------------------

MALFORMED = {
    "not JSON": b"{\"hidden_size\": 64,",
    "empty": b"",
    "a JSON list": b"[1, 2, 3]",
    "a JSON string": b"\"config\"",
    "null": b"null",
    "invalid UTF-8": b"{\"model_type\": \"qwen3\xff\xfe\"}",
    "UTF-16": "{\"model_type\": \"qwen3\"}".encode("utf-16"),
    "deeply nested": b"[" * 200_000 + b"]" * 200_000,
    "NUL bytes": b"\x00" * 64,
}


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_json_file_is_a_named_value_error(ckpt, name, kind):
    (ckpt / name).write_bytes(MALFORMED[kind])
    _refused(ckpt, ValueError, name)


def test_oversized_config_is_refused_without_reading_it(ckpt):
    with open(ckpt / "config.json", "ab") as f:
        f.truncate(64 * 2**20)  # sparse: 64 MB of NULs after the JSON
    _refused(ckpt, ValueError, "config.json", "bytes")


@pytest.mark.parametrize("eos", ["<|im_end|>", [151645, "x"], 2**40, [None], {"a": 1}])
def test_bad_generation_config_eos(ckpt, eos):
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    _refused(ckpt, ValueError, "generation_config.json", "eos_token_id")


# ---- tensors against the config ----------------------------------------------------------------

SHAPE_MISMATCH = [
    # (config change, tensor named, config field named)
    ({"num_key_value_heads": 4}, "self_attn.k_proj", "num_key_value_heads"),
    ({"num_key_value_heads": 1}, "self_attn.k_proj", "num_key_value_heads"),
    ({"head_dim": 16}, "self_attn.q_norm", "head_dim"),
    ({"num_attention_heads": 8, "num_key_value_heads": 2}, "self_attn.q_proj", "num_attention_heads"),
    ({"hidden_size": 128}, "model.embed_tokens", "hidden_size"),
    ({"intermediate_size": 128}, "mlp.gate_proj", "intermediate_size"),
    ({"vocab_size": 200_000}, "model.embed_tokens", "vocab_size"),
    ({"vocab_size": 1000}, "model.embed_tokens", "vocab_size"),
    ({"quantization": {"group_size": 64, "bits": 8}}, "model.embed_tokens.weight", "8 bits"),
    ({"quantization": {"group_size": 32, "bits": 4}}, "model.embed_tokens.scales", "group_size 32"),
    ({"quantization": {"group_size": 128, "bits": 4}}, "model.embed_tokens", "group_size 128"),
]


@pytest.mark.parametrize("change,tensor,field", SHAPE_MISMATCH, ids=[repr(c)[:40] for c, _, _ in SHAPE_MISMATCH])
def test_config_that_disagrees_with_the_tensors(ckpt, change, tensor, field):
    _set_config(ckpt, **change)
    _refused(ckpt, ValueError, tensor, field)


def test_embedding_with_fewer_rows_than_vocab_size(ckpt):
    """A table shorter than vocab_size would let an id below vocab_size read out of bounds:
    refused (the embedding must have exactly vocab_size rows)."""
    t = _tensors(ckpt)
    for part in ("weight", "scales", "biases"):
        t[f"model.embed_tokens.{part}"] = t[f"model.embed_tokens.{part}"][:1000]
    _save(ckpt, t)
    _refused(ckpt, ValueError, "model.embed_tokens.weight", "(1000, 8)", "vocab_size = 151936")


def test_untied_head_must_match_too(ckpt):
    _set_config(ckpt, tie_word_embeddings=False)
    _refused(ckpt, KeyError, "lm_head.weight")
    t = _tensors(ckpt)
    t["lm_head.weight"] = mx.zeros((151936, 32), dtype=mx.bfloat16)
    _save(ckpt, t)
    _refused(ckpt, ValueError, "lm_head.weight", "hidden_size = 64")


def test_more_layers_than_stored(ckpt):
    _set_config(ckpt, num_hidden_layers=3)
    _refused(ckpt, KeyError, "model.layers.2.")


@pytest.mark.parametrize("name,value,pattern", [
    ("model.norm.weight", mx.zeros((64,), dtype=mx.int32), "dtype I32"),
    ("model.layers.0.input_layernorm.weight", mx.zeros((64, 1), dtype=mx.bfloat16), "shape (64, 1)"),
    ("model.layers.1.self_attn.k_norm.weight", mx.zeros((31,), dtype=mx.bfloat16), "head_dim = 32"),
    ("model.layers.0.self_attn.v_proj.weight", mx.zeros((64, 8), dtype=mx.float32), "dtype F32"),
    ("model.layers.0.self_attn.v_proj.scales", mx.zeros((64, 2), dtype=mx.bfloat16), "(64, 2)"),
    ("model.layers.0.self_attn.v_proj.biases", mx.zeros((64, 1), dtype=mx.uint32), "dtype U32"),
    ("model.layers.1.mlp.down_proj.weight", mx.zeros((64, 24, 1), dtype=mx.uint32), "shape (64, 24, 1)"),
    ("model.embed_tokens.scales", mx.zeros((151936, 1), dtype=mx.int8), "dtype I8"),
])
def test_tensor_of_wrong_shape_or_dtype(ckpt, name, value, pattern):
    t = _tensors(ckpt)
    t[name] = value
    _save(ckpt, t)
    _refused(ckpt, ValueError, repr(name), pattern)


def test_missing_biases_of_a_quantized_module(ckpt):
    t = _tensors(ckpt)
    del t["model.layers.0.mlp.up_proj.biases"]
    _save(ckpt, t)
    _refused(ckpt, KeyError, "model.layers.0.mlp.up_proj.biases")


def test_scales_on_a_module_the_config_keeps_dense(ckpt):
    _set_config(ckpt, quantization={"group_size": 64, "bits": 4, "model.layers.0.mlp.up_proj": False})
    _refused(ckpt, ValueError, "model.layers.0.mlp.up_proj")


def test_dense_checkpoint_shapes_are_checked(ckpt32):
    _set_config(ckpt32, num_key_value_heads=4)
    _refused(ckpt32, ValueError, "model.layers.0.self_attn.k_proj.weight", "(128, 64)", "num_key_value_heads")
    _set_config(ckpt32, num_key_value_heads=2)
    t = _tensors(ckpt32)
    t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"].T
    _save(ckpt32, t)
    _refused(ckpt32, ValueError, "model.layers.0.mlp.down_proj.weight", "(192, 64)", "intermediate_size")


def test_bad_dtype_argument(ckpt):
    for dtype in ("float64", "int8", "__class__", 3, mx.int32):
        with pytest.raises(ValueError, match="dtype"):
            load(ckpt, dtype=dtype)


# ---- weight files --------------------------------------------------------------------------

def _header(path: Path) -> tuple[dict[str, Any], bytes]:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def _write(path: Path, header: dict[str, Any], body: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def _hostile_header(edit):
    def apply(path: Path) -> None:
        header, body = _header(path)
        edit(header["model.norm.weight"], header)
        _write(path, header, body)
    return apply


WEIGHT_FILES = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "three bytes": lambda p: p.write_bytes(b"abc"),
    "empty": lambda p: p.write_bytes(b""),
    "header length 2**60": lambda p: p.write_bytes(struct.pack("<Q", 2**60) + b"{}"),
    "header length past the end": lambda p: p.write_bytes(struct.pack("<Q", 1000) + b"{}"),
    "header not JSON": lambda p: p.write_bytes(struct.pack("<Q", 4) + b"{{{{"),
    "header a list": lambda p: p.write_bytes(struct.pack("<Q", 2) + b"[]"),
    "header invalid UTF-8": lambda p: p.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc"),
    "huge shape": _hostile_header(lambda e, h: e.update(shape=[2**40, 2**40])),
    "negative shape": _hostile_header(lambda e, h: e.update(shape=[-64])),
    "float shape": _hostile_header(lambda e, h: e.update(shape=[64.0])),
    "unknown dtype": _hostile_header(lambda e, h: e.update(dtype="F128")),
    "offsets past the end": _hostile_header(lambda e, h: e.update(data_offsets=[0, 2**62])),
    "offsets reversed": _hostile_header(lambda e, h: e.update(data_offsets=e["data_offsets"][::-1])),
    "offsets wrong length": _hostile_header(
        lambda e, h: e.update(data_offsets=[e["data_offsets"][0], e["data_offsets"][0] + 2])),
    "entry not an object": _hostile_header(lambda e, h: h.update({"model.norm.weight": [1, 2]})),
    "131 dimensions": _hostile_header(lambda e, h: e.update(shape=[1] * 131)),
}


@pytest.mark.parametrize("kind", list(WEIGHT_FILES))
def test_malformed_weight_file_is_named(ckpt, kind):
    WEIGHT_FILES[kind](ckpt / "model.safetensors")
    _refused(ckpt, ValueError, "model.safetensors")


# ---- shards and symlinks: nothing outside the checkpoint directory ------------------------------

def _shard(d: Path, names: list[Any]) -> None:
    """An index mapping the tensors over ``names`` (round robin)."""
    keys = sorted(_header(d / "model.safetensors")[0].keys() - {"__metadata__"})
    weight_map = {k: names[i % len(names)] for i, k in enumerate(keys)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("shard", ["../outside.safetensors", "sub/../../outside.safetensors"])
def test_shard_path_leaving_the_directory(ckpt, shard):
    shutil.copyfile(ckpt / "model.safetensors", ckpt.parent / "outside.safetensors")
    _shard(ckpt, [shard])
    _refused(ckpt, ValueError, repr(shard), "outside the checkpoint directory")


def test_absolute_shard_path(ckpt):
    outside = ckpt.parent / "abs.safetensors"
    shutil.copyfile(ckpt / "model.safetensors", outside)
    _shard(ckpt, ["model.safetensors", str(outside)])
    _refused(ckpt, ValueError, str(outside), "outside the checkpoint directory")
    _shard(ckpt, ["/etc/passwd"])
    _refused(ckpt, ValueError, "/etc/passwd")


@pytest.mark.parametrize("index", [
    {"weight_map": {"model.norm.weight": 7}},
    {"weight_map": {"model.norm.weight": ["a.safetensors"]}},
    {"weight_map": {"model.norm.weight": "a\x00b.safetensors"}},
    {"weight_map": {"model.norm.weight": ""}},
    {"weight_map": ["model.safetensors"]},
    {"weight_map": {}},
    {"metadata": {}},
    ["model.safetensors"],
])
def test_malformed_index(ckpt, index):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(ckpt, ValueError, "model.safetensors")


def test_index_not_json(ckpt):
    (ckpt / "model.safetensors.index.json").write_bytes(b"\xff{")
    _refused(ckpt, ValueError, "model.safetensors.index.json")


def test_shard_symlink_leaving_the_directory(ckpt):
    outside = ckpt.parent / "elsewhere.safetensors"
    (ckpt / "model.safetensors").rename(outside)
    (ckpt / "model.safetensors").symlink_to(outside)
    _refused(ckpt, ValueError, "model.safetensors", "outside the checkpoint directory")
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").symlink_to("../elsewhere.safetensors")
    _refused(ckpt, ValueError, "outside the checkpoint directory")
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").symlink_to("/dev/zero")
    _refused(ckpt, ValueError, "outside the checkpoint directory")


def test_sharded_symlink_leaving_the_directory(ckpt):
    outside = ckpt.parent / "elsewhere.safetensors"
    shutil.copyfile(ckpt / "model.safetensors", outside)
    (ckpt / "shard-1.safetensors").symlink_to(outside)
    _shard(ckpt, ["shard-1.safetensors"])
    _refused(ckpt, ValueError, "'shard-1.safetensors'", "outside the checkpoint directory")


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "model.safetensors.index.json"])
def test_json_symlink_leaving_the_directory(ckpt, name):
    outside = ckpt.parent / f"outside-{name}"
    source = ckpt / name if (ckpt / name).exists() else None
    outside.write_text(source.read_text() if source else json.dumps({"weight_map": {"x": "model.safetensors"}}))
    if source:
        source.unlink()
    (ckpt / name).symlink_to(outside)
    _refused(ckpt, ValueError, name, "outside the checkpoint directory")


def test_symlink_loop(ckpt):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").symlink_to("loop.safetensors")
    (ckpt / "loop.safetensors").symlink_to("model.safetensors")
    _refused(ckpt, ValueError, "model.safetensors")
    (ckpt / "generation_config.json").unlink()
    (ckpt / "generation_config.json").symlink_to("generation_config.json")
    _refused(ckpt, ValueError, "generation_config.json")


def test_symlinks_inside_the_directory_load(ckpt):
    (ckpt / "real").mkdir()
    (ckpt / "model.safetensors").rename(ckpt / "real" / "weights.safetensors")
    (ckpt / "model.safetensors").symlink_to("real/weights.safetensors")
    (ckpt / "config.json").rename(ckpt / "real" / "config.json")
    (ckpt / "config.json").symlink_to(ckpt / "real" / "config.json")
    assert load(ckpt).config.hidden_size == 64
    _shard(ckpt, ["real/weights.safetensors"])
    assert load(ckpt).config.hidden_size == 64


def test_a_symlinked_checkpoint_directory_loads(ckpt, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(ckpt, target_is_directory=True)
    assert load(link).config.hidden_size == 64


def test_hugging_face_cache_layout_loads(ckpt, tmp_path):
    """The hub cache keeps files in <repo>/blobs and symlinks them from
    <repo>/snapshots/<revision>/: those links leave the snapshot, into its own repo's blobs."""
    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, name in enumerate(FILES):
        shutil.copyfile(ckpt / name, blobs / f"blob{i}")
        (snap / name).symlink_to(f"../../blobs/blob{i}")
    assert load(snap).config.hidden_size == 64
    (snap / "model.safetensors").unlink()  # but not into another repo's blobs
    other = tmp_path / "models--evil--x" / "blobs"
    other.mkdir(parents=True)
    shutil.copyfile(ckpt / "model.safetensors", other / "b")
    (snap / "model.safetensors").symlink_to(other / "b")
    _refused(snap, ValueError, "outside the checkpoint directory")


def test_hugging_face_cache_with_a_symlinked_blobs_folder_is_refused(ckpt, tmp_path):
    """A ``blobs`` folder that is itself a symlink (to ``/``, or to a folder holding the files) would
    let the snapshot's links read from anywhere: only a real ``<repo>/blobs`` directory is allowed."""
    repo = tmp_path / "models--org--tiny"
    snap, elsewhere = repo / "snapshots" / "0123abc", tmp_path / "elsewhere"
    snap.mkdir(parents=True)
    elsewhere.mkdir()
    for i, name in enumerate(FILES):
        shutil.copyfile(ckpt / name, elsewhere / f"blob{i}")
        (snap / name).symlink_to(f"../../blobs/blob{i}")
    (repo / "blobs").symlink_to(elsewhere, target_is_directory=True)
    _refused(snap, ValueError, "outside the checkpoint directory")
    (repo / "blobs").unlink()
    (repo / "blobs").symlink_to("/", target_is_directory=True)
    (snap / "config.json").unlink()
    (snap / "config.json").symlink_to("../../blobs" + str(elsewhere / "blob0"))
    _refused(snap, ValueError, "outside the checkpoint directory")


# ---- fuzz: any config.json value gives a config or a ValueError -------------------------------

INT_FIELDS = [k for k, v in REF_CONFIG.items() if isinstance(v, int) and not isinstance(v, bool)]
FIELDS = sorted(set(INT_FIELDS) | {"rope_theta", "rms_norm_eps", "tie_word_embeddings", "quantization",
                                   "architectures", "model_type", "rope_parameters", "rope_scaling"})
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(min_value=-(2**70), max_value=2**70) | st.sampled_from([0, 1, 2, 4, 32, 64, 128, 2**31])
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["bits", "group_size", "mode", "rope_type", "rope_theta", "lm_head"]), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, min_size=1, max_size=4))
def test_fuzz_config_values(changes):
    raw = dict(REF_CONFIG, **changes)
    try:
        cfg = config_from_dict(raw, where="config.json")
    except ValueError as exc:  # MissingFieldError included
        assert "config.json" in str(exc)
        return
    for name, hi in LIMITS.items():
        value = getattr(cfg, name)
        assert type(value) is int and 1 <= value <= hi, (name, value)
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0 and cfg.head_dim % 2 == 0
    assert math.isfinite(cfg.rope_theta) and cfg.rope_theta >= 1
    assert math.isfinite(cfg.rms_norm_eps) and 0 < cfg.rms_norm_eps <= 1
    assert isinstance(cfg.tie_word_embeddings, bool)
    assert all(type(i) is int and i >= 0 for i in cfg.eos_token_ids)
    if cfg.quantization is not None:
        for spec in [cfg.quantization.default, *cfg.quantization.overrides.values()]:
            assert spec is None or (spec.bits in (1, 2, 3, 4, 5, 6, 8) and spec.group_size in (32, 64, 128))


def test_read_config_names_the_file(ckpt):
    (ckpt / "config.json").write_text("[]")
    with pytest.raises(ValueError, match="config.json"):
        read_config(ckpt)
    os.remove(ckpt / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_config(ckpt)


def test_nothing_was_allocated_for_a_hostile_config(ckpt):
    """The 66 GB case: refused in config parsing, so peak memory stays small."""

    original = (ckpt / "config.json").read_text()
    before = peak_rss_kib()
    for field, value in (("num_key_value_heads", 10**6), ("head_dim", 10**7), ("num_hidden_layers", 10**6)):
        (ckpt / "config.json").write_text(original)
        _set_config(ckpt, **{field: value})
        _refused(ckpt, ValueError, field)
    assert peak_rss_kib() - before < 512 * 1024  # KiB: < 512 MB
    (ckpt / "config.json").write_text(original)
    assert np.isfinite(np.array(load(ckpt).norm.astype(mx.float32))).all()
