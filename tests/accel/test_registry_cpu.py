"""The kernel registry (sparsekit.accel.kernels) and the plan-driven layer
(sparsekit.accel.linear): a toy kernel registered from this test is offered to the layers it
declares, planned (untimed, and by the decode planner on fake timings) and run on CPU through
its reference; the built-in kernels declare a consistent contract; plans are data."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparsekit as sk
from sparsekit.accel import kernels
from sparsekit.accel.kernels import FAMILIES, UNBOUNDED, Format, Kernel
from sparsekit.accel.layers import VARIANTS
from sparsekit.accel.linear import LayerPlan, Route
from sparsekit.prune.patterns import nm_mask


@torch.library.custom_op("sparsekit_test::toy24_mm", mutates_args=(), device_types="cuda")
def toy24_mm(x: torch.Tensor, values: torch.Tensor, cols: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
    raise RuntimeError("the toy kernel has no CUDA implementation")


@toy24_mm.register_kernel("cpu")
def _toy24_mm_ref(x, values, cols, bias):
    calls.append(x.shape[0])
    w = torch.zeros(values.shape[0], 2 * values.shape[1], dtype=torch.float32)
    w.scatter_(1, cols, values.float())
    y = x.float() @ w.t()
    return (y if bias is None else y + bias.float()).to(torch.bfloat16)


@toy24_mm.register_fake
def _toy24_mm_fake(x, values, cols, bias):
    return x.new_empty((x.shape[0], values.shape[0]), dtype=torch.bfloat16)


calls: list[int] = []  # M of each call of the toy op's reference


def _pack(layer, w):
    """The kept half of each row (N, K/2) and the columns they came from: exact."""
    cols = (w != 0).to(torch.int8).float().argsort(dim=1, descending=True, stable=True)
    cols = cols[:, : w.shape[1] // 2].sort(dim=1).values
    return {"values": torch.gather(w, 1, cols), "cols": cols}


def _unpack(layer, t):
    w = torch.zeros(t["values"].shape[0], 2 * t["values"].shape[1], dtype=t["values"].dtype)
    return w.scatter_(1, t["cols"], t["values"])


TOY = Format("toy24", _pack, lambda dtype: 0.5 * dtype.itemsize + 4.0, unpack=_unpack)


def _toy(prefer: bool = True) -> Kernel:
    return Kernel("toy24", "toy", "linear", ("bf16",), True, (1, 8), TOY,
                  lambda layer, x2d, w, config: toy24_mm(x2d, w.values, w.cols, layer.bias),
                  prefer=lambda layer, source: prefer, ops=("toy24_mm",), order=0)


@pytest.fixture
def toy():
    """The toy kernel registered (preferred: bf16 2:4 layers take it untimed) for one test."""
    kernel = kernels.register(_toy())
    calls.clear()
    yield kernel
    kernels.unregister(kernel.name)


def _lin(n: int = 64, k: int = 512, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.mul_(nm_mask(lin.weight.abs(), 2, 4))
    return lin


def _ref(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w = lin.weight.detach().to(torch.bfloat16).double()
    return x.double() @ w.t() + lin.bias.detach().to(torch.bfloat16).double()


def test_a_registered_kernel_is_planned_and_run_through_its_reference(toy):
    lin = _lin()
    layer = VARIANTS["bf16_2:4"](lin)
    # the registry offers it first: the layer's small-M route up to its top (8 tokens)
    assert layer.plan == LayerPlan((Route(1, 8, "toy24"), Route(1, UNBOUNDED, "cusparselt")))
    assert layer.plan.text() == "M 1-8: toy24; M 9+: cusparselt"
    assert layer.choices["small"] == ("toy24",) and "toy24" in repr(layer)
    # only the copies its plan reads: the toy's and cuSPARSELt's (here: the dense weight)
    assert set(layer.formats) == {"toy24", "cslt"}
    assert layer.weight_bytes() == sum(t.numel() * t.element_size()
                                       for t in layer.formats.buffers())
    for m, ran in ((3, [3]), (8, [8]), (9, [])):
        calls.clear()
        x = torch.randn(m, 512).bfloat16()
        y = layer(x)
        assert calls == ran  # the toy's reference for M <= 8, cuSPARSELt's above
        err = ((y.double() - _ref(lin, x)).norm() / _ref(lin, x).norm()).item()
        assert err < 1e-2, (m, err)  # bf16 output rounding
    # through accelerate: the report shows each layer's plan and the bytes it keeps
    model = nn.Sequential(_lin(seed=1), nn.ReLU(), _lin(512, 64, seed=2))
    x = torch.randn(4, 512)
    fast = sk.accelerate(model, x, device="cpu", sparsity="2:4", compile=False)
    calls.clear()
    fast(x)
    assert calls == [4, 4]
    report = fast.report
    assert [d.plan for d in report.layers] == ["M 1-8: toy24; M 9+: cusparselt"] * 2
    assert report.layers[0].weight_bytes == fast.model[0].weight_bytes() > 0
    assert "| M 1-8: toy24; M 9+: cusparselt |" in report.to_markdown()


def test_the_decode_planner_times_a_registered_alternative_and_keeps_the_faster(
        monkeypatch, tmp_path):
    from sparsekit.accel.options import CompileOptions, PlanOptions
    from sparsekit.accel.planner import Planner, decode
    from sparsekit.accel.report import AccelReport
    from sparsekit.nn import timing

    kernels.register(_toy(prefer=False))  # an alternative: timed against the Triton kernel
    try:
        layer = VARIANTS["bf16_2:4"](_lin())
        assert layer.choices["small"] == ("toy24", "sk24")
        assert layer.plan.routes[0].kernel == "sk24"  # untimed: the one it prefers

        def fake(fn):  # us: the toy beats the Triton kernel, both beat cuSPARSELt to M = 4
            if fn.func is F.linear:
                return 50.0
            m = fn.args[0].shape[0]
            kernel = fn.func.plan.route(m).kernel
            return {"toy24": 1.0 if m <= 4 else 9.0, "sk24": 2.0 if m <= 4 else 9.0,
                    "cusparselt": 5.0}[kernel]

        monkeypatch.setenv("SPARSEKIT_CACHE", str(tmp_path))
        monkeypatch.setattr(timing, "cold_time_us", fake)
        real = decode.time_decode  # timed on CPU (its tensors made there), as on a GPU
        monkeypatch.setattr(decode, "time_decode", lambda mod, device, dense=False, kernel=None:
                            real(mod, torch.device("cpu"), dense, kernel))
        planner = Planner(torch.device("cpu"), "bf16", "2:4", PlanOptions(), CompileOptions(),
                          False, AccelReport("bf16", "2:4", 1.0, "cpu"))
        planner.device = torch.device("cuda")  # plan as on a GPU
        planner.plan_decode(nn.Sequential(layer))
        assert layer.plan.text() == "M 1-4: toy24; M 5+: cusparselt"
        assert set(layer.formats) == {"toy24", "cslt"}  # the Triton copy dropped
        assert any("toy24 chosen over sk24" in n for n in planner.report.notes)
        calls.clear()
        layer(torch.randn(4, 512).bfloat16())
        assert calls == [4]
    finally:
        kernels.unregister("toy24")


def test_registry_contract_and_refusals():
    names = [k.name for k in kernels.kernels()]
    assert len(names) == len(set(names))
    for k in kernels.kernels():
        assert k.family in FAMILIES and 1 <= k.tokens[0] <= k.tokens[1] <= UNBOUNDED
        for op in k.ops:  # every op is registered, with a CPU reference (its tests run them)
            assert hasattr(torch.ops.sparsekit, op), (k.name, op)
        if k.format is not None:
            assert 0 < k.format.bytes_per_weight(torch.bfloat16) <= 2.0
    # a second kernel of a taken name, or a format of a taken name, is refused
    with pytest.raises(ValueError, match="kernel 'sk24' is registered already"):
        kernels.register(Kernel("sk24", "toy", "linear", ("bf16",), True, (1, 8), None,
                                lambda *a: None))
    with pytest.raises(ValueError, match="weight format 'sk24' is registered already"):
        kernels.register(Kernel("toy", "toy", "linear", ("bf16",), True, (1, 8),
                                Format("sk24", _pack, lambda d: 1.0), lambda *a: None))
    with pytest.raises(ValueError, match="no kernel 'nope'; registered: "):
        kernels.get("nope")
    # a layer no registered kernel takes: the error names the layer and why
    with pytest.raises(ValueError, match=r"fp8w_2:4 layer \(64x96\): no kernel runs it "
                                         r"\(in_features 96 is not a multiple of 512"):
        VARIANTS["fp8w_2:4"](nn.Linear(96, 64))
    # on CPU the mma.sp library is refused with why; the Triton kernel runs
    layer = VARIANTS["bf16_2:4"](_lin())
    assert layer.refused["mma_sp"] == "not on a CUDA device"
    assert layer.plan.text() == "M 1-32: sk24; M 33+: cusparselt"


def test_layer_plan_is_data():
    plan = LayerPlan((Route(2, 32, "cublas"), Route(1, 1, "mma_sp", ((8, 4, 1, 1),) * 4),
                      Route(1, UNBOUNDED, "cusparselt")))
    assert [(lo, hi, r.kernel) for lo, hi, r in plan.segments()] == [
        (1, 1, "mma_sp"), (2, 32, "cublas"), (33, UNBOUNDED, "cusparselt")]
    assert plan.text() == ("M 1: mma_sp [8x4x1x1/8x4x1x1/8x4x1x1/8x4x1x1]; M 2-32: cublas; "
                           "M 33+: cusparselt")
    assert LayerPlan.from_json(plan.to_json()) == plan
    assert plan.kernels() == ("cublas", "mma_sp", "cusparselt")
    with pytest.raises(ValueError, match="last route must cover every token count"):
        LayerPlan((Route(1, 32, "sk24"),))
    # a plan moved to another kernel re-encodes the weight exactly from the copy it holds
    lin = _lin()
    layer = VARIANTS["bf16_2:4"](lin)
    x = torch.randn(5, 512).bfloat16()
    before = layer(x)
    layer.use(LayerPlan((Route(1, 8, "cublas"), Route(1, UNBOUNDED, "cusparselt"))))
    assert set(layer.formats) == {"bf16", "cslt"}
    assert torch.equal(layer.weights("cublas").weight, lin.weight.detach().bfloat16())
    torch.testing.assert_close(layer(x).float(), before.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(layer(x), F.linear(x, lin.weight.detach().bfloat16(),
                                          lin.bias.detach().bfloat16()))
    torch._dynamo.reset()  # every layer shares AccelLinear.forward: other tests' graphs count
    compiled = torch.compile(functools.partial(layer), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), layer(x))
