"""Distillation: each loss against values computed by hand, the Distiller's defaults by task,
masks held through distill_, and the feature-extraction path on the command line (a tiny
random BERT on data=text: embedding agreement before and after)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparsekit as sk
from sparsekit.errors import UsageError
from sparsekit.prune.distill import Distiller, distill_, kl_loss, pooled_embedding, vector_loss
from test_cli import run_cli


def test_kl_loss_by_hand():
    s, t, temp = torch.tensor([[1.0, 2.0, 0.0]]), torch.tensor([[0.5, 0.0, 1.5]]), 2.0
    p = [math.exp(v / temp) for v in (0.5, 0.0, 1.5)]
    p = [v / sum(p) for v in p]
    q = [math.exp(v / temp) for v in (1.0, 2.0, 0.0)]
    q = [v / sum(q) for v in q]
    want = temp**2 * sum(a * math.log(a / b) for a, b in zip(p, q))
    assert float(kl_loss(s, t, temp)) == pytest.approx(want, rel=1e-5)
    # tokens of a language model: the mean over (batch, time)
    s2, t2 = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    each = [float(kl_loss(s2[i, j], t2[i, j], 1.0)) for i in range(2) for j in range(3)]
    assert float(kl_loss(s2, t2, 1.0)) == pytest.approx(sum(each) / 6, rel=1e-5)


def test_cosine_and_mse_by_hand():
    s = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    t = torch.tensor([[4.0, 3.0], [0.0, 2.0]])
    assert float(vector_loss(s, t, "cosine")) == pytest.approx(((1 - 24 / 25) + 1) / 2)
    assert float(vector_loss(s, t, "mse")) == pytest.approx((1 + 1 + 1 + 4) / 4)
    # padding weighs 0: only the first vector counts
    w = torch.tensor([1.0, 0.0])
    assert float(vector_loss(s, t, "cosine", w)) == pytest.approx(1 - 24 / 25)


def test_pooled_embedding_ignores_padding():
    h = torch.tensor([[[1.0, 1.0], [3.0, 5.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    torch.testing.assert_close(pooled_embedding(h, mask), torch.tensor([[2.0, 3.0]]))


class Encoder(nn.Module):
    """A toy encoder with a transformers-like output: last_hidden_state and hidden_states."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 8)

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False):
        h1 = torch.tanh(self.a(input_ids))
        h2 = self.b(h1)
        out = {"last_hidden_state": h2}
        if output_hidden_states:
            out["hidden_states"] = (h1, h2)
        return out


def test_distiller_by_task_and_feature_matching_by_hand():
    torch.manual_seed(0)
    teacher, student = Encoder(), Encoder()
    batch = {"input_ids": torch.randn(3, 5, 4), "attention_mask": torch.tensor(
        [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])}
    d = Distiller(teacher, task="feature_extraction", feature_weight=0.5)
    assert (d.target, d.loss) == ("pooled", "cosine")
    _, loss = d(student, batch)
    with torch.no_grad():
        t, s = teacher(**batch, output_hidden_states=True), student(**batch,
                                                                   output_hidden_states=True)
    m = batch["attention_mask"]
    emb = [pooled_embedding(o["last_hidden_state"], m) for o in (s, t)]
    want = (1 - F.cosine_similarity(*emb, dim=-1)).mean()
    feats = []
    for hs, ht in zip(s["hidden_states"], t["hidden_states"]):
        per = 1 - F.cosine_similarity(hs, ht, dim=-1)
        feats.append((per * m).sum() / m.sum())
    want = want + 0.5 * torch.stack(feats).mean()
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-6)
    mse = Distiller(teacher, task="feature_extraction", target="last_hidden", loss="mse")
    _, got = mse(student, batch)
    per = (s["last_hidden_state"] - t["last_hidden_state"]).pow(2).mean(-1)
    torch.testing.assert_close(got.detach(), (per * m).sum() / m.sum())
    with pytest.raises(UsageError, match="loss='kl' compares distributions"):
        Distiller(teacher, task="feature_extraction", loss="kl")
    with pytest.raises(UsageError, match="target='layers' is not allowed"):
        Distiller(teacher, target="layers")


