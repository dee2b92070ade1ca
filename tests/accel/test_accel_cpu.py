"""CPU tests of the accel package: planner decisions on recorded timings, skip reasons,
activation-quantization references, the converted modules, reports and the algorithm cache."""

import math

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.accel import algsearch
from sparsekit.accel.planner import layer_plan
from sparsekit.accel.convert import (
    ConvAsLinear,
    SplitMultiheadAttention,
    conv_skip_reason,
    mha_skip_reason,
)
from sparsekit.accel.report import AccelReport, LayerDecision, decide

# timings recorded on the H200 (us), 4096x11008 weight, 4096 tokens, best alg per variant
H200_LLAMA = {"bf16_dense": 465.4, "bf16_2:4": 326.0, "fp8_dense": 292.7, "fp8_2:4": 249.2}


def test_decide_picks_fastest_over_threshold():
    assert decide(H200_LLAMA) == ("fp8_2:4", pytest.approx(465.4 / 249.2))
    assert decide({"bf16_dense": 465.4, "bf16_2:4": 326.0}) == ("bf16_2:4",
                                                                 pytest.approx(465.4 / 326.0))
    # sparse slower than dense (M=64, ViT shape): dense stays
    assert decide({"bf16_dense": 8.7, "bf16_2:4": 11.7}) == ("bf16_dense", 1.0)
    # faster, but not by min_speedup
    assert decide({"bf16_dense": 100.0, "bf16_2:4": 95.0}, min_speedup=1.1) == ("bf16_dense", 1.0)
    # a tie keeps dense
    assert decide({"bf16_dense": 10.0, "bf16_2:4": 10.0}) == ("bf16_dense", 1.0)


def test_decide_never_slower_than_dense_on_random_timings():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        t = (torch.rand(4, generator=g) * 100 + 1).tolist()
        timings = dict(zip(["bf16_dense", "bf16_2:4", "fp8_dense", "fp8_2:4"], t))
        variant, speedup = decide(timings, min_speedup=1.0)
        assert timings[variant] <= timings["bf16_dense"]
        assert speedup == pytest.approx(timings["bf16_dense"] / timings[variant])
        assert timings[variant] == min(timings.values())


def test_decide_bad_inputs():
    with pytest.raises(ValueError, match="baseline"):
        decide({"bf16_2:4": 1.0})
    with pytest.raises(ValueError, match="min_speedup"):
        decide({"bf16_dense": 1.0}, min_speedup=0)


def test_layer_plan_candidates_and_reasons():
    assert layer_plan(True, "bf16", "2:4", 768, 3072) == (["bf16_dense", "bf16_2:4"], "2:4 pattern")
    assert layer_plan(True, "fp8", "auto", 768, 3072)[0] == [
        "bf16_dense", "fp8_dense", "bf16_2:4", "fp8_2:4"]
    assert layer_plan(True, "bf16", "auto", 768, 3072)[0] == ["bf16_dense", "bf16_2:4"]
    cands, why = layer_plan(False, "int8", "2:4", 768, 3072)
    assert cands == ["bf16_dense"] and "no 2:4" in why  # stays bf16 unless asked
    cands, why = layer_plan(False, "bf16", "2:4", 4096, 128256, dense_precision="fp8")
    assert cands == ["bf16_dense", "fp8_dense"] and "fp8 dense" in why  # an LM head, asked
    cands, why = layer_plan(True, "bf16", "2:4", 768, 1000)  # ViT head: 1000 classes
    assert cands == ["bf16_dense"] and "multiples of 32" in why
    assert layer_plan(True, "fp8", "dense", 64, 64)[0] == ["bf16_dense", "fp8_dense"]


def test_accelerate_validates_before_needing_cuda():
    model = nn.Linear(8, 8)
    with pytest.raises(ValueError, match="precision"):
        sk.accelerate(model, torch.randn(2, 8), precision="fp4")
    with pytest.raises(ValueError, match="sparsity"):
        sk.accelerate(model, torch.randn(2, 8), sparsity="1:4")
    with pytest.raises(ValueError, match="min_speedup"):
        sk.accelerate(model, torch.randn(2, 8), plan=sk.PlanOptions(min_speedup=0))
    with pytest.raises(ValueError, match=r"^CompileOptions\.inductor: Unexpected optimization "
                                         r"option triton\.bog"):
        sk.accelerate(model, torch.randn(2, 8),
                      compile=sk.CompileOptions(inductor={"triton.bogus": 1}))
    with pytest.raises(ValueError, match="inductor must be a dict"):
        sk.accelerate(model, torch.randn(2, 8),
                      compile=sk.CompileOptions(inductor=["triton.multi_kernel"]))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            sk.accelerate(model, torch.randn(2, 8))


