import json


def test_smoke_reaches_exact_count(tmp_path, tool_module):
    out = tmp_path / "r.json"
    tool_module("bench_global_prune").main(["--smoke", "--out", str(out)])  # in this process
    result = json.loads(out.read_text())
    assert result["exact"] and result["zeros"] == int(0.9 * result["parameters"] + 0.5)
