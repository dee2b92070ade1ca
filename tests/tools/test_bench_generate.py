"""tools/bench_generate.py: the smoke mode on CPU (tiny Llama, reference kernels) writes every
row the H200 run writes; on a GPU, one shape's GEMM rows are timed and agree with cuBLAS."""

import json

import pytest
import torch


@pytest.mark.slow
def test_smoke_writes_gemm_and_generate_rows(tmp_path, tool_module):
    out = tmp_path / "gen.json"
    tool_module("bench_generate").main(["--smoke", "--batches", "2", "--profile",
                                        "--precisions", "bf16,fp8,int4,fp8w,int4dense", "--out",
                                        str(out)])
    res = json.loads(out.read_text())
    assert {r["M"] for r in res["gemm"]} == {1, 3}
    for row in res["gemm"]:
        # the small-M kernels' reference paths compute the dense product of the same weight
        assert row["bf16_2:4"]["rel_err"] < 1e-2 and row["fp8_2:4"]["rel_err"] < 0.1
        assert row["bf16_2:4"]["bytes"] < row["bf16_dense"]["bytes"]
    assert set(res["gemm_summary"]) == {"bf16_2:4", "fp8_2:4"}
    gen = res["generate"]["2"]
    assert gen["reference"] == "dense_sk"
    assert set(gen["ways"]) == {"dense_sk", "sk_bf16_2:4", "sk_fp8_2:4", "sk_int4_2:4",
                                "sk_fp8w_2:4", "sk_int4_dense"}
    for way in gen["ways"].values():
        assert way["agreement"]["equal_fraction"] >= 0.0 and "accelerate_s" in way
        assert way["compiled"] and way["compiles"] >= 1  # no way left uncompiled
        # the first call's graph-building calls, within the first call's time
        graphs = way["first_call_graphs_s"]
        assert graphs.keys() == {"prefill", "decode"} and min(graphs.values()) > 0
        assert sum(graphs.values()) <= way["first_call_s"]
    assert "reference_warning" not in gen
    # which small-M kernel the layers decode on (CPU: the Triton format's reference)
    assert gen["ways"]["sk_bf16_2:4"]["decode_kernels"] == {"sk24": 7}  # q k v o gate up down
    # int4dense: the same int4 weights on the dense int4 kernel, no layer on a 2:4 one
    int4_dense = gen["ways"]["sk_int4_dense"]["decode_kernels"]
    assert int4_dense == {"int4_triton": 7}
    # the decode plan's notes per way (its timings need CUDA: none on CPU)
    assert all(w["decode_notes"] == [] for n, w in gen["ways"].items() if n.startswith("sk_"))
    # --profile: kernel times need CUDA (bench_models.profile_shares), none on CPU
    assert all(way["profile"] is None for way in gen["ways"].values())
    # the bf16 2:4 model generates the dense run's tokens of the same weights on CPU
    assert gen["ways"]["sk_bf16_2:4"]["agreement"]["equal_fraction"] == 1.0


@pytest.mark.slow
def test_smoke_head_precision_puts_the_lm_head_on_int4(tmp_path, tool_module):
    """--head int4: the LM head (no 2:4 zeros) of each compressed way runs on the int4 dense
    kernel, the dense reference keeps it bf16; the default leaves it bf16."""
    def kernels(*extra):
        out = tmp_path / "gen.json"
        tool_module("bench_generate").main(["--smoke", "--sections", "generate", "--batches", "1",
                                            "--precisions", "bf16", *extra, "--out", str(out)])
        ways = json.loads(out.read_text())["generate"]["1"]["ways"]
        return {name: way["decode_kernels"] for name, way in ways.items()}

    assert kernels("--head", "int4") == {"sk_bf16_2:4": {"sk24": 7, "int4_triton": 1},
                                         "dense_sk": {}}
    assert kernels() == {"sk_bf16_2:4": {"sk24": 7}, "dense_sk": {}}


def test_unknown_precision_is_one_line_naming_the_choices(tmp_path, tool_module, capsys):
    with pytest.raises(SystemExit) as e:
        tool_module("bench_generate").main(["--smoke", "--sections", "generate",
                                            "--precisions", "bf16,int3", "--out",
                                            str(tmp_path / "g.json")])
    assert e.value.code == 2 and not (tmp_path / "g.json").exists()
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--precisions" in err and "int3" in err and "int4dense" in err


@pytest.mark.parametrize("flag,option", [("pdl", "triton.enable_pdl"),
                                         ("combo", "combo_kernels")])
def test_inductor_flag_turns_on_inductors_option_for_the_run(flag, option, tmp_path,
                                                            tool_module):
    import torch._inductor.config as inductor_config

    with inductor_config.patch({option: False}):  # restored afterwards
        res = tool_module("bench_generate").main(["--smoke", "--sections", "none",
                                                  f"--inductor-{flag}",
                                                  "--out", str(tmp_path / "g.json")])
        assert getattr(inductor_config, option) is True
    assert getattr(inductor_config, option) is False
    assert res["args"][f"inductor_{flag}"] is True
    assert json.loads((tmp_path / "g.json").read_text())["args"][f"inductor_{flag}"] is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gemm_rows_on_gpu(tmp_path, run_tool):
    out = tmp_path / "g.json"
    run_tool("bench_generate.py", "--sections", "gemm", "--shapes", "8b_o", "--out", out)
    rows = json.loads(out.read_text())["gemm"]
    assert len(rows) == 4
    for row in rows:
        assert row["bf16_2:4"]["rel_err"] < 1e-2 and row["bf16_2:4"]["us"] > 0
