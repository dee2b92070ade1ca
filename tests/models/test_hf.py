"""Hugging Face models: offline loading and building, the API (prune_, save/load) on HF batches,
sequential SparseGPT over the blocks, and the from_pretrained export."""

from __future__ import annotations

import copy
import sys
import json

import pytest
import torch

import sparsekit as sk
from sparsekit.prune import sparsegpt
from sparsekit.errors import UsageError
from sparsekit.nn.select import select_modules

transformers = pytest.importorskip("transformers")
from sparsekit.models import hf  # noqa: E402

HEAD = "re:lm_head|cls.predictions.decoder"
TINY = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_load_picks_the_auto_class_from_architectures(hf_dirs):
    llama = hf.load_pretrained(hf_dirs["llama"])
    bert = hf.load_pretrained(hf_dirs["bert"])
    assert type(llama).__name__ == "LlamaForCausalLM"
    assert type(bert).__name__ == "BertForMaskedLM"
    assert llama._sparsekit_spec["kwargs"]["task"] == "causal_lm"
    assert bert._sparsekit_spec["kwargs"]["task"] == "masked_lm"
    bare = hf.load_pretrained(hf_dirs["bert"], task="feature_extraction")
    assert type(bare).__name__ == "BertModel"
    # the stored spec rebuilds the same architecture through the builder
    again = hf.hf(**llama._sparsekit_spec["kwargs"])
    assert {k: v.shape for k, v in again.state_dict().items()} == {
        k: v.shape for k, v in llama.state_dict().items()}


def test_build_from_config_dict_or_file(tmp_path):
    m = hf.build_from_config(TINY)
    assert type(m).__name__ == "LlamaForCausalLM" and m.config.hidden_size == 32
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, "architectures": ["LlamaForSequenceClassification"]}))
    c = hf.build_from_config(str(path))
    assert type(c).__name__ == "LlamaForSequenceClassification"


@pytest.mark.parametrize(("make", "expected"), [
    (lambda p: p / "missing", "no such directory"),
    (lambda p: p, "has no config.json"),
    (lambda p: (p / "f.txt").write_text("x") and p / "f.txt", "is not a directory"),
])
def test_bad_model_path_is_one_line(make, expected, tmp_path):
    with pytest.raises(UsageError) as e:
        hf.load_pretrained(make(tmp_path))
    assert expected in str(e.value) and "model.path=" in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_config_is_one_line(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        hf.build_from_config(str(tmp_path / "nope.json"))
    with pytest.raises(UsageError, match="model_type"):
        hf.build_from_config({"hidden_size": 8})


def hf_batches(tokenizer, text: str, n: int = 3, length: int = 24):
    """A DataLoader of tokenizer outputs: dict batches with input_ids and attention_mask."""
    pieces = [text[i * 200 : i * 200 + 200] for i in range(n * 2)]
    enc = tokenizer(pieces, truncation=True, max_length=length, padding="max_length",
                    return_tensors="pt") if tokenizer.pad_token else None
    if enc is None:
        tokenizer.pad_token = tokenizer.eos_token
        enc = tokenizer(pieces, truncation=True, max_length=length, padding="max_length",
                        return_tensors="pt")
    rows = [{k: v[i] for k, v in enc.items()} for i in range(len(pieces))]
    return torch.utils.data.DataLoader(rows, batch_size=2)


@pytest.mark.parametrize("criterion", ["wanda", "sparsegpt"])
@pytest.mark.parametrize("name", ["llama", "bert"])
def test_prune_save_load_with_hf_batches(name, criterion, hf_dirs, tmp_path):
    model = hf.load_pretrained(hf_dirs[name])
    tok = transformers.AutoTokenizer.from_pretrained(hf_dirs[name], local_files_only=True)
    loader = hf_batches(tok, hf_dirs["text"].read_text())
    head = dict(model.named_modules())[
        "lm_head" if name == "llama" else "cls.predictions.decoder"].weight.detach().clone()
    report = sk.prune_(model, pattern="2:4", criterion=criterion, exclude=[HEAD],
                       calibration=loader)
    assert report.global_sparsity == 0.5 and not report.skipped
    for lname, layer in select_modules(model, exclude=[HEAD]).items():
        groups = layer.weight.reshape(layer.weight.shape[0], -1, 4)
        assert (groups != 0).sum(-1).le(2).all(), lname
    out_head = model.get_output_embeddings().weight
    assert torch.equal(out_head, head)  # the LM head is untouched
    path = tmp_path / "m.safetensors"
    sk.save(model, path)
    batch = next(iter(loader))
    model.eval()
    want = model(**batch).logits
    rebuilt = sk.load(path).eval()  # from the stored config, through the allow-listed builder
    torch.testing.assert_close(rebuilt(**batch).logits, want, rtol=0, atol=0)
    cls = transformers.AutoModelForCausalLM if name == "llama" else \
        transformers.AutoModelForMaskedLM
    given = sk.load(path, model=cls.from_config(model.config)).eval()
    torch.testing.assert_close(given(**batch).logits, want, rtol=0, atol=0)


def test_sequential_sparsegpt_equals_whole_model_passes(hf_dirs, monkeypatch):
    model = hf.load_pretrained(hf_dirs["llama"])
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    twin = copy.deepcopy(model)
    batches = [torch.randint(0, 300, (2, 16)) for _ in range(3)]
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    mods = select_modules(model, exclude=[HEAD])
    seq = sparsegpt.sparsegpt_prune(model, mods, {}, (2, 4), batches)
    # one pass for the call order, one recording every block's inputs: not one per layer group
    assert len(calls) == 1 + len(batches)
    monkeypatch.setattr(sparsegpt, "find_blocks", lambda *a: None)
    twin_mods = select_modules(twin, exclude=[HEAD])
    full = sparsegpt.sparsegpt_prune(twin, twin_mods, {}, (2, 4), batches)
    for k in seq:
        assert torch.equal(seq[k], full[k]), k
        torch.testing.assert_close(mods[k].weight, twin_mods[k].weight, rtol=0, atol=1e-6)


def test_find_blocks_picks_the_decoder_layers(hf_dirs):
    model = hf.load_pretrained(hf_dirs["llama"])
    prefix, blocks = sparsegpt.find_blocks(model, select_modules(model, exclude=[HEAD]))
    assert prefix == "model.layers." and blocks is model.model.layers


def test_export_of_a_quantized_model_loads_with_from_pretrained(hf_dirs, tmp_path):
    model = hf.load_pretrained(hf_dirs["llama"])
    sk.prune_(model, pattern="2:4", exclude=[HEAD])
    sk.quantize_(model, "int8_weight_only", exclude=[HEAD])
    out = hf.export_pretrained(model, tmp_path / "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    q = model.model.layers[0].mlp.down_proj
    torch.testing.assert_close(back.model.layers[0].mlp.down_proj.weight,
                               q.dequantized_weight(torch.float32), rtol=0, atol=0)
    assert (back.model.layers[0].mlp.down_proj.weight == 0).float().mean() == 0.5


def test_without_transformers_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    with pytest.raises(UsageError, match=r"pip install 'sparsekit\[hf\]'"):
        hf.build_from_config(TINY)
