"""The one helper per concern: cache directory, import by name, im2col, tree-map, timing."""

import collections
import os
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparsekit.imports import import_object
from sparsekit.io.cache import cache_root
from sparsekit.nn.calibration import feed, to_device, tree_map
from sparsekit.nn.calibration import conv_columns, im2col


def test_one_cache_variable(tmp_path, monkeypatch):
    from sparsekit.accel import algsearch, planner

    monkeypatch.setenv("SPARSEKIT_CACHE", str(tmp_path / "new"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current variable does not warn
        assert algsearch.cache_path() == tmp_path / "new" / "cusparselt_algs.json"
        assert planner.cache_path().parent == cache_root() == tmp_path / "new"
    assert cache_root(tmp_path / "given") == tmp_path / "given"


def test_import_by_name_only_for_typed_options():
    assert import_object("torch.nn.Linear", "model._target_") is nn.Linear
    with pytest.raises(ValueError, match=r"model._target_='nosuch_mod.f' cannot be imported: "
                                         r"No module named 'nosuch_mod'"):
        import_object("nosuch_mod.f", "model._target_")
    with pytest.raises(ValueError, match="importable from module 'torch.nn'"):
        import_object("torch.nn.NoSuchLayer", "data._target_")
    with pytest.raises(ValueError, match="only model._target_, data._target_ may name code"):
        import_object("os.system", "checkpoint.builder")


@pytest.mark.parametrize("dims, stride, dilation", [(1, 2, 1), (2, 1, 2), (2, 2, 1)])
def test_im2col_matches_unfold_and_conv(dims, stride, dilation):
    torch.manual_seed(0)
    x = torch.randn(2, 3, *([9] * dims))
    k = (3,) * dims
    cols = im2col(x, k, (stride,) * dims, (dilation,) * dims)[0]
    if dims == 2:
        ref = F.unfold(x, k, dilation=dilation, stride=stride).transpose(1, 2).reshape(
            cols.shape[0], -1)
        torch.testing.assert_close(cols, ref)
    conv = (nn.Conv1d, nn.Conv2d)[dims - 1](3, 4, 3, stride=stride, dilation=dilation,
                                            bias=False)
    y = conv(x)
    got = (cols @ conv.weight.flatten(1).T).reshape(2, -1, 4).transpose(1, 2)
    torch.testing.assert_close(got.reshape(y.shape), y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv_columns(conv, x)[0], cols)


def test_quantized_conv_im2col_path_matches_its_dequantized_reference():
    from sparsekit.quant.modules import QuantConv

    torch.manual_seed(0)
    for conv, x in ((nn.Conv1d(4, 8, 3, stride=2, padding=1), torch.randn(2, 4, 17)),
                    (nn.Conv2d(4, 8, 3, dilation=2, padding="same"), torch.randn(2, 4, 9, 9))):
        q = QuantConv.from_float(conv, "int8")
        ref = conv._conv_forward(x, q.dequantized_weight(), conv.bias)
        err = (q(x) - ref).norm() / ref.norm()
        assert err < 0.02


@dataclasses.dataclass
class _Out:
    y: torch.Tensor
    extra: tuple


def test_one_tree_map_for_batches_inputs_and_outputs():
    Pair = collections.namedtuple("Pair", "a b")
    tree = {"x": [torch.ones(1), Pair(torch.ones(2), 3)],
            "o": _Out(torch.ones(1), (torch.ones(1),))}
    out = tree_map(lambda t: t * 2, tree)
    assert isinstance(out["x"][1], Pair) and out["x"][1].b == 3
    assert isinstance(out["o"], _Out) and out["o"].extra[0].item() == 2.0
    assert to_device(Pair(torch.ones(1), None), "cpu").a.device.type == "cpu"


def test_feed_calls_a_model_the_way_calibration_does():
    class Kw(nn.Module):
        def forward(self, a, b=0):
            return a + b

    m = Kw()
    assert feed(m, torch.ones(1)).item() == 1
    assert feed(m, (torch.ones(1), 2)).item() == 3
    assert feed(m, {"a": torch.ones(1), "b": 4}).item() == 5


def test_only_the_command_line_sets_nccl_variables(monkeypatch):
    from sparsekit.run import distributed as D

    for key in D.NO_MULTICAST_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    D.set_launch_env()  # not under torchrun: nothing to set
    assert not any(k in os.environ for k in D.NO_MULTICAST_ENV)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # the user's own choice is kept
    D.set_launch_env()
    assert os.environ["NCCL_NVLS_ENABLE"] == "1"
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1"
    import inspect

    source = inspect.getsource(D.init)  # reads LOCAL_RANK, writes nothing
    assert "setdefault" not in source and "os.environ[" not in source
