import json

import pytest


@pytest.mark.slow
def test_smoke_measures_the_recipe(tmp_path, tool_module):
    """The smoke run prunes a config-built Llama 2:4 through the recipe and reports figures
    that hang together: the parameter count of its config, the solve inside the recipe's time,
    and per-billion figures scaled from them."""
    # in this process, as its command line (the peak RSS is then this process's: still at
    # least the RSS before the model)
    tool_module("bench_llm_recipe").main(["--smoke", "--out-dir", str(tmp_path)])
    r = json.loads((tmp_path / "bench_llm_recipe.json").read_text())
    c = r["config"]
    d, f, v, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    kv = d // c["num_attention_heads"] * c["num_key_value_heads"]
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d  # attention, MLP, two norms
    assert r["params"] == 2 * v * d + n * per_layer + d  # untied embeddings, final norm
    assert r["sparsity"] == 0.5
    assert 0 < r["sparsegpt_seconds"] < r["recipe_seconds"]
    per_b = r["per_billion_params_linear_extrapolation"]
    assert per_b["recipe_seconds"] == pytest.approx(r["recipe_seconds"] * 1e9 / r["params"],
                                                    rel=0.01)
    assert r["peak_rss_bytes"] >= r["rss_before_model_bytes"] > 0
    assert (tmp_path / "run" / "hf" / "config.json").exists()
