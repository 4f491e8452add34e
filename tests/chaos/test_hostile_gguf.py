"""Hostile GGUF files: every malformed header is a GGUFError (a ValueError) naming the file and
what is wrong, raised before MLX's own reader touches the file; nothing crashes, hangs or
allocates what a header merely declares; a file that does convert is loaded like any checkpoint."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_serving.models import gguf as G
from mlx_serving.models.gguf_file import MAX_ARRAY, MAX_KV, GGUFError, read_header

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from gguf_files import Shape, write_gguf  # noqa: E402


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _file(kv: bytes = b"", n_kv: int = 0, tensors: bytes = b"", n_tensors: int = 0, data: bytes = b"",
          magic: bytes = b"GGUF", version: int = 3) -> bytes:
    head = magic + struct.pack("<IQQ", version, n_tensors, n_kv) + kv + tensors
    return head + b"\0" * (-len(head) % 32) + data


def _tensor(name: str, dims: list[int], kind: int, offset: int) -> bytes:
    return _s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", kind, offset)


CASES = {
    "empty": (b"", "too short"),
    "magic": (_file(magic=b"GGML") + b"\0" * 8, "not a GGUF file"),
    "version": (_file(version=7), "version 7 is not supported"),
    "tensor count": (b"GGUF" + struct.pack("<IQQ", 3, 2**63, 0) + b"\0" * 16, "tensor count is"),
    "kv count": (b"GGUF" + struct.pack("<IQQ", 3, 0, MAX_KV + 1) + b"\0" * 16, "metadata count is"),
    "key length": (_file(kv=struct.pack("<Q", 2**62), n_kv=1), "metadata key length is"),
    "truncated": (_file(kv=_s("general.name") + struct.pack("<I", 8) + struct.pack("<Q", 50) + b"abc", n_kv=1),
                  "truncated"),
    "array length": (_file(kv=_s("a") + struct.pack("<IIQ", 9, 4, MAX_ARRAY + 1), n_kv=1), "array length of 'a'"),
    "value type": (_file(kv=_s("a") + struct.pack("<I", 99), n_kv=1), "value type 99"),
    "nested array": (_file(kv=_s("a") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 4, 0), n_kv=1),
                     "value type 9"),
    "non-utf8 key": (_file(kv=_s(b"\xff\xfe") + struct.pack("<I", 4) + b"\0" * 4, n_kv=1), "not UTF-8"),
    "duplicate key": (_file(kv=(_s("a") + struct.pack("<II", 4, 1)) * 2, n_kv=2), "'a' appears twice"),
    "dims": (_file(tensors=_tensor("t", [1] * 5, 0, 0), n_tensors=1), "5 dimensions"),
    "zero dim": (_file(tensors=_tensor("t", [0, 4], 0, 0), n_tensors=1), "dimensions"),
    "unknown type": (_file(tensors=_tensor("t", [4], 99, 0), n_tensors=1), "ggml type 99, which is not known"),
    "iq type": (_file(tensors=_tensor("t", [256], int(T.IQ2_XXS), 0), n_tensors=1), "IQ2_XXS"),
    "outside": (_file(tensors=_tensor("t", [1024, 1024], 0, 0), n_tensors=1, data=b"\0" * 64), "outside the file"),
    "unaligned": (_file(tensors=_tensor("t", [4], 0, 3), n_tensors=1, data=b"\0" * 64), "not aligned"),
    "block": (_file(tensors=_tensor("t", [31], int(T.Q4_0), 0), n_tensors=1, data=b"\0" * 64),
              "not a multiple of its block of 32"),
    "duplicate tensor": (_file(tensors=_tensor("t", [4], 0, 0) * 2, n_tensors=2, data=b"\0" * 64), "appears twice"),
    "alignment": (_file(kv=_s("general.alignment") + struct.pack("<II", 4, 0), n_kv=1), "general.alignment"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_malformed_header_is_named(tmp_path: Path, name: str) -> None:
    raw, message = CASES[name]
    path = tmp_path / "bad.gguf"
    path.write_bytes(raw)
    with pytest.raises(GGUFError, match=message) as exc:
        G.convert(path, tmp_path / "out")
    assert str(path) in str(exc.value)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "ok.gguf"
    write_gguf(path, Shape(layers=1), T.Q4_0)
    return path.read_bytes()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_headers_raise_a_value_error_or_parse(valid: bytes, tmp_path: Path, data: st.DataObject) -> None:
    """Flip bytes anywhere in the header: parsing and building the config and the tokenizer
    either succeed or raise a ValueError (GGUFError, TokenizationError) naming the file or key."""
    header_end = 4096
    raw = bytearray(valid)
    for _ in range(data.draw(st.integers(1, 8))):
        raw[data.draw(st.integers(0, header_end))] = data.draw(st.integers(0, 255))
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(bytes(raw))
    try:
        header = read_header(path)
        G.hf_config(header)
        G.tokenizer_files(header.metadata)
    except ValueError:
        pass


def test_a_corrupted_file_that_parses_converts_or_fails_cleanly(valid: bytes, tmp_path: Path) -> None:
    """Truncations and a zeroed data section in a separate process: it exits 0 or with a Python
    error (exit 1), never killed by a signal."""
    cases = {"truncated": valid[: len(valid) - 100], "zeroed": valid[:4096] + b"\0" * (len(valid) - 4096)}
    for name, raw in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(raw)
        done = subprocess.run([sys.executable, "-c", "import sys; from mlx_serving.models import gguf; "
                               "gguf.convert(sys.argv[1], sys.argv[2])", str(path), str(tmp_path / name)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode in (0, 1), (name, done.returncode, done.stderr[-2000:])
        if done.returncode:
            assert "GGUFError" in done.stderr or "ValueError" in done.stderr, done.stderr[-2000:]
