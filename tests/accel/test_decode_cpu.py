"""The small-M 2:4 path (sparsekit's format + Triton kernel) and generate() on CPU: the
format's round trip, the op's reference against dense matmul of the masked weight for every M
in 1..32, the Triton kernel itself under Triton's interpreter, the layers' decode numerics
against their large-M path, an accelerated tiny Llama generating HF's own tokens, and the
planner's decode routing (small-M, large-M, bf16 dense under "auto") on faked GPU timings."""

import copy
import functools

import pytest
import torch
from interpreted import compile_sm90, run_interpreted
import torch.nn.functional as F
from torch import nn

import sparsekit as sk
from sparsekit.accel.kernels.cusparselt import op as cslt_op
from sparsekit.accel.kernels.mma_sp import op as mma_op
from sparsekit.accel.kernels.triton24 import op as sk24_op
from sparsekit.accel import layers_int4
from sparsekit.accel.kernels.triton24 import format as sk24
from sparsekit.accel.kernels.mma_sp import launch as sk24_mma
from sparsekit.accel import kernels
from sparsekit.accel.generate import bucket, cache_length
from sparsekit.accel.layers import VARIANTS
from sparsekit.accel.linear import LayerPlan, Route

# the module each op a test wraps is looked up in by the kernels
OP_MODULES = {"sk24_mm": sk24_op, "sk24_mma_mm": mma_op, "sparse24_mm": cslt_op}
# this file's kernel names: "triton" the 2:4 Triton kernel, "mma" the mma.sp library
KERNEL = {"triton": "sk24", "mma": "mma_sp"}


def small(mod) -> str | None:
    """The small-M kernel ``mod``'s plan runs (None: none)."""
    return next((r.kernel for r in mod.plan.routes if kernels.get(r.kernel).small_m), None)


def limit(mod) -> int:
    """The largest M ``mod``'s small-M kernel serves (0: none)."""
    return next((r.hi for r in mod.plan.routes if kernels.get(r.kernel).small_m), 0)


def config(mod):
    """The configuration per bucket of ``mod``'s small-M route (None: the defaults)."""
    return next((r.config for r in mod.plan.routes if kernels.get(r.kernel).small_m), None)


def dense_m(mod) -> tuple[int, int]:
    """(lo, hi) of ``mod``'s bf16 dense route, (0, 0) without one."""
    r = mod.plan.routes[0]
    return (r.lo, r.hi) if r.kernel == "cublas" else (0, 0)


def with_limit(mod, m: int) -> None:
    """``mod`` on its small-M kernel up to ``m`` tokens (0: its large-M kernel at every M),
    its weight copies kept."""
    k, cfg, large = small(mod) or mod.choices["small"][-1], config(mod), mod.plan.routes[-1]
    mod.use(LayerPlan(((Route(1, m, k, cfg),) if m else ()) + (large,)), keep=True)


def runs_small(fn) -> bool:
    """In a fake ``cold_time_us``: whether ``fn`` (a partial of a layer) runs a small-M
    kernel."""
    return kernels.get(fn.func.plan.route(fn.args[0].shape[0]).kernel).small_m


def masked_24(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w4 = w.view(n, k // 4, 4)
    keep = torch.zeros_like(w4).scatter_(-1, w4.abs().topk(2, -1).indices, 1.0)
    w = (w4 * keep).view(n, k)
    w[0, :4] = 0  # a group with no nonzero
    w[1, 4:8] = torch.tensor([0.0, 0.0, 0.5, 0.0])  # a group with one
    return w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_format_round_trip(dtype):
    w = masked_24(48, 1024).to(dtype)
    values, meta = sk24.compress(w)
    assert values.shape == (48, 512) and meta.shape == (48, 32) and meta.dtype == torch.int32
    assert torch.equal(sk24.decompress(values, meta).float(), w.float())
    assert sk24.decompress(values, meta).dtype == dtype
    widened = sk24.decompress(values, meta, dtype=torch.bfloat16)  # the fp8w prefill's weight
    assert widened.dtype == torch.bfloat16 and torch.equal(widened, w.to(torch.bfloat16))
    for layout in ("interleaved", "slabs"):  # the int4 kernels' layout too
        values, meta = sk24.compress(w, layout=layout)
        assert torch.equal(sk24.decompress(values, meta, layout).float(), w.float())


def test_format_refuses_bad_weights():
    with pytest.raises(ValueError, match="more than 2 nonzeros"):
        sk24.compress(torch.ones(16, 512, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="in_features 768 is not a multiple of 512"):
        sk24.compress(masked_24(16, 768).bfloat16())
    with pytest.raises(ValueError, match="dtype"):
        sk24.compress(masked_24(16, 512))


def test_reference_equals_dense_matmul_every_m():
    w = masked_24(40, 512)
    values, meta = sk24.compress(w.bfloat16())
    bias = torch.randn(40).bfloat16()
    for m in range(1, 33):
        x = torch.randn(m, 512).bfloat16()
        y = sk24_op.sk24_mm(x, values, meta, None, None, bias)
        ref = (x.double() @ w.bfloat16().double().t() + bias.double())
        torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2)


def test_op_passes_opcheck():
    values, meta = sk24.compress(masked_24(32, 512).bfloat16())
    x = torch.randn(3, 512).bfloat16()
    torch.library.opcheck(sk24_op.sk24_mm, (x, values, meta, None, None, None))
    # with scales (opcheck's schema check cannot multiply float8 tensors on CPU)
    xs, ws = torch.rand(3, 1) + 0.5, torch.rand(32) + 0.5
    torch.library.opcheck(sk24_op.sk24_mm, (x, values, meta, xs, ws, torch.randn(32).bfloat16()))


_INTERPRETED = r"""
import sys
import torch
from sparsekit.accel.kernels.triton24 import format as sk24
from tests.accel.test_decode_cpu import masked_24
split = {"BLOCK_N": 16, "BLOCK_W": 16, "SPLIT_K": 4}
quick = sys.argv[1:] == ["quick"]  # the first case of each dtype, without the rest below
for dtype in (torch.bfloat16, torch.float8_e4m3fn):
    # the three ways to multiply (0, 1: CUDA cores, 2: tl.dot), whole rows (K 512) and
    # split over 2, 3 (unevenly) or 4 programs (K 2048), M over one tile and over two (33);
    # x as (M, K) and as its position planes
    for m, k, config in ((1, 512, None), (20, 512, None), (3, 2048, None),
                         (33, 2048, {**split, "MODE": 2}), (2, 2048, {**split, "MODE": 0}),
                         (7, 2048, {**split, "MODE": 1, "SPLIT_K": 3}))[:1 if quick else 6]:
        w = masked_24(48, k, seed=m).to(dtype)
        values, meta = sk24.compress(w)
        x = torch.randn(m, k).to(dtype)
        xs = None if dtype == torch.bfloat16 else torch.rand(m, 1) + 0.5
        ws = None if dtype == torch.bfloat16 else torch.rand(48) + 0.5
        bias = torch.randn(48).bfloat16()
        ref = sk24.reference(x, values, meta, xs, ws, bias).float()
        y = sk24.launch(sk24.planes(x) if m % 2 else x, values, meta, xs, ws, bias,
                        config=config).float()
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, (dtype, m, k, err)
        # every split-K launch leaves its tile counters at zero
        assert int(sk24.counters(x.device).abs().sum()) == 0
# bf16 x with an fp8 weight (weight-only layers): every way to multiply widens the weight
for m, k, config in ((1, 512, None),) if quick else (
        (1, 2048, None), (5, 2048, {**split, "MODE": 1}), (3, 2048, {**split, "MODE": 0}),
        (20, 2048, {**split, "MODE": 2})):
    w = masked_24(48, k, seed=m).to(torch.float8_e4m3fn)
    values, meta = sk24.compress(w)
    x = torch.randn(m, k).bfloat16()
    ws = torch.rand(48) + 0.5
    ref = sk24.reference(x, values, meta, None, ws, None).float()
    y = sk24.launch(x, values, meta, None, ws, None, config=config).float()
    err = ((y - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, ("bf16 x, fp8 weight", m, err)
if quick:
    print("ok")
    sys.exit()
try:
    sk24.launch(x.half(), values, meta, None, None, None)
except ValueError as e:
    assert "bfloat16 for a float8_e4m3fn weight" in str(e)
else:
    raise AssertionError("float16 x with an fp8 weight ran")
try:
    sk24.launch(x[:, :1024], values[:, :512], meta[:, :32], None, None, None,
                config={**split, "MODE": 0, "SPLIT_K": 4})
except ValueError as e:
    assert "at least SPLIT_K blocks" in str(e)
else:
    raise AssertionError("a split that does not divide K ran")
print("ok")
"""


@pytest.mark.slow  # every case (minutes under the interpreter); the quick test runs the first
def test_triton_kernel_under_interpreter():
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRETED)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_triton_kernel_under_interpreter_quick():
    # the kernel on its first case, bf16 and fp8 (scales, bias, position planes), at M = 1
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRETED, args=["quick"])
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


