import json

import pytest
import torch


@pytest.mark.slow  # four pipeline runs and a tiny dense training
def test_smoke_reports_every_variant_and_the_targets(tmp_path, tool_module):
    """The smoke run measures both models through the pipeline: every variant's perplexity (a
    random tiny model's: about its vocabulary size) and targets computed from those figures."""
    out = tmp_path / "int4.json"
    tool_module("eval_int4").main(["--smoke", "--work-dir", str(tmp_path / "w"),
                                   "--out", str(out)])  # in this process, as its command line
    r = json.loads(out.read_text())
    assert r["scheme"] == "int4_weight_channel" and set(r["models"]) == {"small_llama",
                                                                          "stdlib_lm"}
    for m in r["models"].values():
        p, t = m["perplexity"], m["targets"]
        assert set(p) == {"dense", "2:4", "2:4+int4_rtn", "2:4+int4_gptq", "int4_rtn",
                          "int4_gptq"}
        assert all(30 < v < 3000 for v in p.values())
        assert t["joint_over_2_4"] == p["2:4+int4_gptq"] / p["2:4"]
        assert t["gptq_below_rtn_2_4"] == (p["2:4+int4_gptq"] < p["2:4+int4_rtn"])
        assert m["runs"]["2:4"]["sparsity"] >= 0.5 and m["runs"]["dense"]["sparsity"] == 0
        # the joint run's compressed model is the GPTQ variant
        assert m["runs"]["2:4"]["variants"]["dense"] == p["dense"]


@pytest.mark.slow  # six pipeline runs on a tiny Llama
def test_smoke_head_quantizes_the_lm_head_alone(tmp_path, tool_module):
    """``--head``: four more runs, each with the LM head (and nothing else) quantized, int4 or
    fp8, on the dense and on the joint 2:4 + GPTQ model; the saved model's ``lm_head`` holds
    quantized values, and the joint model the head runs start from is the one measured."""
    from safetensors import safe_open

    work, out = tmp_path / "w", tmp_path / "int4.json"
    tool_module("eval_int4").main(["--smoke", "--no-stdlib", "--head", "--work-dir", str(work),
                                   "--out", str(out)])
    m = json.loads(out.read_text())["models"]["small_llama"]
    runs, p = m["head"]["runs"], m["head"]["perplexity"]
    assert set(p) == {"dense+int4_head", "dense+fp8_head", "2:4+int4_gptq+int4_head",
                      "2:4+int4_gptq+fp8_head"}
    for key, r in runs.items():
        assert r["quantized"] == ["lm_head"] and r["perplexity"] == p[key]
        assert r["perplexity"] != r["base"]  # the head's rounding changed the logits
        base = "dense" if key.startswith("dense") else "2:4+int4_gptq"
        assert r["base"] == pytest.approx(m["perplexity"][base], rel=1e-6)
    dtypes = {"int4_head": torch.int8, "fp8_head": torch.float8_e4m3fn}
    for key in runs:
        with safe_open(work / "small_llama" / key.replace(":", "_") / "model.safetensors",
                       "pt") as f:
            assert f.get_tensor("lm_head.weight").dtype == dtypes[key.split("+")[-1]]
            assert "lm_head.weight_scale" in f.keys()
