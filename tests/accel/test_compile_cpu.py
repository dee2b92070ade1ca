"""accelerate on CPU (reference ops): the three model families trace with zero graph breaks and
compile with fullgraph=True, outputs keep their types, recompiles are counted, the planner's
decisions on recorded H200 timings, and a quantized model is accelerated from its QuantLinears.
Tiny configs, one or two layers: each test stays within seconds on two CPU cores."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.accel import planner
from sparsekit.accel import layers
from sparsekit.accel.api import output_types_equal
from sparsekit.quant import QuantLinear

transformers = pytest.importorskip("transformers")
torchvision = pytest.importorskip("torchvision")


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg), {"input_ids": torch.randint(0, 128, (2, 16))}


def _bert():
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=1, num_attention_heads=4,
                                  max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    return transformers.BertModel(cfg), {"input_ids": torch.randint(0, 128, (2, 16)),
                                         "attention_mask": torch.ones(2, 16, dtype=torch.long)}


def _vit():
    vit = torchvision.models.VisionTransformer(image_size=32, patch_size=16, num_layers=1,
                                               num_heads=2, hidden_dim=64, mlp_dim=128)
    vit.heads = nn.Identity()  # torchvision zero-initialises the head: compare features
    return vit, torch.randn(2, 3, 32, 32)


def _call(m, x):
    return m(**x) if isinstance(x, dict) else m(x)


def _as_bf16(x):
    if isinstance(x, dict):
        return x
    return x.bfloat16()


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEKIT_CACHE", str(tmp_path))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# the default run traces each model and each precision once (llama-int8, bert-bf16, vit-fp8);
# the other pairs are slow
@pytest.mark.parametrize("build,precision", [
    pytest.param(_llama, "bf16", marks=pytest.mark.slow),
    pytest.param(_llama, "fp8", marks=pytest.mark.slow), (_llama, "int8"),
    pytest.param(_bert, "int8", marks=pytest.mark.slow), (_bert, "bf16"),
    (_vit, "fp8")], ids=["llama-bf16", "llama-fp8", "llama-int8", "bert-int8", "bert-bf16",
                         "vit-fp8"])
def test_accelerated_models_trace_without_graph_breaks(build, precision):
    torch.manual_seed(0)
    model, x = build()
    sk.prune_(model.eval(), pattern="2:4", criterion="magnitude")
    with torch.no_grad():
        ref = _call(copy.deepcopy(model).double(), x if isinstance(x, dict) else x.double())
    fast = sk.accelerate(model, x, precision=precision, device="cpu",
                         compile=sk.CompileOptions(backend="eager"))
    sparse = {d.variant for d in fast.report.layers}
    assert f"{precision}_2:4" in sparse  # the 2:4 layers were swapped
    assert any(isinstance(m, layers.VARIANTS[f"{precision}_2:4"]) for m in fast.model.modules())
    with torch.no_grad():  # before explain, which resets dynamo: this call reuses the compile
        out = fast(**x) if isinstance(x, dict) else fast(x)
    explain = torch._dynamo.explain(fast.model)
    exp = explain(**x) if isinstance(x, dict) else explain(_as_bf16(x))
    assert exp.graph_break_count == 0, exp.break_reasons
    ops_called = {str(n.target) for g in exp.graphs for n in g.graph.nodes
                  if n.op == "call_function"}
    assert any("sparsekit.sparse24_mm" in o for o in ops_called)
    assert output_types_equal(out, ref)
    y = out if isinstance(out, torch.Tensor) else out[0]
    r = ref if isinstance(ref, torch.Tensor) else ref[0]
    err = (y.double() - r).norm() / r.norm()
    assert err < {"bf16": 0.03, "fp8": 0.12, "int8": 0.05}[precision]


@pytest.mark.slow  # the graph-break count of the test above says the same; this compiles too
def test_fullgraph_compile_of_accelerated_llama():
    torch.manual_seed(0)
    model, x = _llama()
    sk.prune_(model.eval(), pattern="2:4", criterion="magnitude")
    fast = sk.accelerate(model, x, precision="int8", device="cpu", compile=False)
    eager = fast(**x).logits
    # fullgraph through AOT autograd (fake kernels, decompositions); inductor's CPU codegen
    # would add half a minute on CI and checks nothing more about the ops
    compiled = torch.compile(fast.model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        out = compiled(**x)
    assert type(out).__name__ == "CausalLMOutputWithPast"
    torch.testing.assert_close(out.logits.float(), eager.float(), rtol=0.05, atol=0.05)


@dataclasses.dataclass
class _Out:
    y: torch.Tensor
    aux: tuple


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        h = self.b(torch.relu(self.a(x)))
        return _Out(h, (h.sum(-1), [h[:, :1]]))


def test_output_types_preserved_and_recompiles_bounded():
    torch.manual_seed(0)
    net = _Net().eval()
    sk.prune_(net, pattern="2:4", criterion="magnitude")
    ref = net(torch.randn(3, 64))
    fast = sk.accelerate(net, torch.randn(3, 64), precision="fp8", device="cpu",
                         compile=sk.CompileOptions(backend="eager"))
    out = fast(torch.randn(3, 64))
    assert isinstance(out, _Out) and output_types_equal(out, ref)
    assert isinstance(out.aux, tuple) and isinstance(out.aux[1], list)
    assert fast.report.compiles == 1 and fast.report.seconds["compile"] > 0
    for n in (5, 9, 17, 33, 2):  # varying token counts: one dynamic recompile, not five
        assert fast(torch.randn(n, 64)).y.shape == (n, 64)
    assert fast.report.compiles == 2


@pytest.mark.parametrize("scheme", ["fp8", "fp8_static"])
def test_static_scales_leave_no_row_reduction_in_the_graph(scheme):
    """A model quantized with a static scheme accelerates with zero graph breaks and quantizes
    every layer input elementwise: the traced graph has no absmax reduction, where the dynamic
    scheme has one per quantized input. Output: the quantized model's own."""
    torch.manual_seed(0)
    model, x = _llama()
    model.eval()
    sk.prune_(model, pattern="2:4", criterion="magnitude", exclude=["lm_head"])
    sk.quantize_(model, scheme, exclude=["lm_head"], calibration=[x])
    model.to(torch.bfloat16)
    with torch.no_grad():
        ref = model(**x).logits
    fast = sk.accelerate(model, x, precision="fp8", device="cpu",
                         compile=sk.CompileOptions(backend="eager"))
    assert {d.variant for d in fast.report.layers} == {"fp8_2:4", "bf16_dense"}  # lm_head
    exp = torch._dynamo.explain(fast.model)(**x)
    assert exp.graph_break_count == 0, exp.break_reasons
    amax = [n for g in exp.graphs for n in g.graph.nodes
            if n.op in ("call_function", "call_method") and "amax" in str(n.target)]
    assert (len(amax) == 0) == (scheme == "fp8_static"), [str(n.target) for n in amax]
    with torch.no_grad():
        out = fast(**x).logits
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.05, atol=0.05)


