"""tools/bench_sparsegpt_gptq.py in its smoke mode (a tiny Llama on the CPU): the joint sweep
runs through quantize_, every pruned layer comes out 2:4 with int4 values, and the whole-model
figure is the measured one scaled by blocks, labelled so."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_sparsegpt_gptq as bench  # noqa: E402


def test_smoke_prunes_quantizes_and_scales_by_blocks(tmp_path):
    out = tmp_path / "sgpt.json"
    res = bench.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    assert res["check"] == {"layers": 14, "failing": [], "ok": True}  # 7 Linear a block, 2
    assert res["args"]["layers"] == 2 and res["args"]["full_layers"] == 4
    assert res["seconds_full_scaled"] == pytest.approx(res["seconds"] * 4 / 2)
    assert res["target"]["how"] == "scaled from the blocks measured"
    assert res["target"]["full_minutes"] == pytest.approx(res["seconds_full_scaled"] / 60)


def test_check_finds_a_layer_that_is_not_24():
    import torch
    from torch import nn

    lin = nn.Linear(8, 2)
    lin.register_buffer("weight_scale", torch.ones(2, 1))
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 1, 0, 0, 2, 0, 0, 3], [1, 1, 1, 0, 0, 0, 0, 0]]))
    got = bench.check_24_int4(nn.Sequential(lin))
    assert got == {"layers": 1, "failing": ["0"], "ok": False}


def test_layers_beyond_the_whole_model_are_refused():
    with pytest.raises(SystemExit, match="--layers must be 1..--full-layers"):
        bench.main(["--layers", "40"])
