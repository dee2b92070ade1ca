"""GPU tests (run on the H200; skipped without CUDA): every variant against an fp32 reference
with the same 2:4 mask, the Triton kernels against their torch definitions, CUDA graphs across
input-shape buckets, the MultiheadAttention conversion end to end, and load -> accelerate."""

import copy

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.accel import actquant, algsearch, kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
TOL = {"bf16": 1e-2, "fp8": 6e-2, "int8": 6e-2}


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
    monkeypatch.setenv("SPARSEKIT_CACHE_DIR", str(tmp_path))


@pytest.mark.parametrize("variant", list(kernels.VARIANTS))
@pytest.mark.parametrize("shape", [(394, 1024), (2, 197, 1024)])
def test_variant_matches_fp32_reference(variant, shape):
    torch.manual_seed(0)
    lin = make_24_(nn.Linear(1024, 2048)).cuda()
    x = torch.randn(*shape, device="cuda")
    ref = nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double())
    y = kernels.VARIANTS[variant](lin)(x.bfloat16())
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    assert rel_err(y, ref) <= TOL[variant.split("_")[0]]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_triton_quant_matches_reference(dtype):
    x = torch.randn(300, 3000, device="cuda", dtype=torch.bfloat16) * 3
    q, s = actquant.quant_rows(x, dtype)
    q_ref, s_ref = actquant.quant_rows_ref(x, dtype)
    torch.testing.assert_close(s, s_ref)
    assert (q.float() != q_ref.float()).float().mean() < 1e-3  # rounding ties only
    q, s = actquant.quant_tensor(x, dtype)
    q_ref, s_ref = actquant.quant_tensor_ref(x, dtype)
    torch.testing.assert_close(s, s_ref)
    assert (q.float() != q_ref.float()).float().mean() < 1e-3
    acc = torch.randn(300, 384, device="cuda").bfloat16()
    rs, cs = torch.rand(300, device="cuda"), torch.rand(384, device="cuda")
    b = torch.randn(384, device="cuda").bfloat16()
    ref = actquant.scale_epilogue_ref(acc, rs, cs, b)
    torch.testing.assert_close(actquant.scale_epilogue(acc.clone(), rs, cs, b), ref)


def test_alg_search_uses_cache():
    lin = make_24_(nn.Linear(512, 1024)).cuda()
    _, alg, timings = algsearch.search("bf16_2:4", lin, 256)
    assert timings and alg == min(timings, key=timings.get)
    _, alg2, timings2 = algsearch.search("bf16_2:4", lin, 256)
    assert alg2 == alg and timings2 == {}


@pytest.mark.parametrize("precision", ["bf16", "fp8", "int8"])
def test_graphs_across_shape_buckets(precision):
    torch.manual_seed(0)
    model = make_24_(nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)))
    ref_model = model.double()
    xs = {n: torch.randn(n, 64, 256, dtype=torch.float64) for n in (3, 4, 9, 16, 20)}
    refs = {n: ref_model(x) for n, x in xs.items()}
    fast = sk.accelerate(model.float(), xs[4].float(), precision=precision, sparsity="2:4",
                         batch_buckets=[4, 16])
    assert all(d.variant == f"{precision}_2:4" for d in fast.sparsekit_report.layers)
    outs = {n: fast(x.float()) for n, x in xs.items()}
    assert fast.runner.num_graphs == 3  # buckets 4 and 16, and 20 beyond the largest
    for n, out in outs.items():  # earlier outputs were not overwritten by later replays
        assert out.shape == refs[n].shape
        assert rel_err(out, refs[n]) <= TOL[precision]


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
    assert "not 1x1" in report.skipped["conv_proj"]
    assert rel_err(fast(x), ref) <= 1e-2


def test_auto_never_keeps_a_slower_layer():
    torch.manual_seed(0)
    model = make_24_(nn.Sequential(nn.Linear(768, 3072), nn.GELU(), nn.Linear(3072, 768)))
    fast = sk.accelerate(model, torch.randn(64, 768), precision="fp8", sparsity="auto")
    for d in fast.sparsekit_report.layers:
        if d.variant != "bf16_dense":
            assert d.confirmed_speedup >= 1.0
            assert d.timings_us[d.variant] < d.timings_us["bf16_dense"]


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
    """q/k/v read one normed input, gate/up another: two sibling groups to fuse."""

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
def test_siblings_fused_and_accurate(precision):
    torch.manual_seed(0)
    block = make_24_(_LlamaBlock()).eval()
    xs = {n: torch.randn(n, 64, 256) for n in (2, 4)}
    with torch.no_grad():
        refs = {n: block.double()(x.double()) for n, x in xs.items()}
    fast = sk.accelerate(copy.deepcopy(block).float(), xs[4], precision=precision,
                         sparsity="2:4", batch_buckets=[2, 4])
    layers = {d.name: d for d in fast.sparsekit_report.layers}
    assert set(layers) == {"q_proj+k_proj+v_proj", "o_proj", "gate_proj+up_proj", "down_proj"}
    assert layers["q_proj+k_proj+v_proj"].out_features == 768
    assert layers["gate_proj+up_proj"].variant == f"{precision}_2:4"
    notes = " ".join(fast.sparsekit_report.notes)  # each fusion kept or dropped by measurement
    assert "fusion of q_proj+k_proj+v_proj" in notes and "fusion of gate_proj+up_proj" in notes
    for n in (4, 2, 4):  # two graphs; replays after another bucket's stay right
        assert rel_err(fast(xs[n]), refs[n]) <= TOL[precision]
    unfused = sk.accelerate(copy.deepcopy(block).float(), xs[4], precision=precision,
                            sparsity="2:4", fuse=False, graphs=False)
    assert len(unfused.sparsekit_report.layers) == 7