def _gemm_calls(fast, x) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fast(**x)
    return sum(e.name == "sparsekit::sparse24_mm" for e in prof.events()), out


@pytest.mark.parametrize("build,scheme,groups", [
    (_llama, None, [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]]),
    (_bert, "fp8_static", [["query", "key", "value"]])], ids=["llama-bf16", "bert-fp8_static"])
def test_siblings_run_as_one_gemm(build, scheme, groups):
    """siblings=True: the layers fed one tensor run as one GEMM under compile (inductor, its
    MergeSameCalls pass merging the members' identical calls, no freezing): fewer sparse GEMM
    calls per forward, the same output as the unfused accelerated model (run eagerly: one
    inductor compile per case is what this costs); without compile nothing is fused."""
    torch.manual_seed(0)
    model, x = build()
    model.eval()
    head = ["lm_head"] if scheme is None else ["pooler.dense"]
    sk.prune_(model, pattern="2:4", criterion="magnitude", exclude=head)
    precision = "bf16"
    if scheme:  # QuantLinear members (biases, a static input scale) concatenate too
        sk.quantize_(model, scheme, exclude=head, calibration=[x])
        precision = "fp8"
    plain = sk.accelerate(copy.deepcopy(model), x, precision=precision, device="cpu",
                          compile=False)
    fused = sk.accelerate(copy.deepcopy(model), x, precision=precision, device="cpu",
                          plan=sk.PlanOptions(siblings=True))
    notes = [n for n in fused.report.notes if n.startswith("siblings fused")]
    assert len(notes) == len(groups)
    # the merge pass goes into the compiled model's inductor options
    assert type(fused.options.inductor["post_grad_custom_pre_pass"]).__name__ == "MergeSameCalls"
    for group, note in zip(groups, notes):
        assert all(f".{m}" in note for m in group), note
        slices = [m for n, m in fused.model.named_modules() if n.endswith(f".{group[0]}")]
        assert type(slices[0]).__name__ == "SiblingSlice"
    n_plain, a = _gemm_calls(plain, x)
    n_fused, b = _gemm_calls(fused, x)
    assert n_fused == n_plain - sum(len(g) - 1 for g in groups)
    ya, yb = (a.logits, b.logits) if hasattr(a, "logits") else (a[0], b[0])
    torch.testing.assert_close(yb.float(), ya.float(), rtol=0.02, atol=0.02)
    eager = sk.accelerate(copy.deepcopy(model), x, precision=precision, device="cpu", compile=False,
                          plan=sk.PlanOptions(siblings=True))
    assert any("not fused without compile by inductor" in n for n in eager.report.notes)
    assert not any(type(m).__name__ == "SiblingSlice" for m in eager.model.modules())


def test_siblings_keep_per_tensor_fp8_layers_on_the_epilogue_path():
    """fp8_static_tensor q/k/v each have their own weight scale: one concatenated GEMM would
    need per-channel scales and lose the in-GEMM epilogue, so they stay three GEMMs."""
    torch.manual_seed(0)
    model, x = _bert()
    model.eval()
    sk.prune_(model, pattern="2:4", criterion="magnitude", exclude=["pooler.dense"])
    sk.quantize_(model, "fp8_static_tensor", exclude=["pooler.dense"], calibration=[x])
    fast = sk.accelerate(model, x, precision="fp8", device="cpu",
                         plan=sk.PlanOptions(siblings=True))
    assert any("per-tensor weight scales differ" in n for n in fast.report.notes)
    assert not any(type(m).__name__ == "SiblingSlice" for m in fast.model.modules())
    assert all(m.path == "cslt_alpha" for m in fast.model.modules()
               if isinstance(m, layers.FP8Sparse24))


