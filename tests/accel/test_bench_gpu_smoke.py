"""tools/bench_gpu.py --smoke: the whole pipeline of the GPU benchmark on CPU, tiny shapes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the GPU benchmark's whole pipeline on CPU; its parts: the tests below
def test_bench_gpu_smoke_writes_json_and_markdown(tmp_path):
    cmd = [sys.executable, str(ROOT / "tools" / "bench_gpu.py"), "--smoke", "--out-dir",
           str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    res = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert [(r["K"], r["N"], r["M"]) for r in res["gemm"]] == [(64, 128, 16)]
    assert res["gemm"][0]["ratio"]["bf16_dense"] == 1.0 and res["gemm"][0]["us"]["bf16_dense"] > 0
    (vit,) = res["vit"]
    assert vit["name"] == "ViT-B/16 batch 2"
    # bf16 model vs the fp32 reference with the same 2:4 masks
    assert 0 < vit["variants"]["bf16_dense"]["rel_err"] < 2e-2
    assert 0 < res["llama"]["variants"]["bf16_dense"]["rel_err"] < 2e-2
    assert "section_errors" not in res
    md = (tmp_path / "bench_gpu.md").read_text()
    assert "## GEMMs" in md and "## ViT-B/16 batch 2" in md and "## Llama-7B layer, 16 tokens" in md


def test_bench_gpu_helpers():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import bench_gpu
    finally:
        sys.path.pop(0)
    import torch
    from torch import nn

    from sparsekit.io.checkpoint import is_2to4

    model = bench_gpu.magnitude_24_(nn.Sequential(nn.Linear(16, 8), nn.MultiheadAttention(8, 2)))
    assert is_2to4(model[0].weight) and is_2to4(model[1].in_proj_weight)
    g = model[0].weight.reshape(8, 4, 4)
    assert (g.ne(0).sum(-1) == 2).all()  # exactly the two largest of every four kept
    assert abs(bench_gpu.geomean([1.0, 4.0]) - 2.0) < 1e-12
    res = {"gemm": [{"model": "Llama-7B", "M": 1024, "ratio": {"bf16_2:4": 1.5, "fp8_2:4": 2.0}},
                    {"model": "Llama-70B", "M": 4096, "ratio": {"bf16_2:4": 1.5 * 4 / 3}},
                    {"model": "ViT-B", "M": 4096, "ratio": {"bf16_2:4": 0.1}},
                    {"model": "Llama-7B", "M": 64, "ratio": {"bf16_2:4": 0.1}}]}
    s = bench_gpu.summarize(res)
    assert abs(s["gemm_llama_bf16_2:4_geomean"] - (1.5 * 1.5 * 4 / 3) ** 0.5) < 1e-12
    assert s["gemm_llama_fp8_2:4_geomean"] == 2.0 and s["gemm_llama_bf16_2:4_min"] == 1.5
    out = bench_gpu.LlamaLayer(64, 4, 128)(torch.randn(2, 5, 64))
    assert out.shape == (2, 5, 64)


def test_bench_gpu_fp8st_column_is_the_alpha_path(tmp_path):
    """The GEMM bench's fp8st_2:4 layer: built from an fp8_static_tensor QuantLinear, it takes
    the scale inside the GEMM (path "cslt_alpha") and computes what the QuantLinear does; its
    geo-mean is summarized against the 2.5x target like fp8s's."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import bench_gpu
    finally:
        sys.path.pop(0)
    import torch
    from torch import nn

    from sparsekit.accel import layers

    torch.manual_seed(0)
    lin = bench_gpu.magnitude_24_(nn.Linear(64, 32))
    x = torch.randn(16, 64).to(torch.bfloat16).float()  # both layers see the same values
    q = bench_gpu.static_fp8(lin, x, "fp8_static_tensor")
    assert q.scheme == "fp8_static_tensor"
    mod = layers.VARIANTS["fp8_2:4"](q)
    assert mod.path == "cslt_alpha" and mod.alpha is not None
    y, ref = mod(x.to(torch.bfloat16)).float(), q(x).float()
    assert ((y - ref).norm() / ref.norm()).item() < 4e-3  # bf16 rounding of the same product
    assert bench_gpu.TARGETS["gemm_llama_fp8st_2:4_geomean"] == 2.5
    s = bench_gpu.summarize({"gemm": [{"model": "Llama-7B", "M": 4096,
                                        "ratio": {"fp8st_2:4": 2.0}},
                                       {"model": "Llama-70B", "M": 1024,
                                        "ratio": {"fp8st_2:4": 8.0}}]})
    assert abs(s["gemm_llama_fp8st_2:4_geomean"] - 4.0) < 1e-12
