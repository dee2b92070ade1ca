import logging
import os

import pytest
import torch

from sparsekit.io.cache import cache_root

# 2 CPU cores in CI: one intra-op thread per test process keeps runs predictable.
torch.set_num_threads(int(os.environ.get("SPARSEKIT_TEST_THREADS", "1")))

# ``pytest -n 2`` (pytest-xdist, the README's test command): one worker per core, so the
# processes a test starts (CLI runs, tools, torchrun ranks) take one thread each too, and each
# worker caches in its own directory (no two workers write the same cache file).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["SPARSEKIT_CACHE"] = str(cache_root() / f"pytest-{_WORKER}")


def pytest_collection_modifyitems(items):
    """Tests marked ``slow`` first (in their collected order), for the runs that include them
    (``-m slow``, ``-m ""``; the default leaves them out). The README's ``-n 2 --dist loadfile
    --no-loadscope-reorder`` hands each worker a whole file at a time (a module fixture is
    built once), the files in this order: those with long tests start first, and the short
    ones fill both workers at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _run_log_off():
    """A CLI run in this process (Hydra) leaves the ``sparsekit`` loggers at INFO with handlers
    on that test's captured stderr: silent again after each test."""
    yield
    for name in ("sparsekit", "sparsekit.file"):
        logging.getLogger(name).setLevel(logging.NOTSET)


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """A tiny Llama (causal LM, byte-level BPE tokenizer) and a tiny BERT (masked LM, WordPiece
    tokenizer), built from configs and saved with tokenizers trained here on 40 KB of the Python
    standard library's source, plus that text: ``{"llama": dir, "bert": dir, "text": file}``."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from sparsekit.data.text import read_stdlib_source

    root = tmp_path_factory.mktemp("hf")
    text = read_stdlib_source(40_000).decode("utf-8", "replace")
    (root / "corpus.txt").write_text(text)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    llama_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.train_from_iterator([text], trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
        show_progress=False))
    bert_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=wordpiece, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(llama_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=len(bert_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128))
    out = {"text": root / "corpus.txt"}
    for name, model, tok in (("llama", llama, llama_tok), ("bert", bert, bert_tok)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture
def no_network(monkeypatch):
    """Any network attempt fails the test: connecting a socket (TCP, UDP, Unix: Python's
    socket layer, which urllib, requests, httpx and huggingface_hub all go through) or looking
    up a host name. For tests that read files: reading a file never reaches the network."""
    import socket

    def refuse(*args, **kwargs):
        pytest.fail(f"network access while reading files: {args[1:] or args}")

    for name in ("connect", "connect_ex", "sendto"):
        monkeypatch.setattr(socket.socket, name, refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