_WIDEN = """
import sys
import torch
from sparsekit.accel.kernels.triton24 import format as sk24
from test_decode_cpu import masked_24
shapes = ((5, 512), (17, 1024), (40, 2048))  # row and group tails of a program's block
for n, k in shapes[:1] if sys.argv[1:] == ["quick"] else shapes:
    w = masked_24(n, k, seed=n)
    w[0, :4] = torch.tensor([0.0, 0.0, 0.0, 1.5])  # one kept value, at the last position
    w[1, :8] = 0.0  # groups with none
    w8 = w.to(torch.float8_e4m3fn)
    values, meta = sk24.compress(w8)
    got = sk24.widen(values, meta)
    assert got.dtype == torch.bfloat16 and torch.equal(got, w8.to(torch.bfloat16)), (n, k)
print("ok")
"""


@pytest.mark.parametrize("shapes", [pytest.param("all", marks=pytest.mark.slow), "quick"])
def test_widen_kernel_under_interpreter_is_the_exact_widening(shapes):
    # the weight-only fp8 prefill's one-pass widening against the weight it stores, bitwise;
    # quick: the first shape (a row tail), all: the group tails too
    pytest.importorskip("triton")
    out = run_interpreted(_WIDEN, args=[shapes])
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_widen_op_is_decompress_behind_one_op():
    w = masked_24(48, 1024, seed=3).to(torch.float8_e4m3fn)
    values, meta = sk24.compress(w)
    got = sk24_op.sk24_widen(values, meta)
    assert torch.equal(got, sk24.decompress(values, meta, dtype=torch.bfloat16))
    assert torch.equal(got, w.to(torch.bfloat16))
    # (opcheck's schema check cannot multiply float8 tensors on CPU: bf16 values, same path)
    torch.library.opcheck(sk24_op.sk24_widen, sk24.compress(masked_24(48, 1024).bfloat16()))
    # the layer's prefill calls it: one op in its graph, not decompress's elementwise ops
    lin = nn.Linear(1024, 48)
    with torch.no_grad():
        lin.weight.copy_(masked_24(48, 1024, seed=4))
    sk.quantize_(lin, "fp8_weight_only")
    layer = VARIANTS["fp8w_2:4"](lin)
    from torch.fx.experimental.proxy_tensor import make_fx

    assert layer.plan.route(40).kernel == "sk24_widen"
    gm = make_fx(layer)(torch.randn(40, 1024).bfloat16())
    targets = [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
    assert any("sk24_widen" in t for t in targets)
    assert not any("where" in t for t in targets)


@pytest.mark.slow  # a GPU compiler build (Triton for sm_90); the gpu tests build it for real
def test_widen_kernel_compiles_for_sm90():
    """The widening kernel reaches the GPU compiler (no GPU needed: Triton compiles for an
    sm_90 target here), fp8 values in, bf16 out."""
    pytest.importorskip("triton")
    from sparsekit.accel.kernels.triton24 import kernel as sk24_triton

    bn, bg = sk24.WIDEN_BLOCK
    kernel = compile_sm90(sk24_triton.widen_kernel,
                          {"v_ptr": "*fp8e4nv", "m_ptr": "*i32", "w_ptr": "*bf16", "N": "i32",
                           "K": "i32"}, {"BLOCK_N": bn, "BLOCK_G": bg})
    assert "st.global" in kernel.asm["ptx"]


@pytest.mark.slow  # a GPU compiler build (Triton for sm_90); the gpu tests build it for real
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_triton_kernel_compiles_for_sm90_with_bf16_x_and_an_fp8_weight(mode):
    """The weight-only layers' operand mix reaches the GPU compiler (no GPU needed: Triton
    compiles for an sm_90 target here): every way to multiply builds, and the tensor-core way
    runs Hopper's wgmma on the widened weight."""
    pytest.importorskip("triton")
    from sparsekit.accel.kernels.triton24 import kernel as sk24_triton

    consts = {"HAS_XS": False, "HAS_WS": True, "HAS_BIAS": True, "DOT_F32": False,
              "SMALL_M": 8, "DOT_M": 16, "MODE": mode, "BLOCK_N": 64, "BLOCK_W": 16,
              "SPLIT_K": 2}
    sig = {"x_ptr": "*bf16", "v_ptr": "*fp8e4nv", "m_ptr": "*i32", "xs_ptr": "*fp32",
           "ws_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32",
           "cnt_ptr": "*i32", **dict.fromkeys(("M", "N", "K", "stride_xm", "stride_xs",
                                               "M_BUCKET"), "i32")}
    ptx = compile_sm90(sk24_triton.sk24_kernel, sig, consts).asm["ptx"]
    assert ("wgmma.mma_async" in ptx) == (mode == 2)
    if mode == 2:  # bf16 operands: the e4m3 weight widened, not x narrowed
        assert "bf16" in next(line for line in ptx.splitlines() if "wgmma.mma_async" in line)


@pytest.mark.parametrize("kernel", ["triton", "mma", "mma16", "mma8"])
@pytest.mark.parametrize("variant", ["bf16_2:4", "fp8_2:4"])
def test_layer_decode_path_has_prefill_numerics(variant, kernel, monkeypatch):
    if kernel in ("mma8", "mma16") and variant != "fp8_2:4":
        pytest.skip("fp8 layers only: the fp8 x fp8 kernel, x widened to f16")
    # the mma.sp formats where the library loads (a CUDA GPU); here their CPU reference
    monkeypatch.setattr(sk24_mma, "usable", lambda w: kernel != "triton")
    monkeypatch.setattr(sk24_mma, "e4m3_ok", lambda: kernel == "mma8")
    monkeypatch.setattr(sk24_mma, "fp8_f16_ok", lambda: kernel == "mma16")
    seen = []
    real = mma_op.sk24_mma_mm
    monkeypatch.setattr(mma_op, "sk24_mma_mm", lambda x, *a: seen.append(x.dtype) or real(x, *a))
    lin = nn.Linear(512, 64)
    with torch.no_grad():
        lin.weight.copy_(masked_24(64, 512))
    mod = VARIANTS[variant](lin)
    assert limit(mod) == sk24.MAX_M
    f16 = kernel == "mma16"
    name = "sk24" if kernel == "triton" else "mma_sp"
    assert small(mod) == name and f"M 1-32: {name}; M 33+: cusparselt" in repr(mod)
    if name == "mma_sp":
        assert mod.weights(name).layout == ("e4m3" if kernel == "mma8" else "paired")
    x = torch.randn(2, 5, 512).bfloat16()
    decode = mod(x)
    if kernel in ("mma", "mma16"):  # an fp8 layer's x widened to f16 where the library takes it
        assert seen == [torch.float16 if f16 else torch.bfloat16]
    if kernel == "mma8":  # fp8 x fp8: x as the layer quantized it
        assert seen == [torch.float8_e4m3fn]
    with_limit(mod, 0)  # the large-M path (cuSPARSELt's op; its reference on CPU)
    prefill = mod(x)
    assert decode.shape == prefill.shape == (2, 5, 64)
    # the same quantization and scales; only where bf16 rounding happens differs
    torch.testing.assert_close(decode.float(), prefill.float(), rtol=2e-2, atol=2e-2)


def _fp8w_reference(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """float64 ``x @ (q * scale).T + b`` of ``lin``'s weight quantized per channel to e4m3."""
    from sparsekit.quant.formats import FP8
    from sparsekit.quant.numerics import channel_scales, quantize

    w = lin.weight.detach().float()
    scale = channel_scales(w, FP8)
    q = quantize(w, scale[:, None], FP8).double() * scale.double()[:, None]
    return x.double() @ q.t() + lin.bias.detach().double()


@pytest.mark.parametrize("kernel", ["triton", "mma"])
def test_fp8_weight_only_layers_against_float64(kernel, monkeypatch):
    seen = []
    for op in ("sk24_mm", "sk24_mma_mm"):
        monkeypatch.setattr(OP_MODULES[op], op, functools.partial(
            lambda real, name, x, *a: seen.append((name, x.dtype)) or real(x, *a),
            getattr(OP_MODULES[op], op), op))
    lin = nn.Linear(512, 64)
    with torch.no_grad():
        lin.weight.copy_(masked_24(64, 512))
    mod = VARIANTS["fp8w_2:4"](lin)
    assert mod.weight_only and small(mod) == "sk24" and mod.act_scale is None
    # one copy, read by both kernels; no cuSPARSELt copy: bf16 x cannot go there
    assert mod.plan.text() == "M 1-32: sk24; M 33+: sk24_widen" and set(mod.formats) == {"sk24"}
    assert mod.weights("sk24").values.dtype == torch.float8_e4m3fn
    if kernel == "mma":
        mod.use(LayerPlan((Route(1, 32, "mma_sp"), mod.plan.routes[-1])))
        w = mod.weights("mma_sp")
        assert w.wide == torch.bfloat16 and w.values.dim() == 4
        assert set(mod.formats) == {"sk24", "mma"}
    x = torch.randn(2, 5, 512).bfloat16()
    ref = _fp8w_reference(lin, x)
    decode = mod(x)  # 10 tokens: the small-M kernel, x never quantized
    name = "sk24_mma_mm" if kernel == "mma" else "sk24_mm"
    assert seen == [(name, torch.bfloat16)]
    with_limit(mod, 0)
    prefill = mod(x)  # the weight widened, F.linear
    assert len(seen) == 1
    for y in (decode, prefill):
        assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 64)
        err = ((y.double() - ref).norm() / ref.norm()).item()
        assert err < 5e-3, err  # bf16 output rounding: activations are not quantized
    dense = VARIANTS["fp8w_dense"](lin)  # the dense weight, widened per call
    assert dense.plan.text() == "M 1+: cublas_widen"
    assert dense.weights("cublas_widen").weight.dtype == torch.float8_e4m3fn
    y = dense(x)
    # 2:4 kept the same values: dense and 2:4 layers agree to bf16 rounding
    assert ((y.double() - ref).norm() / ref.norm()).item() < 5e-3
    with pytest.raises(ValueError, match=r"fp8w_2:4 layer \(64x96\): .*multiple of 512"):
        VARIANTS["fp8w_2:4"](nn.Linear(96, 64))


def test_fp8_weight_only_quantlinear_keeps_its_values_through_accelerate():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 512))
    with torch.no_grad():
        model[0].weight.copy_(masked_24(64, 512))
    sk.quantize_(model, scheme="fp8_weight_only")
    x = torch.randn(4, 512)
    want = model(x)
    values = model[0].weight.detach().clone()
    with pytest.raises(ValueError, match=r"accelerate it with precision='fp8w'"):
        sk.accelerate(copy.deepcopy(model), x, device="cpu", precision="fp8", compile=False)
    fast = sk.accelerate(model, x, device="cpu", precision="fp8w", sparsity="2:4",
                         compile=False)
    layer = fast.model[0]
    assert type(layer).__name__ == "FP8WSparse24"
    w = layer.weights("sk24")
    assert torch.equal(sk24.decompress(w.values, w.meta).float(),
                       values.float())  # the QuantLinear's own e4m3 values
    got = fast(x)
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


