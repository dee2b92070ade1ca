"""Shared by tools/bench_llm_recipe.py and tools/train_small_llama.py: a text corpus from the
Python standard library's source, a byte-level BPE tokenizer trained on it, a Llama config,
and one pass of a recipe through the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sparsekit.data.text import read_stdlib_source


def stdlib_corpus(path: Path, max_bytes: int) -> Path:
    """Up to ``max_bytes`` of stdlib source as one UTF-8 .txt file at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(read_stdlib_source(max_bytes).decode("utf-8", "replace"))
    return path


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``, EOS ``</s>``) trained on
    ``text``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def llama_config(vocab: int, hidden: int, layers: int, intermediate: int, heads: int,
                 kv_heads: int, max_len: int) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "max_position_embeddings": max_len,
            "tie_word_embeddings": False}


def llama3_8b_shapes(layers: int) -> dict:
    """``transformers.LlamaConfig`` keyword arguments of Llama-3-8B's shapes with ``layers``
    decoder blocks (the speed tools' model, built with random weights)."""
    return {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8,
            "max_position_embeddings": 8192, "rope_theta": 500000.0}


def random_llama(config: dict, device, dtype):
    """A ``LlamaForCausalLM`` of ``config`` (``LlamaConfig`` keyword arguments) with random
    weights (seed 0), built on ``device``, on SDPA attention, in ``dtype``, in eval mode."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(**config)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def run_recipe(args: list[str], run_dir: Path) -> dict:
    """``python -m sparsekit ARGS`` into ``run_dir``; its summary.json."""
    env = {**os.environ, "SPARSEKIT_QUIET": "1"}
    done = subprocess.run([sys.executable, "-m", "sparsekit", *args, f"hydra.run.dir={run_dir}"],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"sparsekit {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())
