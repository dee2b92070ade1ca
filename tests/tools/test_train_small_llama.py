import json

import pytest

from sparsekit.run.cli import recipe_names

# one of the five default recipes, the one that fine-tunes (the tool passes --finetune-steps):
# every recipe runs on a tiny Llama in tests/test_llm_recipes.py, and each run here is a
# process that costs seconds of imports
RECIPES = ("llm_wanda_24_distill",)


@pytest.mark.slow
def test_smoke_trains_saves_and_runs_the_recipes(tmp_path, tool_module):
    """The model trains (its loss falls below the uniform guess), is saved as a from_pretrained
    directory, and each recipe's dense perplexity is the one the tool measured on the very same
    held-out split, so the model never saw the text it is scored on. The tool runs in this
    process (its recipes are CLI processes, as from its command line)."""
    pytest.importorskip("transformers")
    tool_module("train_small_llama").main(["--smoke", "--out-dir", str(tmp_path), "--recipes",
                                           ",".join(RECIPES)])
    r = json.loads((tmp_path / "train_small_llama.json").read_text())
    assert r["train_steps"] > 0 and r["held_out_perplexity"] < r["config"]["vocab_size"] / 2
    assert list(r["recipes"]) == list(RECIPES)
    for name, rec in r["recipes"].items():
        assert rec["perplexity_before"] == pytest.approx(r["held_out_perplexity"], rel=1e-4)
        assert rec["sparsity"] == 0.5 and rec["size_bytes_after"] < rec["size_bytes_before"]
        assert (tmp_path / "runs" / name / "hf" / "model.safetensors").exists()
    assert (tmp_path / "model" / "tokenizer.json").exists()


def test_default_recipes_are_known_recipes(tool_module):
    """Without --recipes the tool runs these five, each a recipe the command line knows."""
    default = tool_module("train_small_llama").RECIPES
    assert set(default) == {"llm_sparsegpt_24", "llm_sparsegpt_24_fp8", "llm_wanda_24_distill",
                            "llm_sparsegpt_24_fp8_static", "llm_sparsegpt_24_fp8_static_tensor"}
    assert set(default) <= set(recipe_names())