def test_layer_without_decode_shape_keeps_large_m_path():
    lin = nn.Linear(96, 32)
    with torch.no_grad():
        lin.weight.copy_(masked_24(32, 96))
    mod = VARIANTS["bf16_2:4"](lin)
    assert small(mod) is None and mod.plan.text() == "M 1+: cusparselt"
    assert set(mod.formats) == {"cslt"} and mod.refused["sk24"].startswith("in_features 96")


def test_buckets():
    assert [bucket(n) for n in (1, 16, 17, 100, 512, 513)] == [16, 16, 32, 128, 512, 1024]
    assert cache_length(16, 12) == 256 and cache_length(512, 256) == 1024


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # hidden and intermediate sizes multiples of 512: every 2:4 layer takes the decode kernel
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024,
                                   num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=4, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(cfg).eval()
    sk.prune_(model, pattern="2:4", criterion="magnitude", exclude=["lm_head"])
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ref.load_state_dict(model.state_dict())
    return model, ref.to(torch.bfloat16)


# mma: the same generation on the mma.sp format's CPU reference (its routing and config: the
# planner tests below); slow, as each parameter compiles the model anew
@pytest.mark.parametrize("kernel", ["triton", pytest.param("mma", marks=pytest.mark.slow)])
def test_generate_equals_hf_generate_and_bounds_compiles(kernel, monkeypatch):
    # the mma.sp format where its library loads (a CUDA GPU); here its CPU reference
    monkeypatch.setattr(sk24_mma, "usable", lambda w: kernel == "mma")
    torch._dynamo.reset()  # another test's compile of the same shapes would be reused here
    model, ref = _tiny_llama()
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))
    fast = sk.accelerate(model, {"input_ids": ids}, device="cpu",
                         compile=sk.CompileOptions(backend="eager"))
    sparse = [m for m in fast.model.modules() if type(m).__name__ == "Sparse24BF16"]
    assert len(sparse) == 14 and all(small(m) == KERNEL[kernel] for m in sparse)
    out = fast.generate(ids, max_new_tokens=8)
    want = ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(out, want)
    before = fast.report.compiles
    assert before >= 2  # the prefill bucket and the decode step
    spent = {k: v for k, v in fast.report.seconds.items() if k.startswith("generate_")}
    assert set(spent) == {"generate_prefill", "generate_decode"} and min(spent.values()) > 0
    fast.generate(ids[:, :9], max_new_tokens=8)  # the cache's second use: nothing new
    for length in (10, 15):  # one bucket (16): no new graph
        got = fast.generate(ids[:, :length] if length <= 11 else
                            torch.cat([ids, ids[:, :length - 11]], 1), max_new_tokens=8)
        assert got.shape == (2, length + 8)
    assert fast.report.compiles == before
    assert all(fast.report.seconds[k] == v for k, v in spent.items())  # no graph built since


