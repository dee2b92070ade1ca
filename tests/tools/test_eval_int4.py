import json

import pytest


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
