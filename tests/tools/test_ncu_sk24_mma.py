"""tools/ncu_sk24_mma.py off the GPU: its cases from a sweep, ncu's CSV read into counters and
stall reasons, the launches matched to the cases, and the one-line refusal without a GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import ncu_sk24_mma as tool  # noqa: E402

SWEEP = ROOT / "docs" / "bench" / "bench_sk24_mma_2026-12-07d_m1_16_h100.json"

CSV = '''==PROF== Connected to process 1
==PROF== Profiling "sk24_mma_kernel": 0%....50%....100% - 30 passes
"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","launch__grid_size",\
"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_long_scoreboard_not_issued_per_issue_active.ratio"
"","","nsecond","byte","","ratio","ratio","ratio"
"0","sk24_mma_kernel","6,250","10,244,096","192","12.5","0.75","99"
"1","sk24_mma_kernel","24,100","47,710,208","896","n/a","3.5","99"
'''


def test_cases_take_each_rows_fastest_configuration_from_a_sweep():
    sweep = json.loads(SWEEP.read_text())
    shapes = [s for s in tool.SHAPES if s[0] in ("8b_qkv", "8b_down")]
    cases = tool.case_list(shapes, [1, 16], ["int4", "bf16"], ["best", "default", "8x4x1x1"],
                           sweep)
    best = {(r["shape"], r["M"]): r for r in sweep["time"]}
    for c in cases:
        assert c["kind"] in ("int4", "bf16") and c["M"] in (1, 16)
    got = [c["config"] for c in cases if c["shape"] == "8b_qkv" and c["M"] == 1
           and c["kind"] == "int4"]
    assert got == [tuple(best[("8b_qkv", 1)]["int4_2:4"]["config"]), "default", (8, 4, 1, 1)]
    # a configuration named twice for a row is profiled once
    again = tool.case_list(shapes[:1], [1], ["bf16"], ["8x4x1x1", "8x4x1x1"], None)
    assert len(again) == 1 and again[0]["N"] == 6144 and again[0]["K"] == 4096
    assert tool.case_list(shapes, [1], ["int4"], ["best"], None) == []  # no sweep: no best
    with pytest.raises(ValueError, match="WxSxTxX"):
        tool.parse_config("8x4x1")


def test_ncu_csv_becomes_counters_and_stall_reasons():
    rows = tool.parse_ncu_csv(CSV)
    assert len(rows) == 2 and rows[0]["Kernel Name"] == "sk24_mma_kernel"
    s = tool.summarize(rows[0])
    assert s["us"] == pytest.approx(6.25) and s["dram_read_bytes"] == 10244096
    assert s["grid"] == 192
    # stalls per issued instruction, largest first; the "not issued" variants left out
    assert list(s["stalls"]) == ["long_scoreboard", "wait"]
    assert s["stalls"]["long_scoreboard"] == 12.5
    assert list(tool.summarize(rows[1])["stalls"]) == ["wait"]  # "n/a" dropped
    assert tool.parse_ncu_csv("==PROF== nothing profiled\n") == []


def test_launches_are_matched_to_cases_in_order():
    rows = tool.parse_ncu_csv(CSV)
    cases = [{"shape": "a", "M": 1}, {"shape": "b", "M": 16}]
    joined = tool.join(cases, rows)
    assert [j["shape"] for j in joined] == ["a", "b"]
    assert joined[1]["summary"]["us"] == pytest.approx(24.1)
    # a filter that let the warm-up launches through: three a case, the last one kept
    assert tool.join(cases[:1], [{"ID": "w0"}, {"ID": "w1"}, rows[0]])[0]["raw"] is rows[0]
    with pytest.raises(RuntimeError, match="2 kernels for 1 cases"):
        tool.join(cases[:1], rows)


def test_ncu_profiles_only_the_child_runs_kernels_in_the_range():
    cmd = tool.ncu_command("ncu", Path("/tmp/log.csv"), ["--ms", "1"])
    text = " ".join(cmd)
    assert "--clock-control none" in text and "--nvtx-include sk/" in text
    assert "regex:sk24_mma" in text and "--page raw" in text and "--print-units base" in text
    assert all(f"--section {s}" in text for s in tool.SECTIONS)
    assert cmd[-3:] == ["--child", "--ms", "1"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_without_a_gpu_exits_with_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "ncu_sk24_mma.py"), "--out",
                          str(tmp_path / "x.json")], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == "ncu_sk24_mma: needs a CUDA GPU (sm_90) and Nsight Compute"


def test_a_bad_option_is_one_line():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "ncu_sk24_mma.py"), "--kinds",
                          "fp4"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith(
        "ncu_sk24_mma.py: error: --shapes takes")
