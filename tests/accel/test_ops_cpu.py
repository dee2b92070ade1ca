"""The sparsekit:: custom ops on CPU: opcheck (schema, fake tensors, AOT dispatch with dynamic
shapes), the reference kernels against float64 matmuls, and the numerics shared with quant/."""

import pytest
import torch
from torch import nn

from sparsekit.accel.kernels.cusparselt import op as cslt_op
from sparsekit.accel.kernels.dense import op as dense_op
from sparsekit.accel import ops
from sparsekit.accel import layers
from sparsekit.quant import QuantLinear, quantize_
from sparsekit.quant.formats import FP8, INT8, get_scheme
from sparsekit.quant.numerics import quantize, row_scales

# torch's schema check compares outputs with allclose, which has no CPU float8 kernel
_NO_SCHEMA = ("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration")


def _w24(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    g4 = w.reshape(n, -1, 4)
    keep = g4.abs().topk(2, dim=-1).indices
    return (g4 * torch.zeros_like(g4).scatter_(-1, keep, 1.0)).reshape(n, k)


def _utils(dtype):
    return {"test_utils": _NO_SCHEMA} if dtype == torch.float8_e4m3fn else {}


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_opcheck_quant_ops(dtype):
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    torch.library.opcheck(ops.quant_rows, (x, dtype), **_utils(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_opcheck_matmul_ops(dtype):
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    w = _w24(32, 64)
    bias = torch.randn(32, dtype=torch.bfloat16)
    if dtype == torch.bfloat16:
        torch.library.opcheck(cslt_op.sparse24_mm, (x, w.bfloat16(), bias, 32, 0, torch.bfloat16))
        return
    fmt = INT8 if dtype == torch.int8 else FP8
    q, s = ops.act_quant_rows(x, fmt)
    wq = quantize(w, (w.abs().amax(1, keepdim=True) / fmt.qmax), fmt)
    outs = [torch.bfloat16] + ([torch.int32] if dtype == torch.int8 else [])
    for out in outs:
        torch.library.opcheck(cslt_op.sparse24_mm, (q, wq, None, 32, 3, out), **_utils(dtype))
    torch.library.opcheck(dense_op.scaled_mm,
                          (q, wq, s, torch.rand(32) + 0.1, bias, torch.bfloat16),
                          **_utils(dtype))


def test_sparse24_reference_equals_float64_matmul():
    x = torch.randn(5, 64)
    w = _w24(32, 64)
    b = torch.randn(32)
    y = cslt_op.sparse24_mm(x.bfloat16(), cslt_op.pack_24(w.bfloat16()), b.bfloat16(), 32, 0,
                        torch.float32)
    ref = x.bfloat16().double() @ w.bfloat16().double().t() + b.bfloat16().double()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    # int8 products are exact
    qx = torch.randint(-127, 128, (5, 64), dtype=torch.int8)
    qw = (w.sign() * 100).to(torch.int8)
    yi = cslt_op.sparse24_mm(qx, qw, None, 32, 0, torch.int32)
    assert yi.dtype == torch.int32 and torch.equal(yi, (qx.long() @ qw.long().t()).int())


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_quant_op_numerics_are_quants(dtype):
    """One numerics: the accel op, accel's fused form and quant/ give the same values:
    per-token absmax scales, int8 rounding half to even."""
    fmt = INT8 if dtype == torch.int8 else FP8
    x = torch.randn(16, 64, dtype=torch.bfloat16) * torch.logspace(-2, 2, 16)[:, None]
    x[3] = 0  # an all-zero token must not give NaN
    x[5, :4] = torch.tensor([0.5, 1.5, 2.5, -2.5]) * (x[5].float().abs().max() / 127 * 2)
    q_op, s_op = ops.quant_rows(x, dtype)
    q_fused, s_fused = ops.act_quant_rows(x, fmt)
    s_ref = row_scales(x, fmt)
    q_ref = quantize(x, s_ref, fmt)
    assert torch.equal(s_op, s_ref) and torch.equal(s_fused, s_ref)
    assert torch.equal(q_op.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(q_fused.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.isfinite(s_op).all() and (q_op[3].float() == 0).all()
    if dtype == torch.int8:  # halves go to even: x/s = 0.5, 1.5, 2.5, -2.5 -> 0, 2, 2, -2
        t = x[5, :4].float() / s_ref[5]
        assert torch.equal(q_op[5, :4], t.round().to(torch.int8))


@pytest.mark.parametrize("scheme,variant", [
    ("int8", "int8_2:4"), ("int8", "int8_dense"), ("fp8", "fp8_2:4"), ("fp8", "fp8_dense"),
    ("int8_static", "int8_2:4"), ("int8_static", "int8_dense"), ("fp8_static", "fp8_2:4"),
    ("fp8_static", "fp8_dense")])
def test_accel_layer_built_from_quantlinear_matches_it(scheme, variant):
    """accel takes a QuantLinear's 8-bit weights and scales (and a static scheme's one input
    scale) as they are and quantizes the activation the same way: the same int values in,
    the same output out."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    with torch.no_grad():
        lin.weight.copy_(_w24(32, 64))
    model = nn.Sequential(lin)
    # calibrated on smaller inputs than the test's, so some inputs saturate in the static case
    quantize_(model, scheme, calibration=[torch.randn(4, 64) * 0.5])
    model.to(torch.bfloat16)  # as accelerate does: the bias becomes bf16, 8-bit weights stay
    ql = model[0]
    assert isinstance(ql, QuantLinear)
    layer = layers.VARIANTS[variant](ql)
    (w,) = layer.formats.values()  # the one copy it keeps: cuSPARSELt's, or the dense one
    stored = w.packed if layer.sparse else w.weight
    assert torch.equal(stored.view(torch.uint8), ql.weight.view(torch.uint8))
    assert torch.equal(layer.w_scale, ql.weight_scale)
    static = scheme.endswith("_static")
    assert (layer.act_scale is not None) == static
    if static:
        assert torch.equal(layer.act_scale, ql.input_scale)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    q_accel, _ = layer.quant(x.reshape(-1, 64))
    fmt = get_scheme(scheme).activation
    rows = x.reshape(-1, 64)
    q_quant = quantize(rows, ql.input_scale if static else row_scales(rows, fmt), fmt)
    assert torch.equal(q_accel.view(torch.uint8), q_quant.view(torch.uint8))  # same int values
    y = layer(x)
    ref = ql(x)  # quant/'s W8A8 forward in the input's dtype
    assert y.shape == ref.shape == (3, 5, 32) and y.dtype == torch.bfloat16
    # int8: exact integer products, same scales, same epilogue -> equal; fp8: fp32 sums only
    exact = scheme.startswith("int8")
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(y.float(), ref.float(), **tol)
    if static:
        return  # saturated on purpose: not close to the float product
    # and the dense float reference is close (W8A8 error only)
    dense = x.float() @ _w24(32, 64).t() + lin.bias.detach().float()
    assert (y.float() - dense).norm() / dense.norm() < (0.02 if scheme == "int8" else 0.08)


def test_unfused_quant_layer_equals_fused():
    lin = nn.Linear(64, 32)
    with torch.no_grad():
        lin.weight.copy_(_w24(32, 64))
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    a = layers.VARIANTS["fp8_2:4"](lin, fused_quant=True)(x)
    b = layers.VARIANTS["fp8_2:4"](lin, fused_quant=False)(x)
    assert torch.equal(a, b)


def test_fake_shapes_follow_symbolic_rows():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(9, 64, dtype=torch.int8)
        w = torch.empty(32, 64, dtype=torch.int8)
        assert cslt_op.sparse24_mm(x, w, None, 32, 0, torch.int32).shape == (9, 32)
        q, s = ops.quant_rows(torch.empty(9, 64, dtype=torch.bfloat16), torch.int8)
        assert q.shape == (9, 64) and s.shape == (9, 1) and s.dtype == torch.float32


def test_opcheck_and_reference_of_sparse24_mm_alpha():
    """sparse24_mm_alpha: opcheck, and its reference against float64 of the paper formula
    act(alpha * x @ W.T + bias) on the same 8-bit values."""
    w = _w24(32, 64)
    wq = quantize(w, w.abs().amax() / FP8.qmax, FP8)
    x = torch.randn(6, 64)
    xq = quantize(x, torch.tensor(0.02), FP8)
    bias = torch.randn(32, dtype=torch.bfloat16)
    for gelu in (False, True):
        torch.library.opcheck(cslt_op.sparse24_mm_alpha, (xq, wq, bias, 32, 0, 0.003, gelu),
                              **_utils(torch.float8_e4m3fn))
        y = cslt_op.sparse24_mm_alpha(xq, wq, bias, 32, 0, 0.003, gelu)
        lin = (xq.double() @ wq.double().t()) * 0.003 + bias.double()
        ref = torch.nn.functional.gelu(lin, approximate=cslt_op.GELU_APPROXIMATE) if gelu else lin
        assert y.dtype == torch.bfloat16 and y.shape == (6, 32)
        torch.testing.assert_close(y.double(), ref, rtol=2 ** -8, atol=1e-6)
