"""GGUF files as model sources: a tiny Llama written here with gguf.GGUFWriter (llama.cpp's
tensor names and q/k row order, its BPE tokenizer, some tensors quantized) loads as the
transformers model it was written from (config, tensors, logits, tokenizer), from the file or
from a directory holding it, offline; several GGUF files in one directory are refused in one
line; ``model=hf model.path=FILE.gguf`` runs a recipe from the command line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sparsekit.errors import UsageError

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers reads GGUF only with accelerate installed
from sparsekit.models import hf  # noqa: E402
from test_cli import run_cli  # noqa: E402

# transformers name -> llama.cpp name, per block and for the rest
BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}
# quantized in the file: llama.cpp's 4-bit (Q4_1: a scale and a minimum per 32 inputs) and
# 8-bit (Q8_0) blocks; every other tensor is float32
QUANTIZED = {"blk.0.ffn_down.weight": gguf.GGMLQuantizationType.Q4_1,
             "blk.1.attn_output.weight": gguf.GGMLQuantizationType.Q8_0}


def llama_cpp_order(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for q_proj/k_proj (its convert_hf_to_gguf ``permute``): the two
    rotary halves of each head interleaved."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(model, tokenizer, path, quantized=None) -> dict[str, np.ndarray]:
    """``model`` (a transformers Llama) and its byte-level BPE ``tokenizer`` as llama.cpp writes
    them; returns the float32 weights under transformers' names as the file holds them (the
    quantized ones dequantized by gguf's own reference)."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_unk_token_id(tokenizer.unk_token_id)
    names = dict(TOP)
    for i in range(c.num_hidden_layers):
        names.update({f"model.layers.{i}.{k}.weight": f"blk.{i}.{v}.weight"
                      for k, v in BLOCK.items()})
    held = {}
    for key, name in names.items():
        t = model.state_dict()[key].float().numpy()
        if "q_proj" in key or "k_proj" in key:
            heads = c.num_attention_heads if "q_proj" in key else c.num_key_value_heads
            t = llama_cpp_order(t, heads)
        qtype = (quantized or {}).get(name)
        if qtype is None:
            w.add_tensor(name, t)
            stored = t
        else:
            blocks = gguf.quants.quantize(t, qtype)
            w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
            stored = gguf.quants.dequantize(blocks, qtype).reshape(t.shape)
        if "q_proj" in key or "k_proj" in key:  # back to transformers' row order
            stored = stored.reshape(heads, stored.shape[0] // heads // 2, 2, -1).swapaxes(1, 2)
            stored = stored.reshape(t.shape)
        held[key] = stored
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.fixture(scope="module")
def tiny_gguf(hf_dirs, tmp_path_factory):
    """``{"dir": a directory holding one GGUF file, "file": it, "model": the transformers
    model it was written from, "tokenizer": its tokenizer, "held": the weights the file holds}``"""
    root = tmp_path_factory.mktemp("gguf")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs["llama"]).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dirs["llama"])
    held = write_gguf(model, tokenizer, root / "tiny.Q4_1.gguf", QUANTIZED)
    return {"dir": root, "file": root / "tiny.Q4_1.gguf", "model": model,
            "tokenizer": tokenizer, "held": held}


def test_gguf_loads_as_the_model_it_describes(tiny_gguf, no_network):
    ref = tiny_gguf["model"]
    for source in (tiny_gguf["file"], tiny_gguf["dir"]):
        m = hf.load_pretrained(source).eval()
        assert type(m).__name__ == "LlamaForCausalLM"
        assert m._sparsekit_spec["kwargs"]["task"] == "causal_lm"
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "vocab_size"):
            assert getattr(m.config, key) == getattr(ref.config, key), key
        assert getattr(m.config, "quantization_config", None) is None  # a plain float model
        state = m.state_dict()
        assert set(state) == set(tiny_gguf["held"])
        for key, value in tiny_gguf["held"].items():  # float tensors exact, quantized ones
            assert state[key].dtype == torch.float32  # equal to gguf's dequantization
            torch.testing.assert_close(state[key], torch.from_numpy(value), rtol=0, atol=0,
                                       msg=key)
    # the file's logits are those of the transformers model holding the same weights
    same = transformers.LlamaForCausalLM(ref.config).eval()
    same.load_state_dict({k: torch.from_numpy(v) for k, v in tiny_gguf["held"].items()})
    ids = torch.randint(0, ref.config.vocab_size, (2, 24),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, same(ids).logits, rtol=1e-5, atol=1e-5)
        # and the quantization only perturbs them: the two float layers' rows are exact
        assert (m(ids).logits - ref(ids).logits).abs().max() < 0.5
    # the stored spec rebuilds the architecture (sk.save / sk.load), without the GGUF state
    again = hf.hf(**m._sparsekit_spec["kwargs"])
    assert {k: v.shape for k, v in again.state_dict().items()} == {
        k: v.shape for k, v in state.items()}


