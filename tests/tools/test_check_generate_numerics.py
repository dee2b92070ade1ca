"""tools/check_generate_numerics.py: the smoke mode on CPU (a random tiny Llama, the kernels'
reference paths) compares the accelerated 2:4 model's greedy tokens and logits with the eager
masked model's."""

import json


def test_smoke_bf16_equals_eager_masked_model_and_fp8_is_quantized(tmp_path, tool_module):
    out = tmp_path / "n.json"
    tool_module("check_generate_numerics").main(["--smoke", "--out", str(out)])
    res = json.loads(out.read_text())
    assert set(res["batches"]) == {"1", "2"}
    for batch, ways in res["batches"].items():
        bf16, fp8 = ways["sk_bf16_2:4"], ways["sk_fp8_2:4"]
        # the reference paths compute the eager masked model's products: every greedy token
        # of bf16 2:4 is the eager model's, and its logits within bf16 rounding of them
        assert bf16["agreement"]["all_equal"] and bf16["agreement"]["equal_but_ties"], batch
        assert "agreement" in ways["control_hf_static_cache"]
        assert bf16["agreement"]["first_divergence"] == [8] * int(batch)
        assert bf16["logits_error"] < 5e-3
        # fp8 quantizes: its logits are off by more than bf16 rounding, by less than 15%
        assert 5 * bf16["logits_error"] < fp8["logits_error"] < 0.15
        # fp8 weights alone: off by more than bf16 rounding, by less than W8A8 (activations
        # stay bf16)
        fp8w = ways["sk_fp8w_2:4"]
        assert bf16["logits_error"] < fp8w["logits_error"] < fp8["logits_error"]
        assert res["summary"][batch]["fp8w_error_over_fp8"] == fp8w["logits_error"] / fp8[
            "logits_error"]
        assert res["summary"][batch]["bf16_greedy_all_equal"]
