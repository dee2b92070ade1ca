"""GPU tests (run on the H200; skipped without CUDA): every variant against an fp32 reference
with the same 2:4 mask, the CUDA ops against their CPU references, the compiled model (default
path) with varying shapes and its recompile count, the MultiheadAttention conversion end to
end, and load -> accelerate."""

import copy

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.accel.kernels.cusparselt import op as cslt_op
from sparsekit.accel import algsearch, ops
from sparsekit.accel import layers
from sparsekit.quant.formats import FP8, INT8
from sparsekit.quant.numerics import absmax_scale, quantize, weight_scales

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
TOL = {"bf16": 1e-2, "fp8": 6e-2, "int8": 6e-2, "int4": 0.1}  # int4: RTN, group 128


def make_24_(module: nn.Module) -> nn.Module:
    """Magnitude 2:4 on every Linear weight (and MultiheadAttention in_proj), in place."""
    with torch.no_grad():
        for m in module.modules():
            for name in ("weight", "in_proj_weight"):
                w = getattr(m, name, None)
                if isinstance(m, (nn.Linear, nn.MultiheadAttention)) and w is not None \
                        and w.dim() == 2 and w.shape[1] % 4 == 0:
                    g = w.reshape(w.shape[0], -1, 4)
                    keep = g.abs().topk(2, dim=-1).indices
                    mask = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, keep, True)
                    w.copy_((g * mask).reshape(w.shape))
    return module


def rel_err(y, ref):
    y, ref = y.detach().double().cpu(), ref.detach().double().cpu()
    return ((y - ref).norm() / ref.norm()).item()


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEKIT_CACHE", str(tmp_path))


@pytest.mark.parametrize("variant", list(layers.VARIANTS))
@pytest.mark.parametrize("shape", [(394, 1024), (2, 197, 1024)])
def test_variant_matches_fp32_reference(variant, shape):
    torch.manual_seed(0)
    lin = make_24_(nn.Linear(1024, 2048)).cuda()
    x = torch.randn(*shape, device="cuda")
    ref = nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double())
    y = layers.VARIANTS[variant](lin)(x.bfloat16())
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    assert rel_err(y, ref) <= TOL[variant.split("_")[0]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_cuda_ops_match_cpu_reference(dtype):
    torch.manual_seed(0)
    w = make_24_(nn.Linear(512, 256)).weight.detach()
    x = torch.randn(40, 512)  # 40 rows: the CUDA op pads to a multiple of 16
    if dtype == torch.bfloat16:
        args = (x.bfloat16(), w.bfloat16(), torch.randn(256).bfloat16(), 256, 0, torch.bfloat16)
    else:
        fmt = FP8 if dtype == torch.float8_e4m3fn else INT8
        q, _ = ops.act_quant_rows(x, fmt)
        wq, _ = ops.act_quant_rows(w, fmt)  # per-row absmax: a valid 8-bit 2:4 weight
        args = (q, wq, None, 256, 0, torch.bfloat16)
    ref = cslt_op.sparse24_mm(*args)
    cuda_args = [a.cuda() if torch.is_tensor(a) else a for a in args]
    cuda_args[1] = cslt_op.pack_24(cuda_args[1])
    y = cslt_op.sparse24_mm(*cuda_args)
    assert rel_err(y, ref) <= 1e-2
    q, s = ops.quant_rows(x.cuda().bfloat16(), torch.int8)
    q_ref, s_ref = ops.quant_rows(x.bfloat16(), torch.int8)
    assert torch.equal(q.cpu(), q_ref) and torch.allclose(s.cpu(), s_ref)


@pytest.mark.parametrize("precision", ["bf16", "fp8", "int8"])
def test_compiled_model_accurate_and_recompiles_counted(precision):
    torch.manual_seed(0)
    model = make_24_(nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))).eval()
    xs = {n: torch.randn(n, 64, 256, dtype=torch.float64) for n in (4, 3, 9, 16)}
    with torch.no_grad():
        refs = {n: model.double()(x) for n, x in xs.items()}
    fast = sk.accelerate(model.float(), xs[4].float(), precision=precision)
    assert all(d.variant == f"{precision}_2:4" for d in fast.report.layers)
    outs = {n: fast(x.float()) for n, x in xs.items()}
    for n, out in outs.items():  # outputs are cloned: later calls did not overwrite them
        assert rel_err(out, refs[n]) <= TOL[precision]
    assert 1 <= fast.report.compiles <= 2  # the second shape compiles once, dynamic