@pytest.mark.slow  # a whole generate; the layers' numerics: test_fp8_weight_only_layers_...
def test_fp8_weight_only_model_generates_the_float64_models_tokens():
    """An fp8_weight_only-quantized 2:4 Llama accelerated as fp8w generates (prefill on the
    widened weight, decode on the small-M kernel's reference here) the greedy tokens of the same
    quantized model run in float64, and its logits stay within bf16 rounding of it."""
    model, _ = _tiny_llama()
    sk.quantize_(model, "fp8_weight_only", exclude=["lm_head"])
    ref = copy.deepcopy(model).double()
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))
    fast = sk.accelerate(model, {"input_ids": ids}, device="cpu", precision="fp8w",
                         sparsity="2:4", compile=sk.CompileOptions(backend="eager"))
    layers = [m for m in fast.model.modules() if type(m).__name__ == "FP8WSparse24"]
    assert len(layers) == 14 and all(small(m) == "sk24" for m in layers)
    out = fast.generate(ids, max_new_tokens=8)
    want = ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(out, want)
    with torch.no_grad():
        got, exact = fast.model(ids).logits[:, -1].double(), ref(ids).logits[:, -1]
    assert ((got - exact).norm() / exact.norm()).item() < 2e-2


def test_generate_sampling_and_errors():
    model, _ = _tiny_llama()
    ids = torch.randint(0, 256, (1, 5))
    fast = sk.accelerate(model, {"input_ids": ids}, device="cpu", compile=False)
    torch.manual_seed(3)
    a = fast.generate(ids, max_new_tokens=6, do_sample=True, top_k=20)
    torch.manual_seed(3)
    b = fast.generate(ids, max_new_tokens=6, do_sample=True, top_k=20)
    assert a.shape == (1, 11) and torch.equal(a, b) and torch.equal(a[:, :5], ids)
    with pytest.raises(ValueError, match="max_new_tokens"):
        fast.generate(ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="num_beams"):
        fast.generate(ids, max_new_tokens=2, num_beams=4)
    with pytest.raises(ValueError, match="2-D"):
        fast.generate(ids[0], max_new_tokens=2)
    vision = sk.accelerate(nn.Sequential(nn.Linear(64, 64)), torch.randn(2, 64), device="cpu",
                           compile=False)
    with pytest.raises(TypeError, match="Hugging Face"):
        vision.generate(ids, max_new_tokens=2)


def test_decode_limit_is_the_last_bucket_where_the_small_m_kernel_wins(monkeypatch):
    from sparsekit.accel.planner import decode as planner
    from sparsekit.nn import timing

    lin = nn.Linear(512, 64)
    with torch.no_grad():
        lin.weight.copy_(masked_24(64, 512))
    mod = VARIANTS["bf16_2:4"](lin)
    # the small-M kernel (routed to for M) at 5 us, the large-M path at 8 us, except at M=16
    # where the small-M kernel loses: the limit stops at 4, and M=32 is not timed
    # and bf16 dense at 6 us (4 us at M=4)
    calls = []

    def fake_time(fn):
        m = fn.args[0].shape[0]
        if fn.func is F.linear:
            calls.append((m, "dense"))
            return 4.0 if m == 4 else 6.0
        small = runs_small(fn)
        calls.append((m, small))
        return (20.0 if m == 16 else 5.0) if small else 8.0

    monkeypatch.setattr(timing, "cold_time_us", fake_time)
    got = planner.time_decode(mod, torch.device("cpu"))
    assert got["decode_max_m"] == 4 and got["kernel"] == "sk24"
    assert list(got["us"]) == ["1", "4", "16"] and got["us"]["16"] == [20.0, 8.0, 6.0]
    assert calls == [(m, how) for m in (1, 4, 16) for how in (True, False, "dense")]
    note = planner.decode_note(mod, got)
    assert "for M <= 4" in note and "M=16 20.0/8.0/6.0" in note
    assert note.endswith("slower than bf16 dense at M = 4, 16")


def test_position_planes_round_trip_and_feed_the_op():
    x = torch.randn(3, 1024).bfloat16()
    xp = sk24.planes(x)
    assert xp.shape == (3, 4, 256) and torch.equal(xp[:, 1, 5], x[:, 4 * 5 + 1])
    assert torch.equal(sk24.unplanes(xp), x)
    values, meta = sk24.compress(masked_24(32, 1024).bfloat16())
    assert torch.equal(sk24_op.sk24_mm(xp, values, meta, None, None, None),
                       sk24_op.sk24_mm(x, values, meta, None, None, None))
    torch.library.opcheck(sk24_op.sk24_mm, (xp, values, meta, None, None, None))


def test_every_decode_shape_has_a_kernel_config():
    pytest.importorskip("triton")
    from sparsekit.accel.kernels.triton24 import kernel as sk24_triton

    space = sk24_triton.configs()
    for fp8 in (False, True):
        for k in (512, 1024, 4096, 14336, 28672):
            for m in range(1, 65):
                assert any(sk24_triton.fits(c.kwargs, m, k, fp8, c.num_stages)
                           for c in space), (m, k, fp8)
    # a staged tile too big for shared memory is left out, in bf16 but not in fp8
    big = {"MODE": sk24_triton.DOT, "BLOCK_N": 64, "BLOCK_W": 64, "SPLIT_K": 2}
    assert not sk24_triton.fits(big, 16, 4096, False, 2)
    assert sk24_triton.fits(big, 16, 4096, True, 2) and sk24_triton.fits(big, 16, 4096, False, 1)