def test_distill_keeps_the_pruners_masks():
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    student.load_state_dict(teacher.state_dict())
    pruner = sk.Pruner(student, pattern="2:4")
    pruner.step(0)
    masks = {n: m.clone() for n, m in pruner.masks.items()}
    x = [torch.randn(16, 8) for _ in range(2)]
    losses = sk.distill_(student, teacher, x, steps=30, lr=1e-2, pruner=pruner,
                         weight_decay=0.1)
    assert losses[-1] < 0.5 * losses[0]
    pruner.finalize()
    for name, mask in masks.items():
        assert torch.equal(student.get_submodule(name).weight != 0, mask)
    with pytest.raises(UsageError, match="no pruner= holds them"):
        sk.distill_(student, teacher, x, steps=1)


def test_distill_warms_up_the_learning_rate():
    """AdamW's first step moves every weight with a gradient by the learning rate (m / sqrt(v)
    is the gradient's sign; no weight decay): lr without warm-up, lr / warmup with it."""
    torch.manual_seed(0)
    teacher = nn.Linear(4, 4)
    x = [torch.randn(8, 4)]
    for warmup, factor in ((0, 1.0), (4, 0.25)):
        student = nn.Linear(4, 4)
        before = student.weight.detach().clone()
        sk.distill_(student, teacher, x, steps=1, lr=1e-2, task="classification",
                    warmup=warmup)
        torch.testing.assert_close((student.weight - before).abs(),
                                   torch.full((4, 4), 1e-2 * factor), rtol=1e-4, atol=0)
    with pytest.raises(UsageError, match="warmup=-1"):
        sk.distill_(nn.Linear(4, 4), teacher, x, steps=1, warmup=-1)


