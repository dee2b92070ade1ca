"""Teacher samples in a run (data.teacher_samples, data.teacher_mix, data.eval_path): a tiny
Llama through recipe=llm_datafree_24_distill from the command line, evaluated on held-out text
only; the mix of the training and calibration windows; one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from sparsekit.data.hf_text import text_data, token_stream
from sparsekit.data.text import ByteWindows
from sparsekit.run.config import Config, ConfigError, DataConfig, ModelConfig, validate
from sparsekit.run.loading import build_run_data, load_hf
from sparsekit.run.train import evaluate
from test_cli import run_cli

transformers = pytest.importorskip("transformers")

TINY = ["data.seq_len=32", "prune.calibration_batches=2", "data.eval_batches=2",
        "data.batch_size=4", "train.finetune_steps=3", "train.quiet=true", "tracker=none",
        "data.teacher_samples=8", "data.teacher_batch_size=4"]


def test_datafree_recipe_from_the_command_line(hf_dirs, tmp_path, capsys):
    cache = tmp_path / "c"
    code, _, err = run_cli(["recipe=llm_datafree_24_distill", f"model.path={hf_dirs['llama']}",
                            f"data.eval_path={hf_dirs['text']}", f"cache_dir={cache}", *TINY],
                           tmp_path, capsys)
    assert code == 0, err
    (run_dir,) = (tmp_path / "runs").iterdir()
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["sparsity"] == 0.5 and s["finetune_steps"] == 3
    teacher = s["teacher_samples"]
    assert (teacher["samples"], teacher["mix"], teacher["seq_len"]) == (8, 1.0, 33)
    assert teacher["first_tokens"] == 4 and teacher["top_p"] == 0.95
    assert len(list((cache / "data").glob("teacher_samples_*.safetensors"))) == 1
    # held-out perplexity is on data.eval_path's text alone: the dense model on its first
    # 2 x 8 windows (data.eval_batch_size 8), computed here from the file
    tok = transformers.AutoTokenizer.from_pretrained(hf_dirs["llama"])
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs["llama"]).eval()
    windows = ByteWindows(token_stream([hf_dirs["text"]], tok, tmp_path / "t"), 32)
    want = evaluate(model, windows, "lm", batch_size=8, max_batches=2, quiet=True)
    assert s["dense"]["perplexity"] == pytest.approx(want["perplexity"], rel=1e-5)
    assert 30 < s["compressed"]["perplexity"] < 3000


def _config(hf_dirs, tmp_path, **data) -> Config:
    cfg = Config(model=ModelConfig(name="hf", path=str(hf_dirs["llama"])),
                 data=DataConfig(name="text", task="lm", seq_len=16, **data),
                 cache_dir=str(tmp_path / "c"))
    cfg.train.quiet = True
    return validate(cfg)


def test_mixed_run_data_honours_the_fraction_and_keeps_evaluation_clean(hf_dirs, tmp_path):
    cfg = _config(hf_dirs, tmp_path, path=str(hf_dirs["text"]), teacher_samples=6,
                  teacher_mix=0.25, teacher_batch_size=3)
    model, tok = load_hf(cfg)
    data = build_run_data(cfg, model, tok)
    text = text_data(hf_dirs["text"], tok, 16, tmp_path / "c" / "data")
    teacher = {tuple(data.train[i][0].tolist()) for i in range(len(data.train))
               if data.train[i][0][0] == tok.bos_token_id}
    assert len(teacher) == 6  # every teacher window, each a BOS start
    for name, part, own in (("train", data.train, text.train),
                            ("calibration", data.calibration, text.calibration)):
        rows = [tuple(part[i][0].tolist()) for i in range(len(part))]
        flags = [r in teacher for r in rows]
        for k in (4, 8, 40, len(rows)):  # a quarter of every prefix
            assert sum(flags[:k]) == k // 4, (name, k)
        users = [r for r, f in zip(rows, flags) if not f]
        assert users[: len(own)] == [tuple(own[i][0].tolist()) for i in range(len(own))][
            : len(users)]
    assert len(data.eval) == len(text.eval)
    for i in range(len(data.eval)):
        assert torch.equal(data.eval[i][0], text.eval[i][0])
    assert data.info["teacher"]["samples"] == 6


def test_eval_path_replaces_the_held_out_part(hf_dirs, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text("def other_domain(x):\n    return x * 2\n" * 40)
    cfg = _config(hf_dirs, tmp_path, path=str(hf_dirs["text"]), eval_path=str(other))
    model, tok = load_hf(cfg)
    data = build_run_data(cfg, model, tok)
    stream = token_stream([other], tok, tmp_path / "t")
    assert len(data.eval) == (len(stream) - 1) // 16
    assert torch.equal(data.eval[0][0], stream[:16])
    assert "teacher" not in data.info


@pytest.mark.parametrize(("args", "expected"), [
    (["data.path=null", "data.teacher_mix=1"], "give data.eval_path="),
    (["data.path=null", "data.teacher_mix=0.5"], "data=text needs data.path=FILE|DIR|GLOB"),
    (["data.eval_path={tmp}/missing.txt"], "data.eval_path='"),
    (["data.teacher_mix=0"], "data.teacher_mix=0.0 must be a finite number in (0, 1]"),
    (["model.path={bert}"], "needs a causal LM teacher"),
])
def test_teacher_mistakes_are_one_line(args, expected, hf_dirs, tmp_path, capsys):
    given = [a.format(tmp=tmp_path, bert=hf_dirs["bert"]) for a in args]
    rest = [f"model.path={hf_dirs['llama']}", f"data.path={hf_dirs['text']}"]
    rest = [r for r in rest if not any(a.startswith(r.split("=")[0]) for a in given)]
    code, _, err = run_cli(["recipe=llm_datafree_24_distill", *rest, *given, *TINY], tmp_path,
                           capsys)
    assert code in (1, 2)
    # stage lines (progress on the sparsekit logger) may come first; the error is one line
    errors = [line for line in err.splitlines() if not line.startswith("stage ")]
    assert len(errors) == 1 and errors[0].startswith("sparsekit: error: "), err
    assert expected in errors[0] and "Traceback" not in err, err


def test_teacher_samples_need_a_language_model_and_text():
    cfg = Config()
    cfg.data.teacher_samples = 4
    with pytest.raises(ConfigError, match=r"data\.teacher_samples=4 needs a causal LM .* "
                                          r"model=hf and data=text"):
        validate(cfg)
