"""data=text: local text tokenized into windows, split without overlap, cached by content."""

from __future__ import annotations

import json

import pytest
import torch

from sparsekit.data.hf_text import text_data, text_files, token_stream
from sparsekit.errors import FileFormatError, UsageError

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizers(hf_dirs):
    load = transformers.AutoTokenizer.from_pretrained
    return {n: load(hf_dirs[n], local_files_only=True) for n in ("llama", "bert")}


def windows(ds) -> torch.Tensor:
    return torch.cat([ds[i][0] for i in range(len(ds))])


def test_split_is_contiguous_by_position_without_overlap(hf_dirs, tokenizers, tmp_path):
    tok = tokenizers["llama"]
    data = text_data(hf_dirs["text"], tok, 16, tmp_path, eval_fraction=0.2,
                     calibration_fraction=0.1)
    stream = token_stream([hf_dirs["text"]], tok, tmp_path)
    n = len(stream)
    a, b = int(n * 0.7), int(n * 0.8)
    assert data.info["split_tokens"] == {"training": a, "calibration": b - a, "evaluation": n - b}
    for ds, start, end in ((data.train, 0, a), (data.calibration, a, b), (data.eval, b, n)):
        # windows tile their part from its first token: inputs and targets never cross parts
        assert len(ds) == (end - start - 1) // 16
        assert torch.equal(windows(ds), stream[start : start + 16 * len(ds)])
        x, y = ds[len(ds) - 1]
        assert start + 16 * len(ds) <= end and torch.equal(y[:-1], x[1:])
    assert data.info["vocab_size"] == len(tok)


def test_jsonl_dir_and_glob(tokenizers, tmp_path):
    tok = tokenizers["llama"]
    (tmp_path / "d").mkdir()
    docs = [{"text": f"def f{i}(x):\n    return x * {i}\n" * 20} for i in range(30)]
    (tmp_path / "d" / "a.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    (tmp_path / "d" / "b.txt").write_text("import os\n" * 300)
    (tmp_path / "d" / "skip.md").write_text("# not read")
    assert [f.name for f in text_files(tmp_path / "d")] == ["a.jsonl", "b.txt"]
    assert [f.name for f in text_files(str(tmp_path / "d" / "*.jsonl"))] == ["a.jsonl"]
    data = text_data(tmp_path / "d", tok, 8, tmp_path / "cache")
    ids = token_stream(text_files(tmp_path / "d"), tok, tmp_path / "cache")
    # documents are joined by the end-of-text token
    assert int((ids == tok.eos_token_id).sum()) == len(docs)
    assert len(data.train) > 0
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(FileFormatError, match=r"bad.jsonl:1 has no string field 'text'"):
        text_data(tmp_path / "bad.jsonl", tok, 8, tmp_path / "cache")


def test_cached_by_content(hf_dirs, tokenizers, tmp_path, monkeypatch):
    tok = tokenizers["llama"]
    path = tmp_path / "t.txt"
    path.write_text(hf_dirs["text"].read_text()[:5000])
    first = token_stream([path], tok, tmp_path / "c")
    assert len(list((tmp_path / "c").glob("*.npy"))) == 1
    calls = []
    monkeypatch.setattr(type(tok), "__call__", lambda *a, **k: calls.append(1))
    assert torch.equal(token_stream([path], tok, tmp_path / "c"), first) and not calls
    path.write_text(path.read_text() + "\nx = 1\n")  # new content: tokenized again
    with pytest.raises(TypeError):
        token_stream([path], tok, tmp_path / "c")
    assert calls


def test_masked_lm_windows(hf_dirs, tokenizers, tmp_path):
    tok = tokenizers["bert"]
    data = text_data(hf_dirs["text"], tok, 32, tmp_path, task="masked_lm")
    x, y = data.eval[0]
    masked = y != -100
    assert masked.any() and (x[masked] == tok.mask_token_id).all()
    assert (x[~masked] != tok.mask_token_id).all()
    assert torch.equal(data.eval[0][0], x)  # the same masks every time: deterministic eval


@pytest.mark.parametrize(("content", "expected"), [
    ("", "holds no text"),
    ("x = 1\n", "is too short"),
])
def test_empty_or_short_text_is_one_line(content, expected, tokenizers, tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(content)
    with pytest.raises(UsageError) as e:
        text_data(path, tokenizers["llama"], 32, tmp_path)
    assert expected in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(("path", "expected"), [
    ("missing.txt", "no such file or directory"),
    ("*.nothing", "matches no .txt or .jsonl file"),
])
def test_bad_data_path_is_one_line(path, expected, tokenizers, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=expected):
        text_data(path, tokenizers["llama"], 32, tmp_path)
