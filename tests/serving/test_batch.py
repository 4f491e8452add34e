import numpy as np
import pytest

from mlx_serving.serving import Batch


def test_stack_adds_leading_axis_and_concatenate_keeps_it():
    b = Batch.stack([np.array([1, 2]), np.array([3, 4])])
    assert b.size == 2 and b.data.shape == (2, 2)
    c = Batch.concatenate([np.ones((3, 2)), np.zeros((1, 2))])
    assert c.size == 4 and c.data[3].tolist() == [0, 0]


def test_dicts_and_ragged_python_rows():
    d = Batch.stack([{"ids": np.array([1, 2]), "mask": np.array([1, 1])}] * 3)
    assert d.size == 3 and d.data["ids"].shape == (3, 2)
    r = Batch.stack([[1, 2, 3], [4]])
    assert r.size == 2 and r.data == [[1, 2, 3], [4]]
    assert Batch.concatenate([[[1], [2, 3]], [[4]]]).data == [[1], [2, 3], [4]]
    assert d.rows()[1]["ids"].tolist() == [1, 2]
    mixed = Batch.merge([Batch.stack([{"ids": [1, 2], "max_new": 4}]), Batch.stack([{"ids": [3], "max_new": 1}])])
    assert mixed.size == 2 and mixed.rows() == [{"ids": [1, 2], "max_new": 4}, {"ids": [3], "max_new": 1}]


def test_mlx_arrays_are_joined_with_mlx():
    mx = pytest.importorskip("mlx.core")
    b = Batch.merge([Batch.stack([mx.array([1.0, 2.0])]), Batch.stack([mx.array([3.0, 4.0])])])
    assert isinstance(b.data, mx.array) and b.data.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_merge_split_pad_and_key():
    a = Batch.concatenate([np.arange(3)]).key("k")
    b = Batch.concatenate([np.arange(3, 5)]).key("k")
    m = Batch.merge([a, b])
    assert m.batch_key == "k" and m.data.tolist() == [0, 1, 2, 3, 4]
    left, right = m.split(4)
    assert left.data.tolist() == [0, 1, 2, 3] and right.data.tolist() == [4]
    assert left.batch_key == right.batch_key == "k"
    whole, rest = m.split(9)
    assert whole.size == 5 and rest is None
    padded = m.pad(3)
    assert padded.size == 5 and padded.data.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    assert padded.pad(1).data.shape == (6,)  # pad sets, not adds
    assert Batch.stack([[1], [2]]).pad(1).data == [[1], [2], None]


def test_errors_name_both_sides():
    with pytest.raises(ValueError, match="empty"):
        Batch.stack([])
    with pytest.raises(ValueError, match=r"\(3,\).*\(4,\)"):
        Batch.merge([Batch.stack([np.zeros(3)]), Batch.stack([np.zeros(4)])])
    with pytest.raises(ValueError, match="'a'.*'b'"):
        Batch.merge([Batch.stack([np.zeros(3)]).key("a"), Batch.stack([np.zeros(3)]).key("b")])
    with pytest.raises(ValueError, match="float64.*int64"):
        Batch.concatenate([np.zeros(2), np.zeros(2, dtype=np.int64)])
    with pytest.raises(ValueError, match="scalar"):
        Batch.concatenate([np.array(1.0)])
    with pytest.raises(ValueError, match="scalar"):
        Batch.concatenate([3])
    with pytest.raises(ValueError, match="plain Python rows"):
        Batch.stack([np.zeros(2), [1, 2]])
