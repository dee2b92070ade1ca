"""Teacher-sampled (data-free) text: reproducible under a seed, greedy equal to a no-cache argmax
loop, nucleus truncation against a float64 reference, the mix fraction, the disk cache."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import sparsekit as sk
from sparsekit.data.bundle import DataBundle
from sparsekit.data.teacher import (
    MixedWindows,
    TeacherWindows,
    cache_path,
    mix_bundle,
    model_fingerprint,
    next_tokens,
    teacher_samples,
    top_p_filter,
)

transformers = pytest.importorskip("transformers")
VOCAB = 64


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config).eval()


def test_same_seed_same_samples_other_seed_other_samples(llama):
    a = sk.teacher_samples(llama, 5, 12, seed=3, batch_size=2, first_tokens=2)
    b = sk.teacher_samples(llama, 5, 12, seed=3, batch_size=2, first_tokens=2)
    c = sk.teacher_samples(llama, 5, 12, seed=4, batch_size=2, first_tokens=2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (5, 12) and a.dtype == torch.int64 and a.device.type == "cpu"
    assert (a[:, 0] == 1).all()  # every row starts at BOS
    assert a.min() >= 0 and a.max() < VOCAB
    assert len({tuple(r) for r in a[:, :4].tolist()}) == 5  # the rows differ
    assert not llama.training  # eval mode kept, and restored when it was training
    llama.train()
    sk.teacher_samples(llama, 1, 4)
    assert llama.training
    llama.eval()


def test_greedy_is_the_argmax_continuation_of_a_no_cache_loop(llama):
    got = teacher_samples(llama, 3, 16, temperature=0, batch_size=2)
    ids = torch.tensor([[1]])
    with torch.no_grad():
        for _ in range(15):  # the reference: the whole prefix through the model every step
            ids = torch.cat([ids, llama(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, ids.expand(3, -1))


def test_first_tokens_vary_before_greedy(llama):
    got = teacher_samples(llama, 6, 10, temperature=0, first_tokens=2, seed=1)
    assert len({tuple(r) for r in got[:, 1:3].tolist()}) > 1
    with torch.no_grad():  # after the free tokens each row is its own greedy continuation
        for row in got:
            logits = llama(row[None, :-1]).logits[0, 2:]
            assert torch.equal(logits.argmax(-1), row[3:])


def _nucleus_reference(logits: torch.Tensor, top_p: float) -> set[int]:
    """The smallest set of most probable tokens whose probability reaches top_p (float64)."""
    p = logits.double().softmax(-1).tolist()
    kept, mass = set(), 0.0
    for i in sorted(range(len(p)), key=lambda i: -p[i]):
        kept.add(i)
        mass += p[i]
        if mass >= top_p:
            break
    return kept


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.9, 0.999])
def test_top_p_filter_keeps_the_reference_nucleus(top_p):
    logits = torch.randn(8, 50) * 3
    kept = ~top_p_filter(logits, top_p).isinf()
    for row, mask in zip(logits, kept):
        assert set(mask.nonzero().flatten().tolist()) == _nucleus_reference(row, top_p)
    assert torch.equal(top_p_filter(logits, 1.0), logits)


def test_sampling_stays_in_the_nucleus_at_its_probabilities():
    logits = torch.randn(1, 20) * 2
    nucleus = _nucleus_reference(logits[0] / 0.7, 0.8)
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([next_tokens(logits.expand(500, -1), 0.7, 0.8, g) for _ in range(8)])
    assert set(draws.tolist()) == nucleus
    p = (logits[0].double() / 0.7).softmax(-1)
    idx = torch.tensor(sorted(nucleus))
    want = p[idx] / p[idx].sum()
    freq = torch.bincount(draws, minlength=20)[idx].double() / len(draws)
    assert (freq - want).abs().max() < 4 * math.sqrt(0.25 / len(draws))


def test_bad_arguments_are_one_clear_error(llama):
    with pytest.raises(ValueError, match="top_p=0 must be a number in"):
        teacher_samples(llama, 2, 8, top_p=0)
    with pytest.raises(ValueError, match="seq_len=1 must be an integer >= 2"):
        teacher_samples(llama, 2, 1)
    with pytest.raises(ValueError, match="seq_len=65 is longer than the model's max_position"):
        teacher_samples(llama, 2, 65)
    with pytest.raises(TypeError, match="need a causal LM"):
        teacher_samples(torch.nn.Linear(4, 4), 2, 8, start=0)


def test_mixed_windows_honour_the_fraction_in_every_prefix():
    user = TeacherWindows(torch.zeros(7, 5, dtype=torch.long))
    teacher = TeacherWindows(torch.ones(3, 5, dtype=torch.long))
    for mix in (0.1, 0.25, 0.3, 0.5, 0.9):
        mixed = MixedWindows(user, teacher, mix)
        flags = [int(mixed[i][0][0]) for i in range(len(mixed))]
        for k in range(1, len(mixed) + 1):
            assert sum(flags[:k]) == math.floor(k * mix + 1e-9), (mix, k)
        assert sum(flags) >= 3 and len(flags) - sum(flags) >= 7  # every window shown
    with pytest.raises(ValueError, match="mix=1"):
        MixedWindows(user, teacher, 1)


def test_mix_bundle_keeps_teacher_text_out_of_evaluation():
    stream = lambda v, n: TeacherWindows(torch.full((n, 9), v))  # noqa: E731
    text = DataBundle(train=stream(0, 20), eval=stream(5, 4), calibration=stream(0, 6))
    tokens = torch.full((8, 9), 7)
    mixed = mix_bundle(text, tokens, 0.5)
    assert all(int(mixed.eval[i][0][0]) == 5 for i in range(len(mixed.eval)))
    train = [int(mixed.train[i][0][0]) for i in range(len(mixed.train))]
    assert train.count(7) == len(train) // 2 and train[:4] == [0, 7, 0, 7]
    assert int(mixed.calibration[1][0][0]) == 7 and mixed.info["teacher"]["mix"] == 0.5
    free = mix_bundle(None, tokens, 1.0, eval_set=stream(5, 3))
    assert len(free.train) == len(free.calibration) == 8 and len(free.eval) == 3
    x, y = free.train[0]
    assert x.shape == y.shape == (8,)
    with pytest.raises(ValueError, match="give data.path"):
        mix_bundle(None, tokens, 0.5, eval_set=stream(5, 3))
    with pytest.raises(ValueError, match="nothing to evaluate"):
        mix_bundle(None, tokens, 1.0)


def test_cache_round_trip_and_key(llama, tmp_path, monkeypatch):
    calls = []
    first = teacher_samples(llama, 4, 10, seed=2, cache_dir=tmp_path,
                            on_progress=lambda d, n: calls.append((d, n)))
    assert calls == [(4, 4)]  # one batch of 16 or fewer
    (path,) = tmp_path.glob("teacher_samples_*.safetensors")
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:  # a plain safetensors file: no pickle
        assert list(f.keys()) == ["tokens"] and '"seed": 2' in f.metadata()["settings"]
    monkeypatch.setattr("sparsekit.data.teacher.sample_batch", None)  # sampling would fail
    again = teacher_samples(llama, 4, 10, seed=2, cache_dir=tmp_path)
    assert torch.equal(first, again)
    monkeypatch.undo()
    settings = dict(n=4, seq_len=10, seed=2, temperature=1.0, top_p=0.95, first_tokens=0,
                    batch_size=16)
    assert cache_path(llama, settings, tmp_path) == path
    assert cache_path(llama, {**settings, "seed": 3}, tmp_path) != path
    assert cache_path(llama, {**settings, "top_p": 0.9}, tmp_path) != path
    other = transformers.LlamaForCausalLM(llama.config).eval()
    other.load_state_dict(llama.state_dict())
    assert model_fingerprint(other) == model_fingerprint(llama)  # the weights, not the object
    with torch.no_grad():
        other.lm_head.weight[0, 0] += 1e-3
    assert model_fingerprint(other) != model_fingerprint(llama)
    assert cache_path(other, settings, tmp_path) != path
    path.write_bytes(b"damaged")  # a damaged entry is sampled again and rewritten
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        third = teacher_samples(llama, 4, 10, seed=2, cache_dir=tmp_path)
    assert torch.equal(third, first) and any("unreadable" in str(x.message) for x in w)
    assert torch.equal(teacher_samples(llama, 4, 10, seed=2, cache_dir=tmp_path), first)



def test_progress_lines_count_the_samples(llama, caplog, monkeypatch):
    import logging

    from sparsekit.data.teacher import progress_callback

    monkeypatch.setattr("sparsekit.progress.QUIET_FIRST_S", 0.0)  # no 5 s of silence
    monkeypatch.delenv("SPARSEKIT_QUIET", raising=False)  # CI sets it
    caplog.set_level(logging.INFO, logger="sparsekit")
    teacher_samples(llama, 5, 6, batch_size=2, on_progress=progress_callback(5))
    lines = [r.getMessage() for r in caplog.records if "teacher samples" in r.getMessage()]
    assert lines and lines[-1].startswith("teacher samples: 5/5 (100%)")
    caplog.clear()
    teacher_samples(llama, 5, 6, batch_size=2, on_progress=progress_callback(5, quiet=True))
    assert not caplog.records


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_samples_are_reproducible_and_greedy_matches(llama):
    """On the GPU: in bf16 the generator lives on the model's device and the same seed gives
    the same tensor; greedy sampling over the KV cache equals the no-cache argmax loop."""
    model = transformers.LlamaForCausalLM(llama.config).eval()
    model.load_state_dict(llama.state_dict())
    model = model.cuda().to(torch.bfloat16)
    a = teacher_samples(model, 6, 24, seed=5, batch_size=4, first_tokens=2)
    b = teacher_samples(model, 6, 24, seed=5, batch_size=4, first_tokens=2)
    assert torch.equal(a, b) and a.device.type == "cpu" and a.shape == (6, 24)
    assert not torch.equal(a, teacher_samples(model, 6, 24, seed=6, batch_size=4, first_tokens=2))
    model = model.float()  # greedy against the no-cache loop in float32 (no bf16 near ties)
    got = teacher_samples(model, 1, 12, temperature=0)
    ids = torch.tensor([[1]], device="cuda")
    with torch.no_grad():
        for _ in range(11):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert got[0].tolist() == ids[0].cpu().tolist()
