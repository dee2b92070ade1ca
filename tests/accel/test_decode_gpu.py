"""The small-M 2:4 kernel and generate() on a CUDA GPU (skipped without one)."""

import dataclasses

import pytest
import torch

import sparsekit as sk
from sparsekit.accel.kernels.triton24 import op as sk24_op
from sparsekit.accel.kernels.triton24 import format as sk24
from test_decode_cpu import _tiny_llama, masked_24

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (100, 512)])
def test_widen_op_is_the_exact_widening(shape):
    # the weight-only fp8 prefill's one-pass Triton widening, bitwise, tails included
    w = masked_24(*shape).to("cuda", torch.float8_e4m3fn)
    values, meta = sk24.compress(w)
    assert torch.equal(sk24_op.sk24_widen(values, meta), w.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", [(4096, 4096), (1024, 4096), (4096, 14336), (100, 512)])
def test_kernel_equals_reference(dtype, shape):
    n, k = shape
    w = masked_24(n, k).to("cuda", dtype)
    values, meta = sk24.compress(w)
    assert torch.equal(sk24.decompress(values, meta).float(), w.float())
    for m in range(1, 33):
        x = torch.randn(m, k, device="cuda").to(dtype)
        xs = None if dtype == torch.bfloat16 else torch.rand(m, 1, device="cuda") + 0.5
        ws = None if dtype == torch.bfloat16 else torch.rand(n, device="cuda") + 0.5
        bias = torch.randn(n, device="cuda").bfloat16()
        y = sk24_op.sk24_mm(x, values, meta, xs, ws, bias).float()
        ref = sk24.reference(x, values, meta, xs, ws, bias).float()
        err = ((y - ref).norm() / ref.norm()).item()
        assert err < 5e-3, (m, err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_every_tensor_core_config_equals_reference(dtype):
    """Each tensor-core config the autotuner may pick (fp8 natively or through float16) against
    the reference, at M = 5 (padded to 16) and 17 (padded to 32)."""
    from sparsekit.accel.kernels.triton24 import kernel as sk24_triton

    n, k = 256, 4096
    values, meta = sk24.compress(masked_24(n, k).to("cuda", dtype))
    fp8 = dtype == torch.float8_e4m3fn
    for m in (5, 17):
        x = sk24.planes(torch.randn(m, k, device="cuda").to(dtype))
        xs = torch.rand(m, 1, device="cuda") + 0.5 if fp8 else None
        ws = torch.rand(n, device="cuda") + 0.5 if fp8 else None
        ref = sk24.reference(sk24.unplanes(x), values, meta, xs, ws, None).float()
        tried = 0
        for c in sk24_triton.configs():
            if c.kwargs["MODE"] != sk24_triton.DOT or not sk24_triton.fits(
                    c.kwargs, m, k, fp8, c.num_stages):
                continue
            cfg = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
            y = sk24.launch(x, values, meta, xs, ws, None, config=cfg).float()
            assert ((y - ref).norm() / ref.norm()).item() < 5e-3, (m, cfg)
            tried += 1
        assert tried >= 3


@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 14336)])
def test_kernel_takes_bf16_x_with_an_fp8_weight(shape):
    """The weight-only (W8A16) operand mix on the Triton kernel, autotuned, at every M: the e4m3
    values widened exactly, bf16 x as it is, per-channel scales after the sums."""
    n, k = shape
    values, meta = sk24.compress(masked_24(n, k).to("cuda", torch.float8_e4m3fn))
    ws = torch.rand(n, device="cuda") + 0.5
    for m in range(1, 33):
        x = torch.randn(m, k, device="cuda").bfloat16()
        y = sk24_op.sk24_mm(sk24.planes(x), values, meta, None, ws, None).float()
        ref = sk24.reference(x, values, meta, None, ws, None).float()
        assert ((y - ref).norm() / ref.norm()).item() < 5e-3, m