def test_merge_same_calls_merges_pure_calls_only():
    """The siblings' inductor pass: two calls of a pure op on the same nodes become one (its
    users moved); random and in-place ops, and calls on other arguments, are kept."""
    from sparsekit.accel.siblings import MergeSameCalls

    def f(x, w, y):
        a = torch.ops.aten.mm.default(x, w)
        b = torch.ops.aten.mm.default(x, w)
        c = torch.ops.aten.mm.default(y, w)
        r = torch.ops.aten.rand_like.default(x) + torch.ops.aten.rand_like.default(x)
        torch.ops.aten.add_.Tensor(y, 1.0)
        torch.ops.aten.add_.Tensor(y, 1.0)
        return a * b + c, r

    gm = torch.fx.symbolic_trace(f)
    MergeSameCalls()(gm.graph)
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.mm.default) == 2
    assert targets.count(torch.ops.aten.rand_like.default) == 2
    assert targets.count(torch.ops.aten.add_.Tensor) == 2
    x, w, y = torch.randn(4, 8), torch.randn(8, 3), torch.randn(4, 8)
    out, _ = gm(x, w, y.clone())
    torch.testing.assert_close(out, (x @ w) * (x @ w) + y @ w)
    assert MergeSameCalls().uuid() == MergeSameCalls().uuid()  # inductor's cache key


