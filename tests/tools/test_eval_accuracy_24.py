import json

import pytest


def test_smoke_measures_every_criterion_and_the_distillation(tmp_path, run_tool):
    """On tiny random models: every criterion's 2:4 agreement (a cosine in (0, 1)) and
    perplexity, and the distilled model's, land in the JSON; the sentence source is real."""
    pytest.importorskip("transformers")
    out = tmp_path / "acc.json"
    run_tool("eval_accuracy_24.py", "--smoke", "--out", out)
    r = json.loads(out.read_text())
    assert set(r["embedding_oneshot"]) == {"sparsegpt", "alps"}
    for row in r["embedding_oneshot"].values():
        assert 0 < row["cosine"] < 1
    assert r["embedding_distill"]["steps"] == 3 and 0 < r["embedding_distill"]["cosine"] < 1
    ppl = r["lm_oneshot_perplexity"]
    assert set(ppl) == {"dense", "sparsegpt", "alps"} and all(v > 1 for v in ppl.values())
    assert r["lm_distill"]["ratio_to_dense"] == pytest.approx(
        r["lm_distill"]["perplexity"] / ppl["dense"])


def test_stdlib_sentences_are_english_and_distinct():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "eval_accuracy_24", Path(__file__).resolve().parents[2] / "tools" / "eval_accuracy_24.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    sents = tool.stdlib_sentences(limit=50)
    assert len(sents) >= 50 and len(set(sents)) == len(sents)
    assert all(40 <= len(s) <= 240 and s[0].isupper() for s in sents)