def test_gguf_tokenizer_encodes_as_the_original(tiny_gguf, hf_dirs, no_network):
    text = hf_dirs["text"].read_text()[:2000]
    for source in (tiny_gguf["file"], tiny_gguf["dir"]):
        tok = hf.load_tokenizer(source)
        assert tok(text).input_ids == tiny_gguf["tokenizer"](text).input_ids
        assert tok.eos_token == tiny_gguf["tokenizer"].eos_token


def test_gguf_model_exports_as_a_transformers_directory(tiny_gguf, tmp_path):
    m = hf.load_pretrained(tiny_gguf["file"]).eval()
    out = hf.export_pretrained(m, tmp_path / "hf", hf.load_tokenizer(tiny_gguf["file"]))
    back = hf.load_pretrained(out).eval()
    ids = torch.randint(0, m.config.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, m(ids).logits, rtol=0, atol=0)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_directory_with_several_gguf_files_is_refused_in_one_line(tiny_gguf, tmp_path):
    for name in ("a.Q4_1.gguf", "b.Q8_0.gguf"):
        (tmp_path / name).write_bytes(tiny_gguf["file"].read_bytes())
    for call in (hf.load_pretrained, hf.load_tokenizer, hf.check_model_dir):
        with pytest.raises(UsageError) as e:
            call(tmp_path)
        msg = str(e.value)
        assert "\n" not in msg and "model.path=" in msg
        assert "2 GGUF files (a.Q4_1.gguf, b.Q8_0.gguf)" in msg, msg
    # naming one of them is enough
    assert hf.check_model_dir(tmp_path / "b.Q8_0.gguf") == tmp_path / "b.Q8_0.gguf"


def test_a_config_json_beside_a_gguf_file_wins(tiny_gguf, hf_dirs, tmp_path):
    import shutil

    shutil.copytree(hf_dirs["llama"], tmp_path / "m")
    shutil.copy(tiny_gguf["file"], tmp_path / "m")
    assert hf.model_source(tmp_path / "m") == (tmp_path / "m", None)
    assert hf.model_source(tmp_path / "m" / tiny_gguf["file"].name) == (
        tmp_path / "m", tiny_gguf["file"].name)


def test_cli_runs_a_recipe_on_a_gguf_file(tiny_gguf, hf_dirs, tmp_path, capsys):
    code, _, err = run_cli(["recipe=llm_sparsegpt_24", f"model.path={tiny_gguf['file']}",
                            f"data.path={hf_dirs['text']}", f"cache_dir={tmp_path / 'c'}",
                            "data.seq_len=32", "prune.calibration_batches=2",
                            "data.eval_batches=2", "data.batch_size=4", "train.quiet=true",
                            "tracker=none"], tmp_path, capsys)
    assert code == 0, err
    (run_dir,) = (tmp_path / "runs").iterdir()
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["sparsity"] == 0.5 and 30 < s["dense"]["perplexity"] < 3000
    back = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf",
                                                            local_files_only=True)
    assert back.config.hidden_size == tiny_gguf["model"].config.hidden_size


def test_data_tokenizer_may_name_a_gguf_file(tiny_gguf, tmp_path):
    from sparsekit.run.config import Config
    from sparsekit.run.loading import check_input_paths

    cfg = Config()
    cfg.data.tokenizer = str(tiny_gguf["file"])
    check_input_paths(cfg, complete=False)  # a .gguf file is a tokenizer source
    other = tmp_path / "vocab.bin"
    other.write_bytes(b"x")
    cfg.data.tokenizer = str(other)
    with pytest.raises(UsageError, match="or a .gguf file"):
        check_input_paths(cfg, complete=False)
    tok = hf.load_tokenizer(tiny_gguf["file"], "data.tokenizer")
    assert tok("def the(x):").input_ids == tiny_gguf["tokenizer"]("def the(x):").input_ids