def test_dense_range_covers_the_buckets_where_dense_beats_the_path_that_would_run():
    from sparsekit.accel.planner import dense_range

    def us(*rows):  # [small-M, large-M, dense] per bucket 1, 4, 16, 32
        return {str(m): list(t) for m, t in zip((1, 4, 16, 32), rows)}

    # the H100's shape: the small-M kernel wins at M=1 only, dense beats both from M=4
    h100 = us([5, 8, 6], [10, 12, 7], [11, 13, 8], [12, 14, 9])
    assert dense_range(h100, 1) == (2, 32)
    assert dense_range(us([5, 8, 6], [6, 9, 7], [7, 9, 8], [8, 9, 10]), 16) == (0, 0)
    # dense beats the large-M path at 16 but not the small-M kernel, which runs there
    assert dense_range(us([5, 8, 6], [6, 9, 7], [7, 9, 8], [9, 9, 10]), 16) == (0, 0)
    assert dense_range(us([5, 8, 6], [6, 9, 7], [7, 9, 8], [9, 9, 10]), 4) == (5, 16)
    # a bucket between two dense ones runs dense too (never slower than dense)
    assert dense_range(us([5, 8, 4], [6, 9, 7], [7, 9, 10], [11, 12, 10]), 32) == (1, 32)
    # an entry timed without dense (stopped early) routes nothing past its last bucket
    assert dense_range({"1": [5, 8, 6], "4": [10, 9, 7]}, 1) == (2, 4)
    assert dense_range({}, 0) == (0, 0)


def _h100_time(fn):
    """Fake ``cold_time_us`` shaped like the H100's: the small-M kernel wins at M=1 only,
    from M=4 both 2:4 paths lose to bf16 dense."""
    m = fn.args[0].shape[0]
    if fn.func is F.linear:
        return 6.0 if m == 1 else 7.0
    return (5.0 if m == 1 else 14.0) if runs_small(fn) else (8.0 if m == 1 else 12.0)


def _decode_planned(monkeypatch, tmp_path, sparsity, variant="bf16_2:4", timer=_h100_time,
                    **options):
    """(model of two 64x512 layers of ``variant``, its Planner, time_decode's calls) after
    ``plan_decode`` as on CUDA: time_decode runs on CPU with the fake ``timer``."""
    from sparsekit.accel import planner
    from sparsekit.accel.options import CompileOptions, PlanOptions
    from sparsekit.accel.planner import decode
    from sparsekit.accel.report import AccelReport
    from sparsekit.nn import timing

    monkeypatch.setenv("SPARSEKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(timing, "cold_time_us", timer)
    calls = []
    real = decode.time_decode

    def on_cpu(mod, device, dense=False, kernel=None):
        calls.append(dense)
        return real(mod, torch.device("cpu"), dense, kernel)

    monkeypatch.setattr(decode, "time_decode", on_cpu)
    int4_plan = decode.plan_config
    monkeypatch.setattr(decode, "plan_config",
                        lambda mod, device: int4_plan(mod, torch.device("cpu")))
    plan = planner.Planner(torch.device("cpu"), variant.split("_")[0], sparsity,
                           PlanOptions(**options), CompileOptions(), False,
                           AccelReport(variant.split("_")[0], sparsity, 1.0, "cpu"))
    plan.device = torch.device("cuda")  # plan as on a GPU
    layers = []
    for seed in (0, 1):
        lin = nn.Linear(512, 64)
        with torch.no_grad():
            lin.weight.copy_(masked_24(64, 512, seed))
        layers.append(VARIANTS[variant](lin))
    model = nn.Sequential(*layers)
    plan.plan_decode(model)
    return model, plan, calls


@pytest.mark.parametrize("variant", ["bf16_2:4", "fp8_2:4"])
def test_auto_runs_dense_where_dense_beats_both_2to4_paths(monkeypatch, tmp_path, variant):
    model, plan, calls = _decode_planned(monkeypatch, tmp_path, "auto", variant)
    assert calls == [True]  # one shape, timed once at every bucket
    mod = model[0]
    assert dense_m(mod) == (2, 32) and limit(mod) == 1 and small(mod) == "sk24"
    assert mod.plan.text() == "M 1: sk24; M 2-32: cublas; M 33+: cusparselt"
    assert set(mod.formats) == {"sk24", "bf16", "cslt"}
    dense_weight = mod.weights("cublas").weight
    assert dense_weight.dtype == torch.bfloat16
    # the copy is the layer's effective weight: the masked one (fp8: dequantized)
    w = mod.weights("sk24")
    want = sk24.decompress(w.values, w.meta).float()
    if mod.w_scale is not None:
        want = want * mod.w_scale[:, None]
    assert torch.equal(dense_weight, want.bfloat16())
    ran = []  # (op, M) of each 2:4 op called
    for op in ("sk24_mm", "sparse24_mm"):
        monkeypatch.setattr(OP_MODULES[op], op, functools.partial(
            lambda real, name, *a: ran.append((name, a[0].shape[0])) or real(*a),
            getattr(OP_MODULES[op], op), op))
    x8 = torch.randn(8, 512).bfloat16()
    y = mod(x8)
    assert torch.equal(y, F.linear(x8, dense_weight, mod.bias)) and ran == []
    x1, x40 = torch.randn(1, 512).bfloat16(), torch.randn(40, 512).bfloat16()
    assert mod(x1).shape == (1, 64) and mod(x40).shape == (40, 64)
    # M=1 on the small-M kernel, M above the last bucket on the large-M path
    assert ran == [("sk24_mm", 1), ("sparse24_mm", 40)]
    # the dense route agrees with the 2:4 path (relative error: bf16 rounding; fp8 W8A8's
    # activation quantization)
    route = mod.plan
    mod.use(LayerPlan(route.routes[1:]), keep=True)
    y24 = mod(x8)
    assert ran[-1] == ("sparse24_mm", 8)
    err = ((y.float() - y24.float()).norm() / y24.float().norm()).item()
    assert err < (1e-2 if variant == "bf16_2:4" else 6e-2), err
    mod.use(route)
    assert "M 2-32: cublas" in repr(mod)
    # compiled whole graph: the route is a branch on the input's rows
    compiled = torch.compile(mod, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x8), y) and torch.equal(compiled(x1), mod(x1))
    extra = 2 * 2 * 64 * 512  # bytes: two layers' copies, 2 bytes per weight
    assert f"decode: {variant} 64x512 runs bf16 dense for M = 2..32 (faster there than its 2:4 " \
           f"paths): a bf16 copy of the weight in 2 layer(s), {extra / 2**20:.1f} MiB extra" \
           in plan.report.notes


def test_auto_drops_the_small_m_copy_where_dense_takes_every_count(monkeypatch, tmp_path):
    def dense_everywhere(fn):
        return 3.0 if fn.func is F.linear else (5.0 if runs_small(fn) else 8.0)

    model, _, _ = _decode_planned(monkeypatch, tmp_path, "auto", timer=dense_everywhere)
    mod = model[0]
    assert dense_m(mod) == (1, 32) and limit(mod) == 0
    assert mod.plan.text() == "M 1-32: cublas; M 33+: cusparselt"
    assert set(mod.formats) == {"bf16", "cslt"}  # the small-M copy dropped