def test_distill_without_dropout_trains_in_eval_mode():
    """dropout=False: the first loss is the eval-mode loss, computed before any step; with
    dropout on (p=0.5) it is not, and the model is left in eval mode either way."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4))
    x = torch.randn(16, 8)
    for dropout in (False, True):
        student = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4))
        student.load_state_dict(teacher.state_dict())
        with torch.no_grad():
            student[0].weight.mul_(0.5)
            want = float(Distiller(teacher, task="classification")(student.eval(), x)[1])
        losses = sk.distill_(student, teacher, [x], steps=2, lr=1e-3, task="classification",
                             dropout=dropout)
        assert (losses[0] == pytest.approx(want, rel=1e-6)) is not dropout
        assert not student.training


def test_feature_extraction_on_text_from_the_command_line(hf_dirs, tmp_path, capsys):
    args = ["recipe=embedding_alps_24_distill", f"model.path={hf_dirs['bert']}",
            f"data.path={hf_dirs['text']}", f"cache_dir={tmp_path / 'c'}", "data.seq_len=32",
            "prune.calibration_batches=2", "data.eval_batches=2", "data.batch_size=4",
            "train.finetune_steps=4", "train.finetune_lr=0.003", "train.quiet=true",
            "tracker=none", "prune.options.iters=30"]
    code, _, err = run_cli(args, tmp_path, capsys)
    assert code == 0, err
    (run_dir,) = (tmp_path / "runs").iterdir()
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["metric"] == "cosine" and s["sparsity"] == 0.5
    assert s["dense"]["cosine"] == pytest.approx(1.0)
    assert 0.0 < s["compressed"]["cosine"] < 0.9999
    # hf/ is a sentence-transformers directory: the run's mean pooling over the attention mask
    hf_dir = run_dir / "hf"
    modules = json.loads((hf_dir / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling"]
    pooling = json.loads((hf_dir / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode_mean_tokens"] and pooling["word_embedding_dimension"] == 32
    assert not pooling["pooling_mode_cls_token"] and not pooling["pooling_mode_max_tokens"]
    transformers = pytest.importorskip("transformers")
    st = pytest.importorskip("sentence_transformers")
    sentences = ["def main(argv):", "import os, sys", "return the sum of the squares"]
    loaded = st.SentenceTransformer(str(hf_dir), device="cpu", local_files_only=True)
    got = loaded.encode(sentences, convert_to_tensor=True)
    model = sk.load(hf_dir / "sparsekit.safetensors").eval()  # the measured model
    batch = transformers.AutoTokenizer.from_pretrained(hf_dir)(sentences, padding=True,
                                                               return_tensors="pt")
    with torch.no_grad():
        want = pooled_embedding(model(**batch).last_hidden_state, batch["attention_mask"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    code, _, err = run_cli(args[:-1] + ["prune.options.blocksize=64"], tmp_path, capsys)
    assert code == 2 and "prune.options.blocksize is not an option of prune.criterion=alps" in err


def test_sentence_transformers_modules_come_from_the_source_when_it_has_them(tmp_path):
    """A source model with sentence-transformers modules (pooling, normalization) passes them on
    to the export; one naming another type (imported when it loads) is ignored for mean
    pooling."""
    from sparsekit.run.loading import export_sentence_transformers

    src, out = tmp_path / "src", tmp_path / "out"
    for d in (src / "1_Pooling", src / "2_Normalize", out):
        d.mkdir(parents=True)
    types = ["Transformer", "Pooling", "Normalize"]
    modules = [{"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{t}"}
               for i, (p, t) in enumerate(zip(["", "1_Pooling", "2_Normalize"], types))]
    (src / "modules.json").write_text(json.dumps(modules))
    (src / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true}')
    (src / "sentence_bert_config.json").write_text('{"max_seq_length": 256}')
    assert export_sentence_transformers(out, str(src), 8, 32).endswith(
        "Transformer, Pooling, Normalize")
    assert json.loads((out / "modules.json").read_text()) == modules
    assert (out / "2_Normalize").is_dir()
    assert json.loads((out / "1_Pooling" / "config.json").read_text()) == {
        "pooling_mode_cls_token": True}
    assert json.loads((out / "sentence_bert_config.json").read_text())["max_seq_length"] == 256
    modules[2]["type"] = "os.system"  # not a sentence-transformers module: not copied
    (src / "modules.json").write_text(json.dumps(modules))
    out2 = tmp_path / "out2"
    out2.mkdir()
    assert "mean" in export_sentence_transformers(out2, str(src), 8, 32)
    assert json.loads((out2 / "1_Pooling" / "config.json").read_text())[
        "word_embedding_dimension"] == 8
    assert not (out2 / "2_Normalize").exists()


def _tiny_lm(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 32))


def test_distill_resumes_from_its_checkpoint_bit_exactly(tmp_path):
    """A run stopped at step 5 and resumed from its checkpoint ends with the very weights,
    losses and token count of an uninterrupted run (same schedule and batch order)."""
    teacher = _tiny_lm(0)
    batches = [torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(i))
               for i in range(3)]

    def student_and_pruner():
        student = _tiny_lm(0)
        pruner = sk.Pruner(student, pattern="2:4", include=["1", "3"])
        pruner.step(0)
        return student, pruner

    full_model, full_pruner = student_and_pruner()
    full = distill_(full_model, teacher, batches, steps=10, lr=1e-2, pruner=full_pruner,
                    task="causal_lm")
    model, pruner = student_and_pruner()
    ckpt = tmp_path / "distill.pt"

    def stop_at_5(step, metrics):
        assert metrics["distill/tokens_per_s"] > 0
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill_(model, teacher, batches, steps=10, lr=1e-2, pruner=pruner, task="causal_lm",
                 checkpoint=ckpt, checkpoint_every=0.0, on_log=stop_at_5, log_every=1)
    model, pruner = student_and_pruner()
    resumed = distill_(model, teacher, batches, steps=10, lr=1e-2, pruner=pruner,
                       task="causal_lm", checkpoint=ckpt)
    assert resumed.resumed_from == 5 and resumed.steps_done == 10 and resumed.finished
    assert resumed == full and resumed.tokens == full.tokens == 10 * 32
    for a, b in zip(model.state_dict().values(), full_model.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(UsageError, match="more than steps=4"):
        distill_(model, teacher, batches, steps=4, pruner=pruner, task="causal_lm",
                 checkpoint=ckpt)


def test_distill_bf16_and_time_budget():
    teacher, student = _tiny_lm(0), _tiny_lm(1)
    batches = [torch.randint(0, 32, (8, 8))]
    run = distill_(student, teacher, batches, steps=30, lr=1e-2, task="causal_lm",
                   precision="bf16")
    assert run[-1] < run[0] and run.finished and run.tokens_per_s > 0
    assert run.peak_memory_gb is None  # CPU
    stopped = distill_(_tiny_lm(1), teacher, batches, steps=10**6, task="causal_lm",
                       max_seconds=0.2)
    assert not stopped.finished and 0 < stopped.steps_done < 10**6
    with pytest.raises(UsageError, match="precision='fp16'.*fp32, bf16"):
        distill_(_tiny_lm(1), teacher, batches, steps=1, task="causal_lm", precision="fp16")