class _TwoGraphs(nn.Module):
    """Two Linears with a graph break between them."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(256, 512), nn.Linear(512, 256)

    def forward(self, x):
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h)


def test_own_cuda_graphs_replay_new_inputs_and_step_aside_for_graph_breaks():
    """The default on CUDA: sparsekit's own graph per input signature, each call's values
    copied in (every output right for its own input); a model compiled into two graphs runs
    under reduce-overhead instead, still right, and the report says why."""
    torch.manual_seed(0)
    model = make_24_(nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))).eval()
    ref = copy.deepcopy(model).double()
    fast = sk.accelerate(copy.deepcopy(model), torch.randn(8, 256))
    assert fast.capture and len(fast.graphs.graphs) == 1
    xs = [torch.randn(8, 256) for _ in range(3)]
    outs = [fast(x) for x in xs]
    for x, out in zip(xs, outs):
        assert rel_err(out, ref(x.double())) <= TOL["bf16"]
    assert len(fast.graphs.graphs) == 1 and fast.report.compiles == 1
    broken = make_24_(_TwoGraphs()).eval()
    ref = copy.deepcopy(broken).double()
    fb = sk.accelerate(copy.deepcopy(broken), xs[0])
    assert fb.graphs is None
    assert any(n.startswith("own CUDA graphs off (the compiled model is 2 graphs")
               for n in fb.report.notes)
    for x in xs:
        assert rel_err(fb(x), ref(x.double())) <= TOL["bf16"]


def test_own_graph_survives_a_reduce_overhead_model_built_after_it():
    """Inductor's CUDA-graph trees clear cuBLAS's cached workspaces when they record; a graph
    of ours captured with a cached workspace then wrote freed memory (H200, run 32: "unspecified
    launch failure" in BERT's fp8s auto row). Ours, fp8 dense and 2:4 layers (cuBLASLt and
    cuSPARSELt), still right after a reduce-overhead model was recorded and run."""
    torch.manual_seed(0)
    model = make_24_(nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))).eval()
    ref = copy.deepcopy(model).double()
    fast = sk.accelerate(copy.deepcopy(model), torch.randn(64, 256), precision="fp8",
                         sparsity="auto", plan=sk.PlanOptions(whole_model=False))
    assert fast.capture
    x = torch.randn(64, 256)
    other = torch.compile(copy.deepcopy(model).cuda().bfloat16(), mode="reduce-overhead")
    for _ in range(3):  # warm-up, record, replay: the trees clear the workspaces
        with torch.no_grad():
            other(torch.randn(512, 256, device="cuda", dtype=torch.bfloat16))
    for _ in range(3):
        with torch.no_grad():
            other(torch.randn(512, 256, device="cuda", dtype=torch.bfloat16))
        assert rel_err(fast(x), ref(x.double())) <= TOL["fp8"]
    torch.cuda.synchronize()


def test_alg_search_uses_cache():
    lin = make_24_(nn.Linear(512, 1024)).cuda()
    _, alg, timings = algsearch.search("bf16_2:4", lin, 256)
    assert timings and alg == min(timings, key=timings.get)
    _, alg2, timings2 = algsearch.search("bf16_2:4", lin, 256)
    assert alg2 == alg and timings2 == {}


def test_vit_mha_converted_and_accurate():
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    vit = make_24_(VisionTransformer(image_size=64, patch_size=16, num_layers=2, num_heads=4,
                                     hidden_dim=256, mlp_dim=1024, num_classes=16)).eval()
    nn.init.normal_(vit.heads.head.weight, std=0.02)  # torchvision zero-inits the head
    x = torch.randn(8, 3, 64, 64)
    with torch.no_grad():
        ref = vit.double()(x.double())
    fast = sk.accelerate(vit.float(), x, precision="bf16", sparsity="2:4")
    report = fast.sparsekit_report
    names = {d.name: d for d in report.layers}
    assert names["encoder.layers.encoder_layer_0.self_attention.in_proj"].variant == "bf16_2:4"
    assert names["encoder.layers.encoder_layer_1.mlp.0"].variant == "bf16_2:4"
    # the 16x16 stride-16 patch embedding runs as a GEMM (its weight is not 2:4: bf16 dense)
    assert names["conv_proj.linear"].variant == "bf16_dense"
    assert rel_err(fast(x), ref) <= 1e-2


def test_auto_never_keeps_a_slower_layer():
    torch.manual_seed(0)
    model = make_24_(nn.Sequential(nn.Linear(768, 3072), nn.GELU(), nn.Linear(3072, 768)))
    fast = sk.accelerate(model, torch.randn(64, 768), precision="fp8", sparsity="auto")
    r = fast.sparsekit_report
    for d in r.layers:
        assert set(d.timings_us) == {"bf16_dense", "fp8_dense", "bf16_2:4", "fp8_2:4"}
    # the whole-model plan kept is never slower than the all-dense one it was timed against
    assert r.plan in r.plans_ms and r.plans_ms[r.plan] <= r.plans_ms["dense"]
    assert {d.variant for d in r.layers} <= {"bf16_dense", "fp8_dense", "bf16_2:4", "fp8_2:4"}
    # a second accelerate of the same model and shapes takes its plan from the disk cache
    model2 = make_24_(nn.Sequential(nn.Linear(768, 3072), nn.GELU(), nn.Linear(3072, 768)))
    again = sk.accelerate(model2, torch.randn(64, 768), precision="fp8", sparsity="auto")
    assert again.sparsekit_report.plan == r.plan
    assert any("(cached)" in n for n in again.sparsekit_report.notes)


def test_load_goes_straight_to_accelerated(tmp_path):
    torch.manual_seed(0)
    model = make_24_(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)))
    sk.save(model, tmp_path / "m.safetensors")
    x = torch.randn(32, 256)
    ref = model.double()(x.double())
    fresh = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    fast = sk.load(tmp_path / "m.safetensors", model=fresh,
                   accelerate={"example_inputs": x, "precision": "bf16", "sparsity": "2:4"})
    assert isinstance(fast, sk.accel.AcceleratedModel)
    assert rel_err(fast(x), ref) <= 1e-2


class _LlamaBlock(nn.Module):
    """RMSNorm -> q/k/v -> causal attention -> o, RMSNorm -> SiLU(gate) * up -> down."""

    def __init__(self, d=256, heads=4, ffn=512):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).reshape(b, t, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


@pytest.mark.parametrize("precision", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("fused_quant", [True, False])
def test_llama_block_compiled_accurate(precision, fused_quant):
    torch.manual_seed(0)
    block = make_24_(_LlamaBlock()).eval()
    x = torch.randn(4, 64, 256)
    with torch.no_grad():
        ref = copy.deepcopy(block).double()(x.double())
    fast = sk.accelerate(block.float(), x, precision=precision,
                         plan=sk.PlanOptions(fused_quant=fused_quant))
    assert len(fast.report.layers) == 7
    assert rel_err(fast(x), ref) <= TOL[precision]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_siblings_one_gemm_and_no_weight_copies(precision):
    """PlanOptions(siblings=True) under reduce-overhead: fewer sparse GEMM kernels than the
    plain model, no device-to-device copy per weight on each replay (what inductor freezing
    caused: run 9 of journal/gpu.md), the same output within the variant's tolerance."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    block = make_24_(_LlamaBlock()).eval()
    x = torch.randn(4, 64, 256)
    with torch.no_grad():
        ref = copy.deepcopy(block).double()(x.double())

    def kernels_of(fast):
        fast(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.compiler.cudagraph_mark_step_begin()
            fast(x)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA]
        return (sum("sparse" in n.lower() and "gemm" in n.lower() for n in names),
                sum("memcpy dtod" in n.lower() for n in names))

    # the plan pinned: the same fixed variants in both (no timing-dependent whole-model choice)
    # and cuSPARSELt's default algorithm, not one searched or cached by an earlier test (an
    # algorithm may launch more than one kernel a GEMM: the counts below would not compare;
    # the fp8 case failed in a whole GPU-suite run, not alone)
    pinned = dict(whole_model=False, search_algs=False, cache=False)
    plain = sk.accelerate(copy.deepcopy(block).float(), x, precision=precision,
                          plan=sk.PlanOptions(**pinned))
    fused = sk.accelerate(copy.deepcopy(block).float(), x, precision=precision,
                          plan=sk.PlanOptions(siblings=True, **pinned))
    assert sum(n.startswith("siblings fused") for n in fused.report.notes) == 2
    (g_plain, c_plain), (g_fused, c_fused) = kernels_of(plain), kernels_of(fused)
    assert g_fused == g_plain - 3  # q/k/v one GEMM, gate/up one GEMM
    assert c_fused <= c_plain
    assert rel_err(fused(x), ref) <= TOL[precision]