@pytest.mark.parametrize("batch_first", [True, False])
def test_split_mha_equals_multihead_attention(batch_first):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=batch_first).double().eval()
    x = torch.randn(3, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        ref, _ = mha(x, x, x, need_weights=False)
        out, w = SplitMultiheadAttention(mha)(x, x, x, need_weights=False)
    assert w is None
    torch.testing.assert_close(out, ref)
    split = SplitMultiheadAttention(mha)
    assert split.in_proj.weight.shape == (96, 32) and split.out_proj is mha.out_proj
    with pytest.raises(NotImplementedError, match="self-attention"):
        split(x, x.clone(), x, need_weights=False)
    with pytest.raises(NotImplementedError, match="need_weights"):
        split(x, x, x)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        split(x, x, x, need_weights=False, attn_mask=torch.zeros(5, 5, dtype=torch.bool))


def test_skip_reasons():
    assert mha_skip_reason(nn.MultiheadAttention(32, 4)) is None
    assert "kdim" in mha_skip_reason(nn.MultiheadAttention(32, 4, kdim=16, vdim=16))
    assert "add_bias_kv" in mha_skip_reason(nn.MultiheadAttention(32, 4, add_bias_kv=True))
    assert conv_skip_reason(nn.Conv2d(8, 16, 1)) is None
    assert conv_skip_reason(nn.Conv2d(3, 768, 16, stride=16)) is None
    assert conv_skip_reason(nn.Conv2d(3, 8, (2, 4), stride=(2, 4))) is None
    assert "(3, 3) differs from its stride (1, 1)" in conv_skip_reason(nn.Conv2d(8, 16, 3))
    assert "differs from its stride" in conv_skip_reason(nn.Conv2d(8, 16, 1, stride=2))
    assert "padding" in conv_skip_reason(nn.Conv2d(8, 16, 2, stride=2, padding=1))
    assert "groups" in conv_skip_reason(nn.Conv2d(8, 16, 2, stride=2, groups=2))
    assert "only Conv2d" in conv_skip_reason(nn.Conv1d(8, 16, 1))
    with pytest.raises(ValueError, match="differs from its stride"):
        ConvAsLinear(nn.Conv2d(8, 16, 3))


@pytest.mark.parametrize("kernel,size", [(1, (5, 6)), (4, (16, 12)), ((2, 3), (9, 10)),
                                         (16, (64, 64))])
def test_conv_as_linear_equals_conv(kernel, size):
    """1x1 convs and patch embeddings (kernel == stride), also where the input is not a
    multiple of the kernel (the conv drops the remainder), against the float64 conv."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 16, kernel, stride=kernel).double()
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    fast = ConvAsLinear(conv)
    assert fast.linear.in_features == 3 * conv.kernel_size[0] * conv.kernel_size[1]
    torch.testing.assert_close(fast(x), conv(x))


class _Writer:
    def __init__(self):
        self.scalars, self.texts = {}, {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag] = value

    def add_text(self, tag, text, step):
        self.texts[tag] = text


def test_report_dict_markdown_and_tensorboard():
    report = AccelReport("bf16", "auto", 1.0, "NVIDIA H200")
    report.layers.append(LayerDecision("mlp.fc1", 11008, 4096, 4096, True, "bf16_2:4",
                                       "auto: fastest measured", dict(H200_LLAMA)))
    report.layers.append(LayerDecision("head", 1000, 768, 1, False, "bf16_dense", "align"))
    report.skipped["conv_proj"] = "conv kernel (3, 3) differs from its stride (1, 1)"
    report.model_us = {"dense": 200.0, "accelerated": 160.0}
    d = report.to_dict()
    assert d["model_speedup"] == pytest.approx(1.25)
    assert d["layers"][0]["speedup"] == pytest.approx(465.4 / 326.0)
    assert d["layers"][1]["speedup"] is None and d["skipped"]["conv_proj"]
    md = report.to_markdown()
    assert "| mlp.fc1 | 11008x4096 | 4096 | yes | bf16_2:4 | 1.43x |" in md
    assert "conv_proj" in md and "1.25x" in md
    w = _Writer()
    report.log(w)
    assert w.scalars["accel/speedup/mlp.fc1"] == pytest.approx(1.4276, abs=1e-3)
    assert w.scalars["accel/model_speedup"] == pytest.approx(1.25)
    assert "accel/speedup/head" not in w.scalars and "mlp.fc1" in w.texts["accel/report"]
    assert all(math.isfinite(v) for v in w.scalars.values())


def test_report_bound_is_amdahl_over_timed_linears():
    """max_speedup = dense / (rest + chosen linears), rest = dense - linears timed alone; an
    untimed layer (no candidates) counts in the rest."""
    report = AccelReport("bf16", "2:4", 1.0, "NVIDIA H200")
    assert report.bound is None  # nothing timed yet
    for name in ("up", "down"):
        report.layers.append(LayerDecision(name, 11008, 4096, 4096, True, "bf16_2:4", "2:4",
                                           {"bf16_dense": 500.0, "bf16_2:4": 250.0}))
    report.layers.append(LayerDecision("head", 1000, 768, 1, False, "bf16_dense", "align"))
    report.model_us = {"dense": 1500.0, "accelerated": 1100.0}
    b = report.bound
    assert b == {"linear_dense_us": 1000.0, "linear_chosen_us": 500.0, "rest_us": 500.0,
                 "max_speedup": pytest.approx(1.5)}
    assert report.to_dict()["bound"]["max_speedup"] == pytest.approx(1.5)
    assert "so at most 1.50x for the model" in report.to_markdown()
    assert report.model_speedup <= b["max_speedup"]


def test_alg_cache_roundtrip(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEKIT_CACHE", str(tmp_path))
    key = algsearch.cache_key("bf16_2:4", 11008, 4096, 4096, "NVIDIA H200", "2.11.0", 800)
    assert key == "NVIDIA H200|torch=2.11.0|cusparselt=800|bf16_2:4|N=11008|K=4096|M=4096"
    assert algsearch.load_cache() == {}
    algsearch.store_cache({key: {"alg_id": 17, "us": 326.0}})
    algsearch.store_cache({"other": {"alg_id": 3, "us": 1.0}})
    cache = algsearch.load_cache()
    assert cache[key]["alg_id"] == 17 and cache["other"]["alg_id"] == 3
    assert algsearch.cache_path() == tmp_path / "cusparselt_algs.json"


def test_accelerated_model_lists_tensors_once():
    from sparsekit.accel import AcceleratedModel

    fast = AcceleratedModel(nn.Linear(4, 4), AccelReport("bf16", "2:4", 1.0, "cpu"),
                            torch.device("cpu"), compile=False)
    assert list(fast.state_dict()) == ["model.weight", "model.bias"]
    assert fast.report is fast.sparsekit_report


def test_own_binding_ships_and_says_why_it_is_off(monkeypatch):
    """The binding's C++ source is package data; where it cannot be used, load() gives None and
    reason() says why (no CUDA) instead of failing; ``PlanOptions(cslt_epilogue=False)`` (was
    SPARSEKIT_CSLT_EXT=0) keeps the layers off it even where it loads."""
    from sparsekit.accel.kernels import switches
    from sparsekit.accel.kernels.cusparselt import ext as cslt_ext
    from sparsekit.accel.kernels.cusparselt import op as cslt_op

    assert cslt_ext.SOURCE.is_file() and "cusparseLtMatmul" in cslt_ext.SOURCE.read_text()
    cslt_ext.load.cache_clear()
    try:
        assert cslt_ext.load() is None and cslt_ext.reason() == "no CUDA device"
    finally:
        cslt_ext.load.cache_clear()
    monkeypatch.setattr(cslt_ext, "load", lambda: object())  # as if built and loaded
    assert cslt_op.alpha_path()
    with switches.using(sk.PlanOptions(cslt_epilogue=False).switches()):
        assert not cslt_op.alpha_path()
