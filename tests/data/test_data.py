"""Built-in data: MNIST-1D from the reference generator (cached), the stdlib byte corpus."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsekit.data import build_data, check_data_name
from sparsekit.data.mnist1d import generate
from sparsekit.data.text import ByteWindows


def test_mnist1d_matches_reference_generator_and_is_cached(tmp_path):
    from mnist1d.data import get_dataset_args, make_dataset

    bundle = build_data("mnist1d", kwargs={"num_samples": 200}, cache_dir=tmp_path)
    args = get_dataset_args()
    args.num_samples = 200
    ref = make_dataset(args)
    x, y = bundle.train.tensors
    assert x.shape == (160, 1, 40) and x.dtype == torch.float32 and y.dtype == torch.int64
    np.testing.assert_allclose(x.squeeze(1).numpy(), ref["x"].astype(np.float32))
    np.testing.assert_array_equal(bundle.eval.tensors[1].numpy(), ref["y_test"])
    files = list((tmp_path / "data").glob("mnist1d_*.npz"))
    assert len(files) == 1
    again = build_data("mnist1d", kwargs={"num_samples": 200}, cache_dir=tmp_path)
    assert torch.equal(again.train.tensors[0], x)


def test_generate_leaves_numpy_global_rng_alone():
    np.random.seed(7)
    expected = np.random.rand()
    np.random.seed(7)
    generate(num_samples=20)
    assert np.random.rand() == expected


def test_stdlib_text_windows(tmp_path):
    bundle = build_data("stdlib_text", kwargs={"seq_len": 16, "max_bytes": 4000},
                        cache_dir=tmp_path)
    x, y = bundle.train[3]
    assert x.shape == y.shape == (16,) and x.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])  # targets are the next bytes
    assert bundle.info["vocab_size"] == 256
    assert len(bundle.train) == (3600 - 1) // 16 and len(bundle.eval) == (400 - 1) // 16
    text = bytes(bundle.train.data[:2000].tolist()).decode("utf-8", "replace")
    assert "def " in text or "import " in text


def test_byte_windows_do_not_overlap():
    w = ByteWindows(torch.arange(33, dtype=torch.uint8), 8)
    assert len(w) == 4
    assert w[1][0].tolist() == list(range(8, 16)) and w[3][1].tolist() == list(range(25, 33))


def make_pair(n: int = 8):
    ds = torch.utils.data.TensorDataset(torch.zeros(n, 3), torch.zeros(n).long())
    return ds, ds


def test_target_and_bad_name():
    bundle = build_data("x", target=f"{__name__}.make_pair", kwargs={"n": 5})
    assert len(bundle.train) == 5
    with pytest.raises(ValueError, match="data.name='cifar'.*mnist1d, stdlib_text"):
        check_data_name("cifar")
    with pytest.raises(ValueError, match="data._target_"):
        build_data("x", target="no_such_module.fn")
