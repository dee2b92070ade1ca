import json

import pytest


def test_smoke_trains_saves_and_runs_the_recipes(tmp_path, run_tool):
    """The model trains (its loss falls below the uniform guess), is saved as a from_pretrained
    directory, and each recipe's dense perplexity is the one the tool measured on the very same
    held-out split, so the model never saw the text it is scored on."""
    pytest.importorskip("transformers")
    run_tool("train_small_llama.py", "--smoke", "--out-dir", tmp_path)
    r = json.loads((tmp_path / "train_small_llama.json").read_text())
    assert r["train_steps"] > 0 and r["held_out_perplexity"] < r["config"]["vocab_size"] / 2
    assert set(r["recipes"]) == {"llm_sparsegpt_24", "llm_sparsegpt_24_fp8",
                                 "llm_wanda_24_distill", "llm_sparsegpt_24_fp8_static",
                                 "llm_sparsegpt_24_fp8_static_tensor"}
    for name, rec in r["recipes"].items():
        assert rec["perplexity_before"] == pytest.approx(r["held_out_perplexity"], rel=1e-4)
        assert rec["sparsity"] == 0.5 and rec["size_bytes_after"] < rec["size_bytes_before"]
        assert (tmp_path / "runs" / name / "hf" / "model.safetensors").exists()
    assert (tmp_path / "model" / "tokenizer.json").exists()