@pytest.mark.parametrize("variant", ["fp8_2:4", "fp8w_2:4"])
def test_fp8_layers_decode_on_either_kernel_with_prefill_numerics(variant):
    """Each fp8 2:4 layer the decode plan may move (W8A8 and W8A16): on the Triton kernel and,
    where the library takes it, on the mma.sp kernel, its decode equals its large-M path."""
    from torch import nn

    from sparsekit.accel.kernels.mma_sp import launch as sk24_mma
    from sparsekit.accel.layers import VARIANTS
    from sparsekit.accel.linear import LayerPlan, Route

    lin = nn.Linear(4096, 1024).cuda()
    with torch.no_grad():
        lin.weight.copy_(masked_24(1024, 4096).cuda())
    mod = VARIANTS[variant](lin)
    start, large = mod.plan.routes[0].kernel, mod.plan.routes[-1]
    for kernel in ["sk24"] + (["mma_sp"] if "mma_sp" in mod.choices["small"] else []):
        for m in (1, 7, 16, 32):
            x = torch.randn(m, 4096, device="cuda").bfloat16()
            mod.use(LayerPlan((Route(1, 32, kernel), large)), keep=True)
            y = mod(x).float()
            mod.use(LayerPlan((large,)), keep=True)
            ref = mod(x).float()
            assert ((y - ref).norm() / ref.norm()).item() < 1e-2, (kernel, m)
    if sk24_mma.load() is not None and variant == "fp8w_2:4":
        assert start == "mma_sp"  # the library's bf16 way takes every weight-only layer


def test_generate_on_gpu_equals_masked_eager_model():
    model, ref = _tiny_llama()
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))
    fast = sk.accelerate(model, {"input_ids": ids})
    out = fast.generate(ids, max_new_tokens=16).cpu()
    want = ref.cuda().generate(ids.cuda(), max_new_tokens=16, do_sample=False,
                               pad_token_id=0).cpu()
    # bf16 on different kernels: the greedy tokens agree while the logits' margins exceed the
    # rounding differences; on this model all of them do
    assert (out == want).float().mean() > 0.9
    assert torch.equal(out[:, :11], ids)


def test_lagged_stop_check_returns_the_per_step_sequences(monkeypatch):
    # the same graphs with the stop flag read two steps late (pinned copies, events) or after
    # every step: equal sequences, also where they end early at an EOS token
    model, _ = _tiny_llama()
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))
    fast = sk.accelerate(model, {"input_ids": ids})
    free = fast.generate(ids, max_new_tokens=12).cpu()
    eos = int(free[0, 13])  # row 0 ends within its first 3 new tokens
    got = {}
    for lagged in ("1", "0"):
        fast.plan = dataclasses.replace(fast.plan, lagged_stop=lagged == "1")
        got[lagged] = [fast.generate(b, max_new_tokens=12, eos_token_id=eos).cpu()
                       for b in (ids[:1], ids)]
    for a, b in zip(got["1"], got["0"]):
        assert torch.equal(a, b)
    assert got["1"][0].shape[1] <= 11 + 3


def test_cold_timing_reads_a_small_weight_from_memory_not_l2():
    """A 32 MB weight fits the L2 (50 MB on an H100/H200): timed on its own it is read from the
    L2, timed as the decode plan does (copies cycled past the L2) from memory, which is
    slower; a 2:4 layer timed that way is left holding its own tensors."""
    import functools

    from torch import nn

    from sparsekit.accel.layers import VARIANTS
    from sparsekit.nn import timing

    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    hot = timing.graph_time_us(functools.partial(torch.nn.functional.linear, x, w))
    cold = timing.cold_time_us(functools.partial(torch.nn.functional.linear, x, w))
    assert cold > 1.3 * hot, (cold, hot)
    lin = nn.Linear(4096, 1024, bias=False).cuda()
    with torch.no_grad():
        lin.weight.copy_(masked_24(1024, 4096).cuda())
    mod = VARIANTS["bf16_2:4"](lin)
    before = {name: t.data_ptr() for name, t in mod.named_buffers()}
    assert timing.cold_time_us(functools.partial(mod, x)) > 0
    assert {name: t.data_ptr() for name, t in mod.named_buffers()} == before
