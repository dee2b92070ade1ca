"""tools/bench_models.py --smoke: tiny Llama, BERT and ViT on CPU (reference ops), all the way
to the JSON and markdown the H200 run writes."""

import json

import pytest


def test_smoke_writes_json_and_markdown(tmp_path, run_tool):
    run_tool("bench_models.py", "--smoke", "--models", "llama,bert,vit", "--out-dir", tmp_path,
             "--cache-dir", tmp_path / "cache")
    res = json.loads((tmp_path / "bench_models.json").read_text())
    assert res["smoke"] is True and set(res["models"]) == {"llama", "bert", "vit"}
    for name, out_type in (("llama", "CausalLMOutputWithPast"),
                           ("bert", "BaseModelOutputWithPoolingAndCrossAttentions"),
                           ("vit", "Tensor")):
        e = res["models"][name]
        v = e["variants"]
        dense = {k: v[k]["ms"] for k in ("dense_eager", "dense_compiled", "dense_recheck")}
        # the fastest dense way is timed again after the other rows; its drift is recorded
        again = v["dense_recheck"]
        assert again["of"] in ("dense_eager", "dense_compiled")
        assert e["dense_drift"] == pytest.approx(again["ms"] / v[again["of"]]["ms"])
        assert list(v)[-1] == "dense_recheck"
        # the ratio's reference is the fastest dense, the recheck included
        assert e["fastest_dense"] == min(dense, key=dense.get)
        assert v[e["fastest_dense"]]["ratio"] == 1.0
        for row in v.values():
            if "ms" in row:
                assert row["ratio"] == pytest.approx(dense[e["fastest_dense"]] / row["ms"])
                assert row["output_type"] == out_type  # types survive accelerate + compile
        # errors against fp32 of the same masked model: bf16 2:4 at the bf16 floor, fp8 larger
        floor = v["dense_eager"]["rel_err"]
        assert 0 < floor < 0.03
        assert v["sk_bf16_2:4"]["rel_err"] < 1.5 * floor + 1e-3
        # fp8 ran on the 2:4 layers; its error is at least about the bf16 floor (on the tiny
        # BERT the bf16 rest of the model dominates: fp8 adds under 3%, so no strict margin)
        assert v["sk_fp8_2:4"]["layer_variants"].get("fp8_2:4", 0) > 0
        assert 0.9 * floor < v["sk_fp8_2:4"]["rel_err"] < 0.15
        # static activation scales (calibrated on the same inputs): every Linear but the LM
        # head quantized (ViT's attention split first), error of the same order as dynamic
        static = v["sk_fp8s_2:4"]
        assert static["layer_variants"].get("fp8_2:4", 0) == \
            v["sk_fp8_2:4"]["layer_variants"]["fp8_2:4"]
        assert 0.9 * floor < static["rel_err"] < 1.5 * v["sk_fp8_2:4"]["rel_err"]
        assert v["sk_bf16_2:4"]["compiles"] == 1
        assert v["sk_bf16_2:4"]["layer_variants"].get("bf16_2:4", 0) > 0
        assert v["sk_int8_auto"]["plan_s"] > 0
        assert "CUDA" in v["torchao_fp8_dense"]["error"] and "CUDA" in v["stock_2:4"]["error"]
    md = (tmp_path / "bench_models.md").read_text()
    assert "## HF LlamaForCausalLM" in md and "| sk_fp8_2:4 |" in md and "fastest dense" in md
