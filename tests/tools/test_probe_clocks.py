"""tools/probe_clocks.py: the clock elasticity fit, the two layers it times, and the CPU smoke
run (the H200 run needs nvidia-smi)."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import probe_clocks  # noqa: E402


def test_elasticity_is_the_slope_of_log_time_on_log_clock():
    mhz = [1980.0, 1800.0, 1650.0, 1500.0, 1470.0]
    bound = [100.0 * 1980.0 / f for f in mhz]  # time scales as 1 / clock
    assert probe_clocks.elasticity(bound, mhz) == pytest.approx(-1.0)
    assert probe_clocks.elasticity([80.0] * 5, mhz) == pytest.approx(0.0)
    half = [50.0 * math.sqrt(1980.0 / f) for f in mhz]
    assert probe_clocks.elasticity(half, mhz) == pytest.approx(-0.5)
    assert probe_clocks.elasticity(bound[:2], mhz[:2]) is None  # too few blocks
    assert probe_clocks.elasticity([1.0, 1.1, 1.2], [1500.0] * 3) is None  # one clock only


def test_the_dense_and_2to4_layers_compute_the_same_product():
    torch.manual_seed(0)
    layers = probe_clocks.build(64, 128, 16, torch.device("cpu"))
    w = layers["dense"].weight.double()
    assert (w.reshape(64, 32, 4) != 0).sum(-1).max() <= 2  # 2:4 along the input dim
    x = torch.randn(16, 128, dtype=torch.bfloat16)
    ref = x.double() @ w.t()
    for name, mod in layers.items():
        y = mod(x).double()
        assert ((y - ref).norm() / ref.norm()).item() < 1e-2, name


def test_smoke_run_writes_alternating_blocks(tmp_path, run_tool):
    out = tmp_path / "probe.json"
    run_tool("probe_clocks.py", "--smoke", "--out", out)
    res = json.loads(out.read_text())
    names = [b[0] for b in res["blocks"]]
    assert set(res["variants"]) == {"dense", "bf16_2:4"} and len(names) >= 4
    assert names[:4] == ["dense", "bf16_2:4", "bf16_2:4", "dense"]  # ABBA
    for b in res["blocks"]:
        assert b[1] <= b[2] and b[3] > 0
    for v in res["variants"].values():
        assert v["ms_min"] <= v["ms_median"] <= v["ms_max"]
        assert v["elasticity"] is None and v["sm_mhz_range"] is None  # no clock log on CPU