def test_flush_l2_writes_twice_the_l2():
    from sparsekit.nn import timing

    timing.flush_l2("cuda")
    buf = timing._FLUSH[torch.device("cuda")]
    assert buf.is_cuda and buf.numel() >= 2 * torch.cuda.get_device_properties(0).L2_cache_size
    assert int(buf.max()) == 0
    assert timing.time_ms(lambda: buf.sum(), "cuda", repeats=3,
                          before=lambda: timing.flush_l2("cuda")) > 0


def _fp8_case(n, k, m, shift=0.0, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = make_24_(nn.Linear(k, n, device="cuda")).weight.detach() * scale
    x = torch.randn(m, k, device="cuda", generator=g)
    sw, sx = weight_scales(w, FP8, "tensor")[0], absmax_scale(x.abs().amax(), FP8)
    wq, xq = quantize(w, sw, FP8), quantize(x, sx, FP8)
    bias = (torch.randn(n, device="cuda", generator=g) * 0.1 + shift).to(torch.bfloat16)
    lin = (xq.double() @ wq.double().t()) * (sx * sw).item() + bias.double()
    return wq, xq, bias, (sx * sw).item(), lin


def test_own_binding_builds_and_matches_float64():
    """sparsekit's cuSPARSELt binding builds here and gives alpha * x @ W.T + bias (and its
    GELU) within bf16 rounding of float64 on the same 8-bit values, eagerly, at every
    algorithm, at an odd row count (padded) and replayed from a CUDA graph."""
    assert cslt_op.alpha_path(), "sparsekit's cuSPARSELt binding did not build"
    wq, xq, bias, alpha, lin = _fp8_case(1024, 512, 200)
    packed = cslt_op.pack_24(wq)
    for gelu in (False, True):
        ref = torch.nn.functional.gelu(lin, approximate=cslt_op.GELU_APPROXIMATE) if gelu else lin
        for alg in range(3):
            y = cslt_op.sparse24_mm_alpha(xq, packed, bias, 1024, alg, alpha, gelu)
            assert y.shape == (200, 1024) and rel_err(y, ref) < 5e-3, (gelu, alg)
    with pytest.raises(RuntimeError, match="out of range"):  # where the alg search stops
        cslt_op.sparse24_mm_alpha(xq, packed, bias, 1024, 1000, alpha, False)
    static = xq.clone()
    graph = torch.cuda.CUDAGraph()
    cslt_op.sparse24_mm_alpha(static, packed, bias, 1024, 0, alpha, False)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = cslt_op.sparse24_mm_alpha(static, packed, bias, 1024, 0, alpha, False)
    static.copy_(torch.zeros_like(static))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), bias.float().expand(200, -1))


