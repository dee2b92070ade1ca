"""tools/probe_int4_sass.py: the K-loop finder on a hand-written listing, and --smoke (one
sm_90 compilation and disassembly, no GPU)."""

import json

import pytest



@pytest.fixture
def probe(tool_module):
    return tool_module("probe_int4_sass")


LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/              @!P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0030*/                   LDG.E R4, [R2.64] ;
        /*0040*/                   FFMA R5, R4, R4, R5 ;
        /*0050*/                   ISETP.NE.AND P1, PT, R2, RZ, PT ;
        /*0060*/               @P1 BRA `(.L_x_1) ;
        /*0070*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0080*/                   EXIT ;
"""


def test_loop_body_is_the_longest_backward_branch(probe):
    body = probe.loop_body(LISTING)
    assert body == ["LDG.E R4, [R2.64]", "FFMA R5, R4, R4, R5",
                    "ISETP.NE.AND P1, PT, R2, RZ, PT", "@P1 BRA `(.L_x_1)"]
    assert probe.loop_body(".L_x_0:\n /*0000*/ EXIT ;\n") == []  # no loop: nothing
    assert 6.9 < probe.ISSUE_BUDGET < 7.1


@pytest.mark.slow  # one Triton compilation for sm_90
def test_smoke_compiles_and_counts(probe, tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "sass.json"
    (row,) = probe.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == [row]
    assert row["kernel"] == "int4_dense" and row["weight_bytes_per_thread"] == 16.0
    assert row["loop_instructions"] > 16  # at least one instruction per weight byte
    assert row["instructions_per_byte"] == pytest.approx(row["loop_instructions"] / 16, abs=0.01)
    assert 0 < row["issue_bound_pct"] <= 100