@pytest.mark.parametrize("sparsity, options", [("2:4", {}), ("auto", {"decode_dense": False})])
def test_no_dense_copy_when_2to4_is_forced_or_the_option_is_off(monkeypatch, tmp_path,
                                                                sparsity, options):
    model, plan, calls = _decode_planned(monkeypatch, tmp_path, sparsity, **options)
    assert calls == [False]  # timed as before: up to the first bucket the small-M kernel loses
    for mod in model:
        assert dense_m(mod) == (0, 0) and limit(mod) == 1
        assert set(mod.formats) == {"sk24", "cslt"}  # no bf16 copy
    x8 = torch.randn(8, 512).bfloat16()  # the large-M path
    assert model[0].plan.route(8).kernel == "cusparselt"
    assert torch.equal(model[0](x8), cslt_op.sparse24_mm(
        x8, model[0].weights("cusparselt").packed, model[0].bias, 64, 0, torch.bfloat16))
    assert any(n.endswith("slower than bf16 dense at M = 4") for n in plan.report.notes)
    assert not any("runs bf16 dense" in n for n in plan.report.notes)


def test_cached_decode_plan_reproduces_the_routing(monkeypatch, tmp_path):
    from sparsekit.accel import planner

    first, plan, calls = _decode_planned(monkeypatch, tmp_path, "auto")
    plan.save()
    assert calls == [True]
    (entry,) = [e for k, e in planner.load().items() if "|decode|" in k]
    assert entry["dense_m"] == [2, 32] and entry["decode_max_m"] == 1

    def never(fn):
        raise AssertionError("a cached decode plan was timed again")

    again, _, calls = _decode_planned(monkeypatch, tmp_path, "auto", timer=never)
    assert calls == []
    for a, b in zip(first, again):
        assert (dense_m(b), limit(b)) == (dense_m(a), limit(a)) == ((2, 32), 1)
        assert a.plan == b.plan
        assert torch.equal(a.weights("cublas").weight, b.weights("cublas").weight)


def test_cache_entry_without_dense_route_is_timed_again_under_auto(monkeypatch, tmp_path):
    from sparsekit.accel import planner

    _, plan, calls = _decode_planned(monkeypatch, tmp_path, "2:4")
    plan.save()
    assert calls == [False] and all("dense_m" not in e for e in planner.load().values())
    # forced 2:4 takes the entry as it is; auto times the shape again, with dense
    _, _, calls = _decode_planned(monkeypatch, tmp_path, "2:4")
    assert calls == []
    model, plan, calls = _decode_planned(monkeypatch, tmp_path, "auto")
    assert calls == [True] and dense_m(model[0]) == (2, 32)
    plan.save()
    _, _, calls = _decode_planned(monkeypatch, tmp_path, "2:4")
    assert calls == []


def test_planner_picks_the_mma_config_and_the_plan_carries_it(monkeypatch):
    from sparsekit.accel import planner
    from sparsekit.nn import timing

    monkeypatch.setattr(sk24_mma, "usable", lambda w: True)
    cands = [(8, 4, 1, 0), (4, 4, 1, 0), (8, 4, 1, 1)]
    monkeypatch.setattr(sk24_mma, "candidates", lambda v, wide=None: cands)
    lin = nn.Linear(512, 64)
    with torch.no_grad():
        lin.weight.copy_(masked_24(64, 512))
    mod = VARIANTS["bf16_2:4"](lin)
    assert small(mod) == "mma_sp" and config(mod) is None
    seen = []

    def fake_time(fn):
        if fn.func is F.linear:
            return 6.0
        m = fn.args[0].shape[0]
        if not runs_small(fn):  # the large-M path
            return 8.0
        cfg = sk24_mma.config_for([v for c in config(fn.func) for v in c], m)
        seen.append((m, cfg))
        # direct loads win at M = 1, staged x from M = 2; (4, 4, 1, 0) beats (8, 4, 1, 0)
        return {(4, 4, 1, 0): 3.0, (8, 4, 1, 0): 4.0}.get(cfg, 3.5) * (1 if m == 1 else 2) \
            - (2.0 if m > 1 and cfg == (8, 4, 1, 1) else 0.0)

    monkeypatch.setattr(timing, "cold_time_us", fake_time)
    entry = planner.time_decode(mod, torch.device("cpu"))
    want = ((4, 4, 1, 0), (8, 4, 1, 1), (8, 4, 1, 1), (8, 4, 1, 1))
    assert config(mod) == want and entry["config"] == [list(c) for c in want]
    assert {(m, c) for m in sk24_mma.BUCKETS for c in cands} <= set(seen)
    assert entry["decode_max_m"] == 32
    fresh = VARIANTS["bf16_2:4"](lin)
    planner.route_decode(fresh, entry, dense=False)
    text = "mma_sp 4x4x1x0/8x4x1x1/8x4x1x1/8x4x1x1"
    assert config(fresh) == want and "M 1-32: mma_sp [4x4x1x0/8x4x1x1/" in repr(fresh)
    assert f"({text})" in planner.decode_note(fresh, entry)
    stale = VARIANTS["bf16_2:4"](lin)  # a plan of the 3-number configurations: defaults run
    planner.route_decode(stale, {**entry, "config": [4, 4, 1]}, dense=False)
    assert config(stale) is None
    x = torch.randn(3, 512).bfloat16()  # the config reaches the op (its CPU reference)
    with_limit(fresh, 0)
    want = fresh(x)
    with_limit(fresh, 32)
    torch.testing.assert_close(fresh(x).float(), want.float(), rtol=2e-2, atol=2e-2)


def _fp8_choice_timer(faster: str):
    """Fake ``cold_time_us``: the small-M kernel ``faster`` ("mma" or "triton") takes 3 us at
    every M, the other 5; the large-M path 8, dense 9."""
    def fake(fn):
        if fn.func is F.linear:
            return 9.0
        if not runs_small(fn):
            return 8.0
        return 3.0 if small(fn.func) == KERNEL[faster] else 5.0
    return fake


def test_planner_chooses_the_int4_mma_configuration_per_bucket(monkeypatch, tmp_path):
    """On a GPU the decode plan times the mma.sp kernel's int4 configurations per M bucket
    (here with a fake timer, the CPU reference running), keeps the fastest in each, hands
    them to the op on every call and reads them back from the plan cache."""
    monkeypatch.setattr(sk24_mma, "usable_int4",
                        lambda q, group: sk24_mma.check_int4(*q.shape, group) is None)
    cands = [(8, 4, 1, 1), (8, 4, 1, 7), (4, 4, 1, 3)]
    monkeypatch.setattr(sk24_mma, "candidates",
                        lambda values, wide=None: list(cands) if values.dtype == torch.int32
                        else [])
    # (8, 4, 1, 7) fastest at M = 1 and 2..8, (4, 4, 1, 3) from 9
    fastest = {1: (8, 4, 1, 7), 8: (8, 4, 1, 7), 16: (4, 4, 1, 3), 32: (4, 4, 1, 3)}

    def fake_time(fn):
        mod, m = fn.func, fn.args[0].shape[0]
        assert isinstance(mod, layers_int4.Int4Sparse24) and m in fastest
        return 1.0 if config(mod)[0] == fastest[m] else 2.0

    model, plan, _ = _decode_planned(monkeypatch, tmp_path, "2:4", "int4_2:4", timer=fake_time)
    want = tuple(fastest[m] for m in sk24_mma.BUCKETS)
    assert all(small(m) == "mma_sp_int4" and config(m) == want for m in model)
    text = sk24_mma.config_text(want)
    assert sum("on the mma_sp_int4 kernel" in n and text in n for n in plan.report.notes) == 1
    assert text in repr(model[0])
    seen = []
    real = mma_op.sk24_mma_int4_mm
    monkeypatch.setattr(mma_op, "sk24_mma_int4_mm", lambda *a: seen.append(a[-1]) or real(*a))
    x = torch.randn(3, 512).bfloat16()
    y = model[0](x)
    assert seen == [[v for c in want for v in c]]  # the op gets the plan's configurations
    model[0].use(LayerPlan(tuple(Route(r.lo, r.hi, r.kernel) for r in model[0].plan.routes)))
    assert torch.equal(y, model[0](x)) and seen[-1] is None
    plan.save()

    def never(fn):
        raise AssertionError("a cached int4 plan was timed again")

    again, _, _ = _decode_planned(monkeypatch, tmp_path, "2:4", "int4_2:4", timer=never)
    assert all(config(m) == want for m in again)


