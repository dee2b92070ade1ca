"""tools/probe_mma_sass.py: the reduced source compiles only what was asked for, the loop
holding the MMAs is found in nvdisasm's text and counted per round, and (with nvcc) the lean
rounds spend fewer instructions per weight byte than the configurations they mirror."""

import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import probe_mma_sass as tool  # noqa: E402

SASS = """
	.text._ZN12_GLOBAL__N_115sk24_mma_kernelILi1ELi2ELb1ELi8ELi4ELi1ELi3EEEvPK13__nv_bfloat16:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_3:
        /*0010*/                   LOP3.LUT R2, R3, 0xf000f, RZ, 0xc0, !PT ;
.L_x_4:
        /*0020*/                   HMMA.SP.16832.F32.BF16 R4, R8, R12, R4, R16, 0x0 ;
        /*0030*/                   HMMA.SP.16832.F32.BF16 R4, R8, R12, R4, R16, 0x1 ;
        /*0040*/                   HMMA.SP.16832.F32.BF16 R4, R8, R12, R4, R16, 0x0 ;
        /*0050*/                   HMMA.SP.16832.F32.BF16 R4, R8, R12, R4, R16, 0x1 ;
        /*0060*/                   LDG.E.128 R20, desc[UR4][R2.64] ;
        /*0070*/              @P0  BRA `(.L_x_4) ;
        /*0080*/                   BRA `(.L_x_3) ;
        /*0090*/                   EXIT ;
"""


def test_reduced_source_keeps_the_configurations_and_kinds_asked_for():
    text = tool.SOURCE.read_text()
    out = tool.reduced_source(text, ["int4"], [(8, 4, 1, 3), (8, 4, 1, 19)])
    go = [line.strip() for line in out.split("\n") if line.strip().startswith("SK24_GO(")]
    assert go == ["SK24_GO(8, 4, 1, 3)", "SK24_GO(8, 4, 1, 19)"]
    wt = [line.strip() for line in out.split("\n") if line.strip().startswith("SK24_WT(")]
    assert wt == ["SK24_WT(INT4, true)"]
    assert "launch_mt<2>(" not in out.split("sk24_mma_launch")[1].split("sk24_mma_version")[0]
    every_m = tool.reduced_source(text, ["int4"], [(8, 4, 1, 3)], all_m=True)
    assert "launch_mt<4>(" in every_m.split("sk24_mma_launch")[1]


def test_the_innermost_mma_loop_is_counted_per_round():
    found = tool.kernels(SASS)
    assert list(found) == ["1,2,1,8,4,1,3"]
    body = tool.mma_loop(found["1,2,1,8,4,1,3"])
    assert len(body) == 6 and body[-1].startswith("@P0  BRA")  # not the outer loop
    r = tool.row("int4", (8, 4, 1, 3), body)
    assert r["warp_instructions_per_round"] == 6.0  # 4 MMAs: one round of 4 steps
    assert tool.row("int4", (8, 4, 1, 3), body, mt=2)["warp_instructions_per_round"] == 12.0
    assert r["weight_bytes_per_round"] == 4 * 208
    assert r["thread_instructions_per_byte"] == round(32 * 6 / 832, 2)
    lean = tool.row("int4", (8, 4, 1, 19), body)  # two MMAs a step: half a round here
    assert lean["warp_instructions_per_round"] == 12.0


def test_a_bad_option_is_one_line(capsys):
    with pytest.raises(SystemExit):
        tool.main(["--kinds", "fp4", "--out", "/dev/null"])
    assert "error: --kinds takes" in capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(SystemExit):
        tool.main(["--configs", "8x4x1x5", "--out", "/dev/null"])
    assert "not built by the library" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.main(["--mt", "3", "--out", "/dev/null"])
    assert "--mt takes 1, 2 and 4" in capsys.readouterr().err


@pytest.mark.gpu  # compiles CUDA: only on GPU machines, never in the default CPU run
@pytest.mark.skipif(not torch.cuda.is_available() or shutil.which("nvcc") is None,
                    reason="compiles CUDA: a GPU machine with the CUDA toolkit")
def test_lean_rounds_spend_fewer_instructions_per_byte(tmp_path):
    rows = tool.main(["--kinds", "int4,bf16", "--configs", "8x4x1x3,8x4x1x19",
                      "--out", str(tmp_path / "x.json")])
    per = {(r["kind"], r["config"]): r["thread_instructions_per_byte"] for r in rows}
    for kind in ("int4", "bf16"):
        assert per[(kind, "8x4x1x19")] < 0.6 * per[(kind, "8x4x1x3")]
