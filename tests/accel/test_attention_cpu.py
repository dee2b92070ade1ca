"""Decode attention (sparsekit.accel.kernels.attention.decode): the reference against float64
attention over
repeated kv heads, the Triton kernels under Triton's interpreter against the reference, the op,
the HF attention function and generate's switch to it."""


import pytest
import torch
from interpreted import run_interpreted

import sparsekit as sk
from sparsekit.accel.kernels.attention import op as attn_op
from sparsekit.accel import generate
from sparsekit.accel.kernels import switches
from sparsekit.accel.kernels.attention import decode as attention


def _inputs(b, h, kvh, length, d, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, 1, d, generator=g).to(dtype)
    k = torch.randn(b, kvh, length, d, generator=g).to(dtype)
    v = torch.randn(b, kvh, length, d, generator=g).to(dtype)
    return q, k, v


def _float64(q, k, v, mask, scale):
    """Attention the plain way: kv heads repeated per query head (HF's repeat_kv), float64."""
    b, h, _, d = q.shape
    rep = h // k.shape[1]
    kk = k.double().repeat_interleave(rep, 1)
    vv = v.double().repeat_interleave(rep, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale  # (b, h, 1, L)
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    out = torch.softmax(s, -1) @ vv                  # (b, h, 1, d)
    return out.transpose(1, 2)


def test_reference_is_grouped_query_attention():
    q, k, v = _inputs(3, 8, 2, 40, 32)
    mask = torch.ones(3, 40, dtype=torch.bool)
    mask[1, :7] = False   # left padding
    mask[2, 30:] = False  # an unfilled cache tail
    for m in (mask, None, mask[:1]):
        got = attention.reference(q, k, v, m, 0.2)
        want = _float64(q, k, v, None if m is None else m.expand(3, 40), 0.2)
        assert got.shape == (3, 1, 8, 32) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)
    # a sequence with no position to attend gets zeros, not NaN
    none = torch.zeros(3, 40, dtype=torch.bool)
    assert torch.equal(attention.reference(q, k, v, none, 0.2), torch.zeros(3, 1, 8, 32).bfloat16())


def test_check_names_what_is_allowed():
    q, k, v = _inputs(2, 8, 2, 64, 64)
    assert attention.check(q, k, v, None) is None
    assert "one query token" in attention.check(q.expand(2, 8, 2, 64), k, v, None)
    assert "multiple of KVH" in attention.check(q, k[:, :1].expand(2, 3, 64, 64), v[:, :1]
                                                .expand(2, 3, 64, 64), None)
    assert "head dim" in attention.check(*_inputs(1, 2, 1, 8, 48), None)
    assert "share one of" in attention.check(q.float(), k.float(), v.float(), None)
    assert "mask" in attention.check(q, k, v, torch.ones(2, 63, dtype=torch.bool))
    assert "mask" in attention.check(q, k, v, torch.zeros(2, 64))
    assert "contiguous along L" in attention.check(
        q, k, v, torch.ones(2, 128, dtype=torch.bool)[:, ::2])
    assert "at most 16" in attention.check(*_inputs(1, 32, 1, 8, 16), None)
    with pytest.raises(ValueError, match="decode_attention: head dim"):
        attention.launch(*_inputs(1, 2, 1, 8, 48), None, 1.0)


def test_splits_fill_the_gpu_and_cover_the_positions():
    assert attention.splits(8, 1024, 132) == 16    # batch 1, 8 kv heads: one block each
    assert attention.splits(128, 1024, 132) == 3   # batch 16
    assert attention.splits(1024, 1024, 132) == 1
    assert attention.splits(1, 10, 132) == 1


def test_op_opcheck_and_reference_on_cpu():
    q, k, v = _inputs(2, 4, 2, 70, 16)
    mask = torch.ones(2, 70, dtype=torch.bool)
    mask[0, 50:] = False
    got = attn_op.decode_attention(q, k, v, mask, 0.25)
    assert torch.equal(got, attention.reference(q, k, v, mask, 0.25))
    torch.library.opcheck(attn_op.decode_attention, (q, k, v, mask, 0.25))
    torch.library.opcheck(attn_op.decode_attention, (q, k, v, None, 0.25))