def test_cpu_accelerate_builds_from_quantized_model():
    """A model quantized with sk.quantize_ runs its QuantLinear weights and activation
    numerics unchanged: int8 accel output equals quant/'s own forward exactly."""
    torch.manual_seed(0)
    net = _Net().eval()
    sk.prune_(net, pattern="2:4", criterion="magnitude")
    sk.quantize_(net, "int8")
    net.to(torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = net(x).y
    wq = net.a.weight.clone()
    fast = sk.accelerate(net, x, precision="int8", device="cpu",
                         compile=sk.CompileOptions(backend="eager"))
    assert isinstance(fast.model.a, layers.VARIANTS["int8_2:4"])
    assert torch.equal(fast.model.a.weights("cusparselt").packed, wq)
    assert torch.equal(fast(x).y, ref)
    with pytest.raises(ValueError, match="precision='int8'"):
        other = _Net().eval()
        sk.quantize_(other, "int8")
        sk.accelerate(other, x, precision="fp8", device="cpu")
    assert QuantLinear  # the layer type accel builds from


def test_dense_precision_fp8_for_unpruned_layers():
    net = _Net().eval()
    sk.prune_(net, pattern="2:4", criterion="magnitude", exclude=["b"])
    fast = sk.accelerate(net, torch.randn(2, 64), precision="bf16", device="cpu", compile=False,
                         plan=sk.PlanOptions(dense_precision="fp8"))
    by_name = {d.name: d.variant for d in fast.report.layers}
    assert by_name == {"a": "bf16_2:4", "b": "fp8_dense"}


# timings recorded on the H200 (us), compiled and under graph replay, per GEMM shape
H200_PREFILL = {"bf16_dense": 465.4, "fp8_dense": 292.7, "bf16_2:4": 326.0, "fp8_2:4": 249.2}
H200_DECODE = {"bf16_dense": 9.1, "fp8_dense": 7.9, "bf16_2:4": 13.4, "fp8_2:4": 7.6}


def test_planner_choices_on_recorded_timings():
    assert planner.choose(H200_PREFILL, 4096)[0] == "fp8_2:4"
    # decode-sized: fp8 2:4 is fastest, but not 5% faster than fp8 dense: fp8 dense is kept
    v, why = planner.choose(H200_DECODE, 16)
    assert v == "fp8_dense" and "decode-sized" in why
    # the same timings at prefill size: the fastest wins
    assert planner.choose(H200_DECODE, 4096)[0] == "fp8_2:4"
    # decode-sized and clearly faster: 2:4 stays
    assert planner.choose({**H200_DECODE, "fp8_2:4": 7.0}, 64)[0] == "fp8_2:4"
    # bf16 2:4 slower than dense at decode (0.57-0.84x measured on the H200): dense stays
    assert planner.choose({"bf16_dense": 8.7, "bf16_2:4": 11.7}, 64)[0] == "bf16_dense"
    assert planner.choose({"bf16_dense": 8.7, "bf16_2:4": 8.5}, 16)[0] == "bf16_dense"
    # nothing beats dense by min_speedup: dense stays
    assert planner.choose({"bf16_dense": 10.0, "bf16_2:4": 9.8}, 4096, 1.05)[0] == "bf16_dense"
    # never slower than bf16 dense, on random timings at any size
    g = torch.Generator().manual_seed(0)
    for i in range(300):
        t = dict(zip(H200_PREFILL, (torch.rand(4, generator=g) * 100 + 1).tolist()))
        v, _ = planner.choose(t, (16, 64, 1024)[i % 3])
        assert t[v] <= t["bf16_dense"]


def test_planner_cache_is_used(tmp_path, monkeypatch):
    """auto reads its timings from the disk cache: recorded timings decide, nothing re-timed."""
    monkeypatch.setenv("SPARSEKIT_CACHE", str(tmp_path))
    net = _Net().eval()
    sk.prune_(net, pattern="2:4", criterion="magnitude")
    entries = {}
    for (n, k), best in (((128, 64), "int8_2:4"), ((64, 128), "int8_dense")):
        for v in ("bf16_dense", "int8_dense", "bf16_2:4", "int8_2:4"):
            key = planner.plan_key("cpu", torch.__version__, v, n, k, 6)
            entries[key] = {"us": 1.0 if v == best else 10.0}
    planner.store(entries)
    assert planner.load() == entries

    def no_timing(*a, **k):
        raise AssertionError("timed despite the cache")

    monkeypatch.setattr(planner, "time_module", no_timing)
    fast = sk.accelerate(net, torch.randn(6, 64), precision="int8", sparsity="auto",
                         device="cpu", compile=False)
    assert {d.name: d.variant for d in fast.report.layers} == {"a": "int8_2:4",
                                                               "b": "int8_dense"}
    assert fast.report.layers[0].timings_us["int8_2:4"] == 1.0


def test_quantized_model_keeps_its_numerics_under_auto(tmp_path, monkeypatch):
    """auto on a quantized model chooses only between its scheme's dense and 2:4 kernels
    (never a bf16 variant, which would drop its activation quantization)."""
    monkeypatch.setenv("SPARSEKIT_CACHE", str(tmp_path))
    net = _Net().eval()
    sk.prune_(net, pattern="2:4", criterion="magnitude", exclude=["b"])
    sk.quantize_(net, "fp8")
    fast = sk.accelerate(net, torch.randn(6, 64), precision="fp8", sparsity="auto",
                         device="cpu", compile=False)
    by_name = {d.name: d for d in fast.report.layers}
    assert set(by_name["a"].timings_us) == {"fp8_dense", "fp8_2:4"}
    assert by_name["a"].variant in ("fp8_dense", "fp8_2:4")
    assert by_name["b"].variant == "fp8_dense" and not by_name["b"].timings_us  # no 2:4


# whole-model times of the 8B-shaped Llama (8 layers) on the H200, 2026-12-03 run 2 (ms): the
# per-layer choice (bf16 2:4 on 40 of 56 layers) lost to fp8 2:4 everywhere
H200_LLAMA_MS = {"dense": 32.03, "per_layer": 27.14, "fp8_2:4": 22.18, "bf16_2:4": 27.98}


def test_whole_model_plans_and_choice():
    layers = {"q": (["bf16_dense", "fp8_dense", "bf16_2:4", "fp8_2:4"], "bf16_2:4"),
              "up": (["bf16_dense", "fp8_dense", "bf16_2:4", "fp8_2:4"], "fp8_2:4"),
              "head": (["bf16_dense"], "bf16_dense")}
    plans = planner.whole_model_plans(layers, "fp8")
    assert list(plans) == ["dense", "per_layer", "fp8_2:4", "bf16_2:4", "fp8_dense"]
    assert plans["dense"] == {"q": "bf16_dense", "up": "bf16_dense", "head": "bf16_dense"}
    assert plans["fp8_2:4"] == {"q": "fp8_2:4", "up": "fp8_2:4", "head": "bf16_dense"}
    assert plans["per_layer"] == {"q": "bf16_2:4", "up": "fp8_2:4", "head": "bf16_dense"}
    # fewer compiles: no all-fp8-dense plan at prefill; at decode neither all-bf16-2:4 nor
    # all-fp8-dense (a decode step is timed whole: each plan a whole-model compile)
    assert list(planner.whole_model_plans(layers, "fp8", decode=False)) == [
        "dense", "per_layer", "fp8_2:4", "bf16_2:4"]
    assert list(planner.whole_model_plans(layers, "fp8", decode=True)) == [
        "dense", "per_layer", "fp8_2:4"]
    # bf16: at decode the per-layer choice is the only plan besides dense (at prefill the
    # all-bf16-2:4 plan equals the per-layer choice here, so it is timed once too)
    bf16 = {n: ([c for c in cands if c.startswith("bf16")], "bf16_2:4")
            for n, (cands, _) in layers.items() if n != "head"}
    assert list(planner.whole_model_plans(bf16, "bf16", decode=True)) == ["dense", "per_layer"]
    assert list(planner.whole_model_plans(bf16, "bf16", decode=False)) == ["dense", "per_layer"]
    # a plan equal to an earlier one is timed once
    same = planner.whole_model_plans({"q": (["bf16_dense", "bf16_2:4"], "bf16_2:4")}, "bf16")
    assert list(same) == ["dense", "per_layer"]
    # a quantized layer's "dense" is its own scheme's dense kernel
    q = planner.whole_model_plans({"a": (["fp8_dense", "fp8_2:4"], "fp8_2:4")}, "fp8")
    assert q["dense"] == {"a": "fp8_dense"}
    assert planner.choose_plan(H200_LLAMA_MS)[0] == "fp8_2:4"
    # decode: every plan slower than dense: dense stays; and min_speedup is honoured
    assert planner.choose_plan({"dense": 1.83, "fp8_2:4": 1.9, "per_layer": 2.1})[0] == "dense"
    assert planner.choose_plan({"dense": 10.0, "fp8_2:4": 9.8}, 1.05)[0] == "dense"
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        ms = dict(zip(H200_LLAMA_MS, (torch.rand(4, generator=g) * 10 + 1).tolist()))
        assert ms[planner.choose_plan(ms)[0]] <= ms["dense"]
    with pytest.raises(ValueError, match="dense"):
        planner.choose_plan({"fp8_2:4": 1.0})


def test_whole_model_plan_overrides_per_layer_choice_and_is_cached(tmp_path, monkeypatch):
    """auto with whole_model: per-layer timings prefer bf16 2:4 on one layer, the whole model
    runs fastest with fp8 2:4 everywhere: that plan is installed; the decision is cached, and a
    second accelerate times nothing. When every plan is slower than dense, dense stays."""
    monkeypatch.setenv("SPARSEKIT_CACHE", str(tmp_path))
    torch.manual_seed(0)
    master = _Net().eval()
    sk.prune_(master, pattern="2:4", criterion="magnitude")
    entries = {}
    for (n, k), best in (((128, 64), "bf16_2:4"), ((64, 128), "fp8_2:4")):
        for v in ("bf16_dense", "fp8_dense", "bf16_2:4", "fp8_2:4"):
            entries[planner.plan_key("cpu", torch.__version__, v, n, k, 6)] = {
                "us": 1.0 if v == best else 10.0}
    planner.store(entries)
    x = torch.randn(6, 64)

    def fake_times(table):
        def time_model_ms(fn, device, **kw):
            fn()  # the plan really runs
            return table[(getattr(cur[0].a, "variant", "bf16_dense"),
                          getattr(cur[0].b, "variant", "bf16_dense"))]
        return time_model_ms

    cur = [None]
    table = {("bf16_dense", "bf16_dense"): 10.0, ("bf16_2:4", "fp8_2:4"): 8.0,
             ("fp8_2:4", "fp8_2:4"): 5.0, ("bf16_2:4", "bf16_2:4"): 9.0,
             ("fp8_dense", "fp8_dense"): 7.0}
    monkeypatch.setattr(planner.model, "time_model_ms", fake_times(table))
    net = cur[0] = copy.deepcopy(master)
    fast = sk.accelerate(net, x, precision="fp8", sparsity="auto", device="cpu", compile=False,
                         plan=sk.PlanOptions(whole_model=True))
    r = fast.report
    # M=6 is decode-sized: no all-bf16-2:4 plan and no all-fp8-dense one
    assert r.plan == "fp8_2:4" and r.plans_ms == {"dense": 10.0, "per_layer": 8.0,
                                                   "fp8_2:4": 5.0}
    assert {d.name: d.variant for d in r.layers} == {"a": "fp8_2:4", "b": "fp8_2:4"}
    assert "overridden" in r.layers[0].reason and r.model_speedup == 2.0
    assert type(net.a).__name__ == "FP8Sparse24" and type(net.b).__name__ == "FP8Sparse24"
    torch.testing.assert_close(fast(x).y.float(), master(x).y, atol=0.3, rtol=0.1)

    def no_timing(*a, **k):
        raise AssertionError("timed despite the cache")

    monkeypatch.setattr(planner.model, "time_model_ms", no_timing)
    net = cur[0] = copy.deepcopy(master)
    fast = sk.accelerate(net, x, precision="fp8", sparsity="auto", device="cpu", compile=False,
                         plan=sk.PlanOptions(whole_model=True))
    assert fast.report.plan == "fp8_2:4" and type(net.a).__name__ == "FP8Sparse24"
    # every plan slower than dense (a decode-like case): the float Linears stay. The per-layer
    # timings are measured for real here (plan_cache=False), so the per-layer plan may mix any
    # two variants: every combination but all-dense is slower
    class Slow(dict):
        def __missing__(self, key):
            return 10.0 if key == ("bf16_dense", "bf16_dense") else 11.0

    monkeypatch.setattr(planner.model, "time_model_ms", fake_times(Slow()))
    net = cur[0] = copy.deepcopy(master)
    fast = sk.accelerate(net, x, precision="fp8", sparsity="auto", device="cpu", compile=False,
                         plan=sk.PlanOptions(whole_model=True, cache=False))
    assert fast.report.plan == "dense" and isinstance(net.a, nn.Linear)
    assert {d.variant for d in fast.report.layers} == {"bf16_dense"}


def _close_call_plans(monkeypatch, tmp_path, alternating: tuple[float, float]):
    """accelerate(fp8, auto) of _Net where, timed one after the other, the fp8 2:4 plan looks
    5% faster than dense (a close call) and, timed alternating, runs ``alternating`` (dense ms,
    fp8 2:4 ms). Returns (master, net, fast, the models handed to the alternating timer)."""
    monkeypatch.setenv("SPARSEKIT_CACHE", str(tmp_path))
    torch.manual_seed(0)
    master = _Net().eval()
    sk.prune_(master, pattern="2:4", criterion="magnitude")
    net = copy.deepcopy(master)
    # per layer fp8 2:4 is fastest everywhere: the per-layer plan is all fp8 2:4 (the plan
    # "fp8_2:4" is the same one, timed once as "per_layer")
    monkeypatch.setattr(planner, "time_module",
                        lambda mod, *a: 1.0 if mod.variant == "fp8_2:4" else 2.0)
    monkeypatch.setattr(planner.model, "time_model_ms", lambda fn, device, **kw: fn() and (
        10.0 if isinstance(net.a, nn.Linear) else 9.5))
    seen = []

    def paired(ref_fn, fn, device, **kw):
        ref_fn(), fn()  # both models really run
        seen.extend([ref_fn.args[0].model, fn.args[0].model])
        return alternating

    monkeypatch.setattr(planner.model, "time_paired", paired)
    fast = sk.accelerate(net, torch.randn(96, 64), precision="fp8", sparsity="auto", device="cpu",
                         compile=False, plan=sk.PlanOptions(whole_model=True))
    return master, net, fast, seen


def test_a_close_plan_is_timed_alternating_with_dense_and_dropped_when_not_faster(
        monkeypatch, tmp_path):
    """fp8 2:4 timed 1.05x dense one after the other (within planner.CONFIRM_BELOW), 0.99x of
    it alternating (the BERT case of the H200's run 30): dense is kept. The alternating models
    are copies holding the two plans, sharing the model's weights; the model is untouched by
    them and the decision is cached with both timings."""
    master, net, fast, seen = _close_call_plans(monkeypatch, tmp_path, (10.0, 10.1))
    r = fast.report
    assert 1.0 < 10.0 / 9.5 < planner.CONFIRM_BELOW
    dense_copy, fp8_copy = seen
    assert dense_copy is not net and fp8_copy is not net
    assert isinstance(dense_copy.a, nn.Linear) and type(fp8_copy.a).__name__ == "FP8Sparse24"
    assert dense_copy.a is net.a  # the original layer object: weights shared, not copied
    assert r.plan == "dense" and isinstance(net.a, nn.Linear) and isinstance(net.b, nn.Linear)
    assert {d.variant for d in r.layers} == {"bf16_dense"}
    assert any("timed alternating" in n and "per_layer 10.100" in n for n in r.notes)
    assert r.model_us == {"dense": 10000.0, "accelerated": 10000.0}
    cached = [v for k, v in planner.load(tmp_path / "plans.json").items()
              if k.startswith("model|")]
    assert len(cached) == 1 and cached[0]["plan"] == "dense"
    assert cached[0]["confirm_ms"] == {"dense": 10.0, "per_layer": 10.1}
    with torch.no_grad():
        torch.testing.assert_close(fast(torch.ones(4, 64)).y.float(),
                                   master(torch.ones(4, 64)).y, atol=0.05, rtol=0.02)


def test_a_close_plan_faster_alternating_is_kept(monkeypatch, tmp_path):
    """The same close call, fp8 2:4 1.11x dense alternating (above planner.PLAN_MARGIN): it
    is installed, and the report's model speedup is the alternating one."""
    _, net, fast, seen = _close_call_plans(monkeypatch, tmp_path, (10.0, 9.0))
    r = fast.report
    assert len(seen) == 2 and r.plan in ("fp8_2:4", "per_layer")
    assert type(net.a).__name__ == "FP8Sparse24" and type(net.b).__name__ == "FP8Sparse24"
    assert r.model_us == {"dense": 10000.0, "accelerated": 9000.0}
    assert any("1.11x dense, timed alternating" in n for n in r.notes)
    # just above 1.0 but under the margin: dense
    _, net, fast, _ = _close_call_plans(monkeypatch, tmp_path / "b", (10.0, 9.9))
    assert fast.report.plan == "dense" and 10.0 / 9.9 < planner.PLAN_MARGIN


def test_time_paired_alternates_abba():
    calls = []
    ref_ms, var_ms = planner.time_paired(lambda: calls.append("A"), lambda: calls.append("B"),
                                         torch.device("cpu"), rounds=4, calls=2,
                                         blocks=(blocks := []))
    assert [b[0] for b in blocks] == ["ref", "var", "var", "ref"] * 2
    # each block: one warm-up call and two timed ones, of one side
    assert "".join(calls) == ("AAA" + "BBB" + "BBB" + "AAA") * 2
    assert ref_ms >= 0 and var_ms >= 0


def test_repeated_blocks_found_only_when_every_plan_is_periodic():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=8, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    layers = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    same = {n: ("fp8_2:4" if n != "lm_head" else "bf16_dense") for n in layers}
    found = planner.repeated_blocks(model, {"dense": {n: "bf16_dense" for n in layers},
                                            "fp8_2:4": same})
    assert found is not None and found[0] == "model.layers" and len(found[1]) == 8
    odd = dict(same, **{"model.layers.3.mlp.up_proj": "bf16_2:4"})  # block 3 differs
    assert planner.repeated_blocks(model, {"fp8_2:4": same, "odd": odd}) is None
    assert planner.repeated_blocks(model, {"fp8_2:4": same}, min_blocks=9) is None
    # torchvision's ViT keeps its blocks in an nn.Sequential with names
    vit = torchvision.models.VisionTransformer(image_size=32, patch_size=16, num_layers=8,
                                               num_heads=2, hidden_dim=32, mlp_dim=64)
    vl = {n: "bf16_2:4" for n, m in vit.named_modules() if isinstance(m, nn.Linear)}
    name, blocks = planner.repeated_blocks(vit, {"p": vl})
    assert name == "encoder.layers" and isinstance(blocks, nn.Sequential)
    with planner.truncated(vit, name, 1):
        assert list(vit.encoder.layers._modules) == ["encoder_layer_0"]
    assert vit.encoder.layers is blocks


def test_extrapolate_ms_is_linear_in_blocks():
    # rest 3 ms, 2 ms per block: 1 block 5 ms, 5 blocks 13 ms -> 32 blocks 67 ms
    assert planner.extrapolate_ms({1: 5.0, 5: 13.0}, 32) == pytest.approx(67.0)
    assert planner.extrapolate_ms({5: 13.0, 1: 5.0}, 5) == pytest.approx(13.0)
    # timing noise: 5 blocks measured faster than 1 -> no negative block cost
    assert planner.extrapolate_ms({1: 5.0, 5: 4.9}, 32) == pytest.approx(5.0)


def _deep_llama_24() -> nn.Module:
    """An 8-layer tiny Llama, 2:4 by magnitude but its LM head (seed 0)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=8, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).eval()
    sk.prune_(model, pattern="2:4", criterion="magnitude", exclude=["lm_head"])
    return model


def test_whole_model_plans_of_a_deep_model_are_timed_on_a_few_blocks(monkeypatch):
    """An 8-layer Llama: each plan runs with 1 and 5 decoder layers (fake timer: 1 ms plus
    per-layer cost by variant) and is extrapolated to 8 exactly; the model has its 8 layers
    back afterwards and gives the masked model's output."""
    master = _deep_llama_24()
    x = {"input_ids": torch.randint(0, 128, (2, 48))}
    net = copy.deepcopy(master)
    cost = {"bf16_dense": 1.0, "bf16_2:4": 0.8, "fp8_dense": 0.7, "fp8_2:4": 0.5}
    seen = []

    def fake_time(fn, device, **kw):
        fn()
        n = len(net.model.layers)
        seen.append(n)
        assert kw["cold_l2"] is True  # shortened: each call starts with an evicted L2
        variant = getattr(net.model.layers[0].mlp.up_proj, "variant", "bf16_dense")
        return 1.0 + n * cost[variant]

    monkeypatch.setattr(planner.model, "time_model_ms", fake_time)
    monkeypatch.setattr(planner.model, "SHORTEN_MIN_BYTES", 0)  # as if it had the weights of an 8B
    # per layer, bf16 2:4 looks fastest (not wall clock: the per_layer plan must not be fp8 2:4)
    monkeypatch.setattr(planner, "time_module", lambda mod, *a: 1.0 if mod.variant == "bf16_2:4"
                        else 2.0)
    fast = sk.accelerate(net, x, precision="fp8", sparsity="auto", device="cpu", compile=False,
                         plan=sk.PlanOptions(whole_model=True, cache=False))
    r = fast.report
    assert set(seen) == {1, 5} and len(net.model.layers) == 8
    assert r.plans_ms["dense"] == pytest.approx(1.0 + 8 * 1.0)
    assert r.plans_ms["fp8_2:4"] == pytest.approx(1.0 + 8 * 0.5)
    assert r.plans_ms["per_layer"] == pytest.approx(1.0 + 8 * 0.8)
    assert r.plan == "fp8_2:4" and any("1 and 5 of the 8 blocks" in n for n in r.notes)
    assert all(type(net.model.layers[i].mlp.up_proj).__name__ == "FP8Sparse24"
               for i in range(8))
    with torch.no_grad():
        ref = master(**x).logits
    torch.testing.assert_close(fast(**x).logits.float(), ref, atol=0.3, rtol=0.1)


def test_decode_sized_plans_of_a_deep_model_are_timed_whole(monkeypatch):
    """A decode-sized input (<= DECODE_TOKENS tokens) on a model big enough to be shortened:
    every plan is timed on all 8 layers with the model's own cache behaviour (a few blocks
    mis-predicted a 32-layer decode step on the H200) and the report says so."""
    net = _deep_llama_24()
    x = {"input_ids": torch.randint(0, 128, (planner.DECODE_TOKENS, 1))}
    seen = []

    def fake_time(fn, device, **kw):
        fn()
        seen.append((len(net.model.layers), kw["cold_l2"]))
        variant = getattr(net.model.layers[0].mlp.up_proj, "variant", "bf16_dense")
        return 10.0 if variant == "bf16_2:4" else 9.0

    monkeypatch.setattr(planner.model, "time_model_ms", fake_time)
    monkeypatch.setattr(planner.model, "SHORTEN_MIN_BYTES", 0)
    monkeypatch.setattr(planner, "time_module", lambda mod, *a: 1.0 if mod.variant == "bf16_2:4"
                        else 2.0)
    r = sk.accelerate(net, x, precision="bf16", sparsity="auto", device="cpu", compile=False,
                      plan=sk.PlanOptions(whole_model=True, cache=False)).report
    assert seen and set(seen) == {(8, False)}
    assert any("decode-sized input" in n for n in r.notes)
    assert not any("blocks of" in n for n in r.notes)
    assert r.plan == "dense"  # the slower 2:4 plan is not kept


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return x + self.fc(x)


class _NeedsAllBlocks(nn.Module):
    """A model whose forward checks its block count (as some model code does)."""

    def __init__(self, n: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(n))
        self.n = n

    def forward(self, x):
        if len(self.blocks) != self.n:
            raise ValueError(f"expected {self.n} blocks, got {len(self.blocks)}")
        for b in self.blocks:
            x = b(x)
        return x


def test_a_small_deep_model_is_planned_whole(monkeypatch):
    """Under SHORTEN_MIN_BYTES of weights, 8 identical blocks are timed as they are: every plan
    on all 8 (warm L2: the model's own cache behaviour), no extrapolation note; with a
    threshold below its size the same model is shortened."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(*(_Block() for _ in range(8)))).eval()
    sk.prune_(net, pattern="2:4", criterion="magnitude")
    size = planner.weight_bytes(net)
    assert size == 8 * (64 * 64 + 64) * 4
    x = torch.randn(96, 64)  # above DECODE_TOKENS: a decode-sized input is never shortened
    for threshold, counts in ((10 * size, {8}), (1, {1, 5})):
        seen = []
        m = copy.deepcopy(net)

        def fake_time(fn, device, seen=seen, m=m, **kw):
            fn()
            seen.append((len(m[0]), kw["cold_l2"]))
            return 10.0 if isinstance(m[0][0].fc, nn.Linear) else 5.0

        monkeypatch.setattr(planner.model, "time_model_ms", fake_time)
        monkeypatch.setattr(planner.model, "SHORTEN_MIN_BYTES", threshold)
        r = sk.accelerate(m, x, precision="fp8", sparsity="auto", device="cpu", compile=False,
                          plan=sk.PlanOptions(whole_model=True, cache=False)).report
        assert {n for n, _ in seen} == counts and len(m[0]) == 8
        assert {cold for _, cold in seen} == {counts != {8}}
        assert any("blocks of" in n for n in r.notes) == (counts != {8})
        assert r.plan != "dense"


def test_a_model_that_cannot_be_shortened_is_planned_whole(monkeypatch):
    torch.manual_seed(0)
    net = _NeedsAllBlocks().eval()
    sk.prune_(net, pattern="2:4", criterion="magnitude")
    master = copy.deepcopy(net)
    seen = []

    def fake_time(fn, device, **kw):
        fn()
        seen.append(len(net.blocks))
        assert kw["cold_l2"] is False  # the whole model: its own cache behaviour
        return 10.0 if isinstance(net.blocks[0].fc, nn.Linear) else 5.0

    monkeypatch.setattr(planner.model, "time_model_ms", fake_time)
    monkeypatch.setattr(planner.model, "SHORTEN_MIN_BYTES", 0)
    x = torch.randn(96, 64)  # above DECODE_TOKENS (a decode-sized input is timed whole)
    fast = sk.accelerate(net, x, precision="fp8", sparsity="auto", device="cpu", compile=False,
                         plan=sk.PlanOptions(whole_model=True, cache=False))
    r = fast.report
    assert set(seen) == {8} and len(net.blocks) == 8  # every plan timed whole
    assert any("did not run with blocks shortened (ValueError: expected 8 blocks" in n
               for n in r.notes)
    assert r.plans_ms["dense"] == 10.0 and r.plan != "dense"
    with torch.no_grad():
        ref = master(x)
    assert (fast(x).float() - ref).norm() / ref.norm() < 0.05  # fp8 through 8 blocks


def test_sibling_groups_are_layers_fed_the_very_same_tensor():
    """Groups follow the input tensor object, not its shape, address or id(): a tensor made
    after another is freed (which may reuse both) starts a new group; the caller's input keeps
    no mark."""
    from sparsekit.accel.siblings import first_calls

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.d, self.e = (nn.Linear(8, 8) for _ in range(5))

        def forward(self, x):
            y = self.a(x) + self.b(x)       # a, b share x
            z = torch.relu(self.c(y))       # c alone
            return self.d(z) + self.e(z + 0)  # d, e: same shape, different tensors

    x = torch.randn(3, 8)
    tokens, groups = first_calls(Net(), x, ["a", "b", "c", "d", "e"])
    assert groups == [["a", "b"]] and tokens == dict.fromkeys("abcde", 3)
    assert not [k for k in vars(x) if "sparsekit" in k]


class _Mlp(nn.Module):
    def __init__(self, functional: bool):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 128), nn.Linear(128, 64)
        self.act = nn.GELU(approximate="tanh")  # the form cuSPARSELt's epilogue computes
        self.functional = functional

    def forward(self, x):
        h = self.fc1(x)
        h = torch.nn.functional.gelu(h, approximate="tanh") if self.functional else self.act(h)
        return self.fc2(h) + h.mean()  # fc2's input is also used elsewhere: fc1 still fuses


@pytest.mark.parametrize("functional", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_gelu_moves_into_the_epilogue_of_per_tensor_fp8_layers(functional):
    """fp8_static_tensor layers run sparse24_mm_alpha; the pre-grad pass folds the GELU after fc1
    into its GEMM (one rewrite, no gelu left in the graph) and the compiled model equals the
    same accelerated model run eagerly (unfused)."""
    from sparsekit.accel.epilogue import FuseGelu


    torch.manual_seed(0)
    model = _Mlp(functional)
    sk.prune_(model, pattern="2:4", criterion="magnitude")
    x = torch.randn(3, 8, 64)
    sk.quantize_(model, "fp8_static_tensor", calibration=[x])
    with torch.no_grad():
        quant = model(x).double()  # the quantized model's own float32 forward
    eager = sk.accelerate(copy.deepcopy(model), x, precision="fp8", device="cpu", compile=False)
    # the pass runs when inductor compiles, not on a graph-cache hit: count a real compile
    with torch._inductor.config.patch(force_disable_caches=True):
        fast = sk.accelerate(model, x, precision="fp8", device="cpu")
    assert [m.path for m in (fast.model.fc1, fast.model.fc2)] == ["cslt_alpha"] * 2
    assert isinstance(fast.fuse_gelu, FuseGelu) and fast.fuse_gelu.fused == 1
    assert any("GELU in the GEMM of 1" in n for n in fast.report.notes)
    assert any("2 fp8 2:4 layer(s) on sparsekit's cuSPARSELt binding" in n
               for n in fast.report.notes)
    # a float model accelerated to fp8 2:4 is told where the faster path is
    float_model = _Mlp(functional)
    sk.prune_(float_model, pattern="2:4", criterion="magnitude")
    plain = sk.accelerate(float_model, x, precision="fp8", device="cpu", compile=False)
    assert any("'fp8_static_tensor'" in n for n in plain.report.notes)
    # one bf16 rounding less (GELU on the float32 pre-activation): as close to the quantized
    # model as the unfused layers are, or closer (fp8 steps of fc2's input dominate both)
    err_fused, err_eager = ((m(x).double() - quant).norm() / quant.norm() for m in (fast, eager))
    assert err_fused <= 1.1 * err_eager and err_fused < 0.05


def test_fuse_gelu_leaves_other_uses_and_forms_alone():
    """A GEMM whose output is used twice, or an erf-form GELU (cuSPARSELt's is tanh), stay."""
    from sparsekit.accel.epilogue import FuseGelu

    w = torch.zeros(32, 64, dtype=torch.float8_e4m3fn)
    b = torch.zeros(32, dtype=torch.bfloat16)

    def f(x):
        y = torch.ops.sparsekit.sparse24_mm_alpha(x, w, b, 32, 0, 1.0, False)
        z = torch.ops.sparsekit.sparse24_mm_alpha(x, w, b, 32, 0, 1.0, False)
        u = torch.ops.sparsekit.sparse24_mm_alpha(x, w, b, 32, 0, 1.0, False)
        return (torch.nn.functional.gelu(y, approximate="tanh") + y,
                torch.nn.functional.gelu(z.reshape(2, -1)),
                torch.nn.functional.gelu(u.reshape(2, -1), approximate="tanh"))

    gm = torch.fx.symbolic_trace(f)
    fuse = FuseGelu()
    fuse(gm.graph)
    assert fuse.fused == 1  # u only
    gelus = [n for n in gm.graph.nodes if n.op == "call_function" and "gelu" in str(n.target)]
    assert len(gelus) == 2
    flags = [n.args[6] for n in gm.graph.nodes
             if n.target is torch.ops.sparsekit.sparse24_mm_alpha]
    assert flags == [False, False, True]
