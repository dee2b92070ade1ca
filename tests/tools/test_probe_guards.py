"""tools/probe_guards.py: the guard check of a dense and an accelerated BERT, timed alone on the
locals of a real call (the check must accept them, or the tool refuses)."""

import json

import pytest

pytest.importorskip("transformers")


def test_guard_check_of_dense_and_accelerated_models(tmp_path, run_tool):
    out = tmp_path / "g.json"
    run_tool("probe_guards.py", "--layers", "2", "--repeats", "5", "--out", out)
    res = json.loads(out.read_text())
    assert res["layers"] == 2
    for key in ("default_us", "recursive_dict_tags_us"):
        if key in res:
            assert set(res[key]) == {"dense", "bf16_2:4", "fp8_2:4"}
            assert all(v > 0 for v in res[key].values())
    assert "default_us" in res