def test_cusparselt_gelu_is_the_form_the_pass_fuses():
    """Pre-activations near -3, where the erf and tanh forms of GELU differ by about 10%: the
    epilogue's GELU is cslt_op.GELU_APPROXIMATE's form (the only one FuseGelu rewrites)."""
    wq, xq, bias, alpha, lin = _fp8_case(1024, 512, 256, shift=-3.0, scale=0.02)
    y = cslt_op.sparse24_mm_alpha(xq, cslt_op.pack_24(wq), bias, 1024, 0, alpha, True)
    errs = {form: rel_err(y, torch.nn.functional.gelu(lin, approximate=form))
            for form in ("none", "tanh")}
    assert errs[cslt_op.GELU_APPROXIMATE] < 0.01 < errs[{"none": "tanh", "tanh": "none"}[
        cslt_op.GELU_APPROXIMATE]], errs


def test_per_tensor_fp8_model_runs_the_epilogue_in_the_gemm():
    """An fp8_static_tensor MLP on CUDA: both layers on sparsekit's binding, the GELU folded
    into fc1's GEMM, the output within fp8 error of the quantized model's own forward."""
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(approximate="tanh"),
                          nn.Linear(2048, 512)).cuda()
    make_24_(model)
    x = torch.randn(4, 128, 512, device="cuda")
    sk.quantize_(model, "fp8_static_tensor", calibration=[x])
    with torch.no_grad():
        ref = model(x)
    with torch._inductor.config.patch(force_disable_caches=True):
        fast = sk.accelerate(model, x, precision="fp8", sparsity="2:4")
    assert [m.path for m in (fast.model[0], fast.model[2])] == ["cslt_alpha"] * 2
    assert fast.fuse_gelu is not None and fast.fuse_gelu.fused == 1
    assert rel_err(fast(x), ref) < TOL["fp8"]
