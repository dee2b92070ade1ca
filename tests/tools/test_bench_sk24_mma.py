"""tools/bench_sk24_mma.py off the GPU: it says it needs one (exit 2, one line), and its summary
forms the geo-means and bound counts from rows as the timing section writes them."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import bench_sk24_mma  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_without_a_gpu_exits_with_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_sk24_mma.py"), "--out",
                          str(tmp_path / "x.json")], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == \
        "bench_sk24_mma: needs a CUDA GPU (sm_90)"


def test_summary_geo_means_and_bound_counts():
    def row(m, bf, fp, share):
        def cell(r):
            return {"over_dense": r, "default_over_dense": r / 2, "bound_share": share}
        return {"M": m, "bf16_2:4": cell(bf), "fp8_2:4": cell(fp)}
    rows = [row(1, 2.0, 4.0, 0.9), row(16, 0.5, 1.0, 0.5), row(32, 8.0, 8.0, 0.7)]
    s = bench_sk24_mma.summary(rows)
    assert math.isclose(s["bf16_2:4_over_dense_geo_m_le_16"], 1.0)
    assert math.isclose(s["fp8_2:4_over_dense_geo_m_le_16"], 2.0)
    assert math.isclose(s["fp8_2:4_default_over_dense_geo_m_le_16"], 1.0)
    assert s["bf16_2:4_rows_under_80pct"] == 2 and s["bf16_2:4_target"] == 1.6
    by_m = s["fp8_2:4_geo_by_m"]
    assert sorted(by_m) == [1, 16, 32]
    assert all(math.isclose(by_m[m], v) for m, v in ((1, 4.0), (16, 1.0), (32, 8.0)))


def test_checked_rows_record_the_error_or_what_was_raised():
    ref = torch.ones(4, 8)
    row = bench_sk24_mma.checked({"M": 4}, ref, lambda: ref * 1.001)
    assert row["ok"] and math.isclose(row["rel_err"], 1e-3, rel_tol=1e-3)
    assert not bench_sk24_mma.checked({}, ref, lambda: ref * 1.1)["ok"]

    def broken():
        raise RuntimeError("sk24 mma kernel: launch failed (code 7)")
    row = bench_sk24_mma.checked({}, ref, broken)
    assert row["ok"] is False and "code 7" in row["error"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_widen_section_times_both_ways_of_the_same_weight(tmp_path):
    out = bench_sk24_mma.main(["--sections", "widen", "--shapes", "8b_o", "--out",
                               str(tmp_path / "w.json")])
    (row,) = out["widen"]
    for way in ("fp8w", "int4"):
        assert row[way]["equal"]  # the op's weight is the fused elementwise ops' bitwise
        assert row[way]["op"]["us"] > 0 and row[way]["fused"]["us"] > 0