_INTERPRETED = r"""
import torch
from sparsekit.accel.kernels.attention import decode as attention
from tests.accel.test_attention_cpu import _inputs
# GQA groups 1, 4, 8 (Llama-3-8B's 4), head dims 32 to 128, lengths that are and are not
# whole blocks, one split and several, masks per sequence and broadcast, left padding and an
# unfilled tail, a sequence with nothing to attend; bf16 and fp16
cases = ((1, 8, 2, 200, 64, "pad"), (3, 4, 4, 130, 32, "pad"), (2, 16, 2, 64, 128, None),
         (2, 8, 1, 300, 64, "one"), (1, 4, 1, 1024, 32, "tail"))
for i, (b, h, kvh, length, d, kind) in enumerate(cases):
    dtype = torch.float16 if i == 3 else torch.bfloat16
    q, k, v = _inputs(b, h, kvh, length, d, seed=i, dtype=dtype)
    mask = None
    if kind == "pad":
        mask = torch.zeros(b, length, dtype=torch.bool)
        for j in range(b):
            mask[j, 3 * j:length - 70 + j] = True
        if b == 3:
            mask[2] = False
    elif kind == "one":
        mask = torch.ones(1, length, dtype=torch.bool)
        mask[0, 250:] = False
    elif kind == "tail":
        mask = torch.zeros(b, length, dtype=torch.bool)
        mask[:, :17] = True
    # a strided cache view, as a static cache slot is
    k = torch.cat([k, k], 2)[:, :, :length]
    got = attention.launch(q, k, v, mask, d ** -0.5)
    want = attention.reference(q, k, v, mask, d ** -0.5)
    assert got.shape == want.shape and got.dtype == dtype
    err = (got.float() - want.float()).abs().max().item()
    assert err < 1e-2, (i, err)
    assert not got.isnan().any()
print("ok")
"""


def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRETED)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _llama(attn: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # head dim 16: the smallest the kernel takes
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=2, max_position_embeddings=256,
                                   attn_implementation=attn)
    return transformers.LlamaForCausalLM(cfg).eval().to(torch.bfloat16)


def test_hf_attention_function_matches_sdpa_in_a_static_cache_decode():
    transformers = pytest.importorskip("transformers")
    name = attention.register()
    ref = _llama("sdpa")
    model = _llama("sdpa")
    model.config._attn_implementation = name
    calls = []
    real = attention.decode_attention
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the decode mask is per sequence
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "decode_attention", lambda *a: calls.append(a) or real(*a))
        outs = []
        for m in (model, ref):
            cache = transformers.StaticCache(config=m.config, max_cache_len=64)
            outs.append(m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                   pad_token_id=0, past_key_values=cache))
    assert torch.equal(outs[0], outs[1])
    # every decode step of every layer ran on the op (5 steps x 2 layers), the prefill on sdpa
    assert len(calls) == 10 and all(c[0].shape[2] == 1 for c in calls)
    assert all(c[3] is not None and c[3].shape == (2, 64) for c in calls)
    # and a decode step's logits agree with sdpa's
    logits = []
    for m in (model, ref):
        cache = transformers.StaticCache(config=m.config, max_cache_len=64)
        with torch.no_grad():
            m(ids, attention_mask=mask, past_key_values=cache)
            step = m(ids[:, -1:], attention_mask=torch.cat([mask, mask[:, -1:]], 1),
                     past_key_values=cache, cache_position=torch.tensor([9]))
        logits.append(step.logits.float())
    torch.testing.assert_close(logits[0], logits[1], atol=2e-2, rtol=2e-2)


def test_generate_switches_attention_on_cuda_only(monkeypatch):
    pytest.importorskip("transformers")
    model = _llama("sdpa")
    assert generate.attention_for(model, torch.device("cpu")) is None
    assert generate.attention_for(model, torch.device("cuda")) == attention.NAME
    assert generate.attention_for(_llama("eager"), torch.device("cuda")) is None
    with switches.using(sk.PlanOptions(decode_attention=False).switches()):
        assert generate.attention_for(model, torch.device("cuda")) is None
    assert generate.attention_for(model, torch.device("cuda")) == attention.NAME

    def old_transformers():
        raise ImportError("cannot import name 'AttentionMaskInterface'")
    monkeypatch.setattr(attention, "register", old_transformers)
    assert generate.attention_for(model, torch.device("cuda")) is None


@pytest.mark.slow  # a whole generate; the attention function's decode: the test above
def test_accelerated_generate_on_the_decode_attention_equals_hf(monkeypatch):
    # as on CUDA: generate switches the model to sparsekit's attention (here its CPU
    # reference) for the call, and back after it
    monkeypatch.setattr(generate, "attention_for", lambda model, device: attention.register())
    model = _llama("sdpa")
    ref = _llama("sdpa")
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    fast = sk.accelerate(model, {"input_ids": ids}, device="cpu",
                         compile=sk.CompileOptions(backend="eager"))
    calls = []
    real = attention.decode_attention
    monkeypatch.setattr(attention, "decode_attention", lambda *a: calls.append(1) or real(*a))
    out = fast.generate(ids, max_new_tokens=5)
    want = ref.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out, want)
    assert calls and fast.model.config._attn_implementation == "sdpa"
    assert any("decode attention" in n for n in fast.report.notes)