def test_fp8_weight_only_layer_decodes_on_the_mma_kernel_where_it_loads(monkeypatch, tmp_path):
    """W8A16 2:4 layers go straight to the mma.sp kernel where the library takes them (bf16
    x): the plan times that kernel's configurations, never the Triton kernel's."""
    monkeypatch.setattr(sk24_mma, "choosable",
                        lambda w, wide=torch.float16: w.dtype == torch.float8_e4m3fn
                        and wide == torch.bfloat16)
    monkeypatch.setattr(sk24_mma, "candidates",
                        lambda v, wide=None: [(8, 4, 1, 1), (8, 4, 1, 3)])
    timed = []

    def timer(fn):
        if fn.func is F.linear:
            return 9.0
        if not runs_small(fn):
            return 8.0
        timed.append(small(fn.func))
        return 3.0
    model, plan, calls = _decode_planned(monkeypatch, tmp_path, "2:4", "fp8w_2:4", timer=timer)
    assert calls == [False]  # one shape, one kernel
    assert timed and set(timed) == {"mma_sp"}
    for mod in model:
        assert small(mod) == "mma_sp" and mod.choices["small"] == ("mma_sp",)
        assert limit(mod) == 32 and config(mod) is not None
        mma, own = mod.weights("mma_sp"), mod.weights("sk24_widen")
        assert torch.equal(sk24_mma.decompress(mma.values, mma.meta).float(),
                           sk24.decompress(own.values, own.meta).float())
        x = torch.randn(3, 512).bfloat16()
        y = mod(x)
        with_limit(mod, 0)
        torch.testing.assert_close(y.float(), mod(x).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("faster", ["mma", "triton"])
def test_fp8_layer_times_both_small_m_kernels_and_keeps_the_faster(monkeypatch, tmp_path,
                                                                    faster):
    variant = "fp8_2:4"  # W8A8 (W8A16 layers go to the mma.sp kernel untimed: the test above)
    wides = []
    monkeypatch.setattr(sk24_mma, "choosable",
                        lambda w, wide=torch.float16: w.dtype == torch.float8_e4m3fn)
    monkeypatch.setattr(sk24_mma, "candidates",
                        lambda v, wide=None: wides.append(wide) or [(8, 4, 1, 1), (8, 4, 1, 3)])
    model, plan, calls = _decode_planned(monkeypatch, tmp_path, "2:4", variant,
                                         timer=_fp8_choice_timer(faster))
    assert calls == [False, False]  # one shape: once per kernel
    if faster == "mma":  # the configurations of the way x reaches the kernel (CPU: bf16)
        assert wides and set(wides) == {torch.bfloat16}
    for seed, mod in enumerate(model):
        assert mod.choices["small"] == ("mma_sp", "sk24")
        assert small(mod) == KERNEL[faster] and limit(mod) == 32
        assert set(mod.formats) == {"mma" if faster == "mma" else "sk24", "cslt"}
        # the copy holds exactly the layer's 2:4 weight, whichever format it is in
        w = mod.weights(KERNEL[faster])
        got = (sk24_mma if faster == "mma" else sk24).decompress(w.values, w.meta)
        lin = nn.Linear(512, 64)
        with torch.no_grad():
            lin.weight.copy_(masked_24(64, 512, seed))
        fresh = VARIANTS[variant](lin).weights("sk24")  # the same weight, the Triton format
        assert got.dtype == torch.float8_e4m3fn
        assert torch.equal(got.float(), sk24.decompress(fresh.values, fresh.meta).float())
        # the decode path keeps the large-M path's numerics (W8A8: same quantized products)
        x = torch.randn(3, 512).bfloat16()
        y = mod(x)
        route = mod.plan
        with_limit(mod, 0)
        torch.testing.assert_close(y.float(), mod(x).float(), rtol=2e-2, atol=2e-2)
        mod.use(route)
    other = "triton" if faster == "mma" else "mma"
    assert any(f"{KERNEL[faster]} chosen over {KERNEL[other]} (small-M us: M=1 3.0 vs 5.0"
               in n for n in plan.report.notes)
    if faster == "mma":
        assert config(model[0]) is not None  # the mma configurations were chosen too
    plan.save()

    def never(fn):
        raise AssertionError("a cached decode plan was timed again")

    again, _, calls = _decode_planned(monkeypatch, tmp_path, "2:4", variant, timer=never)
    assert calls == [] and all(small(m) == KERNEL[faster] for m in again)
    for a, b in zip(model, again):
        wa, wb = a.weights(KERNEL[faster]), b.weights(KERNEL[faster])
        assert torch.equal(wa.values.view(torch.uint8), wb.values.view(torch.uint8))
        assert torch.equal(wa.meta, wb.meta) and a.plan == b.plan


def test_decode_kernel_moves_exactly_and_refuses_what_it_cannot_do():
    lin = nn.Linear(512, 64)
    with torch.no_grad():
        lin.weight.copy_(masked_24(64, 512))
    mod = VARIANTS["fp8_2:4"](lin)
    # CPU: the mma library is not there
    assert small(mod) == "sk24" and mod.choices["small"] == ("sk24",)
    w = mod.weights("sk24")
    values, meta = w.values.clone(), w.meta.clone()
    large = mod.plan.routes[-1]
    mod.use(LayerPlan((Route(1, 32, "mma_sp"), large)))
    w = mod.weights("mma_sp")
    assert set(mod.formats) == {"mma", "cslt"} and w.values.dim() == 4  # fragment-ordered
    assert torch.equal(sk24_mma.decompress(w.values, w.meta).float(),
                       sk24.decompress(values, meta).float())
    mod.use(LayerPlan((Route(1, 32, "sk24"), large)))  # and back, to the very same encoding
    w = mod.weights("sk24")
    assert torch.equal(w.values.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(w.meta, meta)
    with pytest.raises(ValueError, match="no kernel 'cuda'; registered: "):
        mod.use(LayerPlan((Route(1, 32, "cuda"), large)))
    mod.use(LayerPlan((large,)))  # the cuSPARSELt copy alone (here the dense weight): kept
    with pytest.raises(ValueError, match=r"fp8_2:4 layer \(64x512\): none of its weight "
                                         r"copies \(cslt\) can be unpacked"):
        mod.use(LayerPlan((Route(1, 32, "mma_sp"), large)))


def test_decode_cost_counts_the_path_each_count_runs():
    from sparsekit.accel.planner.decode import decode_cost_us

    entry = {"decode_max_m": 4, "us": {"1": [2, 9, 5], "4": [3, 9, 5], "16": [9, 6, 5]}}
    assert decode_cost_us(entry, [1, 4, 16]) == 2 + 3 + 6
    assert decode_cost_us(entry, [1]) == 2


def test_generate_runs_under_a_raised_recompile_limit(monkeypatch):
    # the fast sibling of the test below: generate raises dynamo's per-code-object limit while
    # it runs (so that many models of one class each compile) and restores it after
    from sparsekit import _compat
    from sparsekit.accel.generate import Generator

    config = torch._dynamo.config
    before, seen = config.recompile_limit, []
    model, _ = _tiny_llama()
    ids = torch.randint(0, 256, (1, 5))
    fast = sk.accelerate(model, {"input_ids": ids}, device="cpu", compile=False)
    loop = Generator._loop
    monkeypatch.setattr(Generator, "_loop", lambda self, *a: (
        seen.append(config.recompile_limit), loop(self, *a))[1])
    fast.generate(ids, max_new_tokens=2)
    assert seen == [max(_compat.FRAME_COMPILES, before)] and seen[0] > 8
    assert config.recompile_limit == before


@pytest.mark.slow  # five models compiled; the limit it relies on: the test above
def test_several_models_of_one_class_each_compile():
    # dynamo's recompile limit (8) is per code object, shared by every LlamaForCausalLM in the
    # process: without sparsekit raising it, the fourth model here would run uncompiled
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(1))
    for i in range(5):  # distinct widths: no model can reuse another's graphs
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64,
                                       intermediate_size=128 + 64 * i, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2)
        fast = sk.accelerate(transformers.LlamaForCausalLM(cfg).eval(), {"input_ids": ids},
                             device="cpu", compile=sk.CompileOptions(backend="eager"))
        fast.generate(ids, max_new_tokens=3)
        assert fast.report.compiles >= 2, f"model {i} ran uncompiled"


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp8w", marks=pytest.mark.slow)])
def test_generate_runs_sibling_groups_as_one_decode_gemm(precision):
    """PlanOptions(siblings=True) under inductor: generate's compiled runners take the model's
    inductor options (the MergeSameCalls pass), so each decode step runs q/k/v and gate/up as
    one small-M GEMM each (4 a layer, not 7) and the tokens are HF's generate of the masked
    model (fp8w: of the fp8_weight_only model run in float64)."""
    torch._dynamo.reset()
    model, ref = _tiny_llama()
    if precision == "fp8w":  # QuantLinear members: weights and per-channel scales concatenated
        sk.quantize_(model, "fp8_weight_only", exclude=["lm_head"])
        ref = copy.deepcopy(model).double()
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))
    fast = sk.accelerate(model, {"input_ids": ids}, device="cpu", precision=precision,
                         compile=sk.CompileOptions(warmup=False),
                         plan=sk.PlanOptions(siblings=True))
    assert sum(n.startswith("siblings fused") for n in fast.report.notes) == 4  # 2 a layer
    groups = {id(m.group) for m in fast.model.modules() if type(m).__name__ == "SiblingSlice"}
    assert len(groups) == 4
    new = 4
    fast.generate(ids, max_new_tokens=new)  # compiles (tracing runs the ops too)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fast.generate(ids, max_new_tokens=new)
    decode_gemms = sum(e.name == "sparsekit::sk24_mm" for e in prof.events())
    # forwards (the prefill's 2 x 16 rows are within the small-M limit too, then new - 1
    # decode steps) x layers x (qkv, o, gate_up, down); unfused it would be 7 a layer
    assert decode_gemms == new * 2 * 4
    want = ref.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
    assert torch.equal(out, want)


