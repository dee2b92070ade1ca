"""sparsekit's own generate loop on a CUDA GPU (skipped without one): a left-padded batch with
its attention mask against HF's generate of the same masked model, and sampling drawn from
the caller's CUDA generator (the CPU tests, tests/accel/test_generate_cpu.py, check every
option against HF's tokens)."""

import pytest
import torch

import sparsekit as sk
from test_decode_cpu import _tiny_llama

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_left_padded_batch_and_sampling_with_a_cuda_generator():
    model, ref = _tiny_llama()
    ids = torch.randint(3, 256, (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :9] = 0
    ids = ids.masked_fill(mask == 0, 0)
    fast = sk.accelerate(model, {"input_ids": ids, "attention_mask": mask})
    # min_new_tokens: every row runs 12 steps (no end-of-sequence token before)
    out = fast.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                        pad_token_id=0).cpu()
    want = ref.cuda().generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=12,
                               min_new_tokens=12, do_sample=False, pad_token_id=0).cpu()
    # bf16 on other kernels than HF's: greedy tokens agree while the logits' margins exceed
    # the rounding differences (as test_decode_gpu's)
    assert out.shape == want.shape and torch.equal(out[:, :11], ids)
    assert (out == want).float().mean() > 0.9

    def draw(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return fast.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                             do_sample=True, top_p=0.9, temperature=1.5, generator=g).cpu()

    a, b, c = draw(7), draw(7), draw(8)
    assert torch.equal(a, b) and not torch.equal(a, c) and a.shape == (3, 11 + 12)
    with pytest.raises(ValueError, match="generator is on cpu"):
        fast.generate(ids, max_new_tokens=2, do_sample=True, generator=torch.Generator())
