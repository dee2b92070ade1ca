import json
import math


def test_smoke_writes_the_table(tmp_path, tool_module):
    tool_module("compare_oneshot").main(["--smoke", "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "oneshot.json").read_text())
    assert set(result["runs"]) == {
        f"{c}/{s}" for c in ("magnitude", "wanda", "sparsegpt") for s in ("50% unstructured", "2:4")
    }
    for run in result["runs"].values():
        assert run["sparsity"] == 0.5  # exact: every pruned layer has an even element count
        assert run["layers"] == 4 and not run["skipped"]  # qkv, proj, fc1, fc2; lm_head excluded
        assert math.isfinite(run["perplexity"]) and run["perplexity"] > 1
    table = (tmp_path / "oneshot.md").read_text().splitlines()
    assert table[0] == "| criterion | 50% unstructured | 2:4 |"
    assert [row.split("|")[1].strip() for row in table[2:6]] == [
        "dense",
        "magnitude",
        "wanda",
        "sparsegpt",
    ]
    assert table[7] == "| criterion | 70% uniform | 70% allocated |"
    alloc = result["allocation"]
    params = alloc["scan"]["params"]
    mean = sum(alloc["levels"][n] * params[n] for n in params) / sum(params.values())
    assert abs(mean - 0.7) < 1e-9
    for run in alloc["runs"].values():  # the per-layer levels reach the target in whole weights
        assert abs(run["sparsity"] - 0.7) <= len(params) / sum(params.values())
