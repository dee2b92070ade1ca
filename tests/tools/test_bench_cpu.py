import json

import pytest


def test_smoke_reports_dense_vs_pruned_ratios(tmp_path, tool_module):
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    tool_module("bench_cpu").main(["--smoke", "--threads", "1", "--fuse", "--out", str(out),
                                   "--md", str(md)])  # in this process, as its command line
    r = json.loads(out.read_text())
    # the mnist1d CNN has 8010 parameters; half of its 32 conv channels go (round_to=8)
    assert r["fused"] is True
    assert r["params_dense"] == 8010 and r["params_pruned"] < r["params_dense"]
    assert r["params_removed"] == pytest.approx(1 - r["params_pruned"] / r["params_dense"])
    assert 0 < r["macs_pruned"] < r["macs_dense"]
    assert [b["batch"] for b in r["latency"]] == [1, 4]
    for b in r["latency"]:
        assert b["dense_ms"] > 0 and b["pruned_ms"] > 0
        assert b["speedup"] == b["dense_ms"] / b["pruned_ms"]
    table = md.read_text()
    assert "| parameters | 8,010 |" in table and "latency, batch 4" in table
