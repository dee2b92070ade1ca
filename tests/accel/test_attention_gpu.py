"""Decode attention on a CUDA GPU (skipped without one): the Triton kernels against the float32
reference on Llama-3-8B heads, under CUDA-graph capture, and inside an accelerated generate."""

import pytest
import torch

import sparsekit as sk
from sparsekit.accel.kernels.attention import op as attn_op
from sparsekit.accel.kernels.attention import decode as attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("batch,length", [(1, 1024), (16, 1024), (3, 2048)])
def test_kernel_equals_reference(batch, length):
    g = torch.Generator().manual_seed(batch)
    q = torch.randn(batch, 32, 1, 128, generator=g).cuda().bfloat16()
    k, v = torch.randn(2, batch, 8, length, 128, generator=g).cuda().bfloat16()
    mask = torch.zeros(batch, length, dtype=torch.bool, device="cuda")
    mask[:, : length * 3 // 4] = True
    mask[0, :7] = False
    got = attn_op.decode_attention(q, k, v, mask, 128 ** -0.5)
    want = attention.reference(q, k, v, mask, 128 ** -0.5)
    assert (got.float() - want.float()).abs().max().item() < 1e-2
    # captured in a CUDA graph, replayed with a mask that changed in place
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn_op.decode_attention(q, k, v, mask, 128 ** -0.5)
    mask[:, : length // 2] = False
    graph.replay()
    want = attention.reference(q, k, v, mask, 128 ** -0.5)
    assert (out.float() - want.float()).abs().max().item() < 1e-2


def test_hf_decode_step_on_it_matches_sdpa_and_generate_uses_it():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024,
                                   num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).eval().to("cuda", torch.bfloat16)
    ids = torch.randint(0, 256, (2, 11), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    logits = []
    for name in (attention.register(), "sdpa"):  # one decode step after the same prefill
        model.config._attn_implementation = name
        cache = transformers.StaticCache(config=cfg, max_cache_len=64)
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache)
            step = model(ids[:, -1:], attention_mask=torch.cat([mask, mask[:, -1:]], 1),
                         past_key_values=cache, cache_position=torch.tensor([11], device="cuda"))
        logits.append(step.logits.float())
    err = (logits[0] - logits[1]).abs().max().item()
    assert err < 2e-2 * logits[1].abs().max().item()
    fast = sk.accelerate(model, {"input_ids": ids}, device="cuda")
    assert any("decode attention" in n for n in fast.report.notes)
    out = fast.generate(ids, max_new_tokens=8)
    assert out.shape == (2, 19) and torch.equal(out[:, :11], ids)
    assert fast.model.config._attn_implementation == "sdpa"
