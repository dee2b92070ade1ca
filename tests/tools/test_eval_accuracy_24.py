import json

import pytest


def test_smoke_measures_every_criterion_and_the_distillation(tmp_path, tool_module):
    """On tiny random models: every criterion's 2:4 agreement (a cosine in (0, 1)) and
    perplexity, and the distilled model's, land in the JSON; the sentence source is real."""
    pytest.importorskip("transformers")
    out = tmp_path / "acc.json"
    tool_module("eval_accuracy_24").main(["--smoke", "--out", str(out)])  # one thread
    r = json.loads(out.read_text())
    assert set(r["embedding_oneshot"]) == {"sparsegpt", "alps"}
    for row in r["embedding_oneshot"].values():
        assert 0 < row["cosine"] < 1
    assert r["embedding_distill"]["steps"] == 3 and 0 < r["embedding_distill"]["cosine"] < 1
    ppl = r["lm_oneshot_perplexity"]
    assert set(ppl) == {"dense", "sparsegpt", "alps"} and all(v > 1 for v in ppl.values())
    assert r["lm_distill"]["ratio_to_dense"] == pytest.approx(
        r["lm_distill"]["perplexity"] / ppl["dense"])


def load_tool():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "eval_accuracy_24", Path(__file__).resolve().parents[2] / "tools" / "eval_accuracy_24.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_stdlib_sentences_are_english_and_distinct():
    sents = load_tool().stdlib_sentences(limit=50)
    assert len(sents) >= 50 and len(set(sents)) == len(sents)
    assert all(40 <= len(s) <= 240 and s[0].isupper() for s in sents)


class WordTokenizer:
    """One token per word ("s<i>": i + 2, any other word: 1), padded with 0, as a tokenizer
    returns."""

    def __call__(self, texts, padding=False, truncation=True, max_length=128, return_tensors=None):
        import torch

        ids = [[int(w[1:]) + 2 if w[0] == "s" else 1 for w in t.split()][:max_length]
               for t in texts]
        if not padding:
            return {"input_ids": ids}
        width = max(map(len, ids))
        return {"input_ids": torch.tensor([x + [0] * (width - len(x)) for x in ids]),
                "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x))
                                                for x in ids])}


def test_length_batches_cover_every_sentence_once_with_less_padding():
    import random

    tool = load_tool()
    rng = random.Random(0)
    sents = [f"s{i} " + "a " * rng.randint(2, 40) for i in range(700)]
    tok = WordTokenizer()
    bucketed = tool.length_batches(tok, sents, 32, seed=0)
    plain = tool.batches_of(tok, sents, 32)
    assert len(bucketed) == len(plain) == 22
    firsts = sorted(int(i) - 2 for b in bucketed for i in b["input_ids"][:, 0])
    assert firsts == list(range(700))  # every sentence once
    lengths = [int(n) for b in bucketed for n in b["attention_mask"].sum(1)]
    assert sorted(lengths) == sorted(len(s.split()) for s in sents)
    padded = sum(b["input_ids"].numel() for b in bucketed)
    assert padded < 0.7 * sum(b["input_ids"].numel() for b in plain)
    again = tool.length_batches(tok, sents, 32, seed=0)
    other = tool.length_batches(tok, sents, 32, seed=1)
    assert all(a["input_ids"].equal(b["input_ids"]) for a, b in zip(bucketed, again))
    assert [b["input_ids"][:, 0].tolist() for b in bucketed] != \
        [b["input_ids"][:, 0].tolist() for b in other]
