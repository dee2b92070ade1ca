"""tools/bench_first_call.py on CPU: every precision builds, accelerates and generates in its own
process, and the result says how long the first generate's graph-building calls took."""

import json

import pytest


@pytest.mark.slow  # a process per precision; the tool's parsing: the test below
def test_smoke_times_each_precision_in_its_own_process(tmp_path, run_tool):
    out = tmp_path / "first_call.json"
    run_tool("bench_first_call.py", "--smoke", "--precisions", "dense,fp8w,int4", "--out", out)
    res = json.loads(out.read_text())
    assert [r["precision"] for r in res["runs"]] == ["dense", "fp8w", "int4"]
    for run in res["runs"]:
        assert "error" not in run, run
        assert run["compiles"] >= 2  # the prefill bucket and the decode step
        assert run["graphs_s"].keys() == {"prefill", "decode"}
        assert 0 < sum(run["graphs_s"].values()) <= run["first_generate_s"]
        assert len(run["tokens"]) == res["args"]["new"]


def test_unknown_precision_is_one_line(tmp_path, tool_module, capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        tool_module("bench_first_call").main(["--precisions", "fp9", "--out",
                                              str(tmp_path / "x.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "fp9" in err and "fp8w" in err
