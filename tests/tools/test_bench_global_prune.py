import json


def test_smoke_reaches_exact_count(tmp_path, run_tool):
    out = tmp_path / "r.json"
    run_tool("bench_global_prune.py", "--smoke", "--out", out)
    result = json.loads(out.read_text())
    assert result["exact"] and result["zeros"] == int(0.9 * result["parameters"] + 0.5)