def _counting_graph_timer(seen: list):
    """Fake ``graph_time_us``: calls ``fn`` ``calls`` times (what the graph would capture) and
    returns the count."""
    def fake(fn, calls=None, **_):
        for _ in range(calls or 1):
            seen.append(fn())
        return float(calls or 1)
    return fake


def test_cold_time_cycles_copies_of_a_modules_tensors_and_restores_them(monkeypatch):
    """The decode plan's timer reads each call's weight from its own copy (so a weight under the
    L2's size comes from memory, as in a decode step) and leaves the module as it found it."""
    from sparsekit.nn import timing

    lin = nn.Linear(64, 32)
    lin.register_buffer("scale", torch.rand(32))
    weight, scale = lin.weight, lin.scale
    seen = []

    def reads(x):
        seen.append((lin.weight.data_ptr(), lin.scale.data_ptr()))
        return nn.functional.linear(x, lin.weight, lin.bias) * lin.scale

    lin.forward = reads
    monkeypatch.setattr(timing, "l2_copies", lambda nbytes, device: 3)
    calls = []
    monkeypatch.setattr(timing, "graph_time_us", _counting_graph_timer(calls))
    x = torch.randn(2, 64)
    want = reads(x)
    seen.clear()
    assert timing.cold_time_us(functools.partial(lin, x)) == 12.0  # 3 copies x 4 rounds
    assert len(set(seen)) == 3 and seen[:3] == seen[3:6]
    assert all(torch.equal(y, want) for y in calls)
    assert lin.weight is weight and lin.scale is scale
    assert isinstance(lin.weight, nn.Parameter)


def test_cold_time_cycles_a_functions_weights_not_its_activations(monkeypatch):
    from sparsekit.nn import timing

    x, w = torch.randn(2, 16), torch.randn(8, 16)
    used = []

    def gemm(a, b):
        used.append((a.data_ptr(), b.data_ptr()))
        return a @ b.T

    monkeypatch.setattr(timing, "l2_copies", lambda nbytes, device: 2)
    out = []
    monkeypatch.setattr(timing, "graph_time_us", _counting_graph_timer(out))
    assert timing.cold_time_us(functools.partial(gemm, x, w)) == 10.0
    assert {a for a, _ in used} == {x.data_ptr()} and len({b for _, b in used}) == 2
    assert all(torch.equal(y, x @ w.T) for y in out)


def test_a_decode_plan_timed_otherwise_is_timed_again(monkeypatch, tmp_path):
    """Cached decode plans from before the weights-from-memory timing are timed again; those
    timed that way are reused."""
    from sparsekit.accel import planner

    model, plan, _ = _decode_planned(monkeypatch, tmp_path, "2:4")
    mod, made = model[0], []

    def fresh_plan():
        made.append(1)
        return {"decode_max_m": 4, "us": {}}

    for cached, timed_again in (({"decode_max_m": 1, "us": {}}, True),
                                ({"decode_max_m": 1, "us": {},
                                  "timing": planner.DECODE_TIMING}, False)):
        key = planner.plan_key(plan.name, torch.__version__, "x", mod.out_features,
                               mod.in_features, 0, inductor=plan.inductor)
        plan.cache[key] = cached
        made.clear()
        _, entry, new = plan._decode_entry(mod, "x", {}, fresh_plan, fresh=lambda e: True)
        assert made == ([1] if timed_again else []) and new
        assert entry["decode_max_m"] == (4 if timed_again else 1)
        assert entry["timing"] == planner.DECODE_TIMING
