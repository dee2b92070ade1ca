"""int4 (W4A16) kernels on the GPU (skipped without CUDA): the autotuned Triton kernels against
their CPU references and float64 for every decode M, the layers on CUDA (decode and both
prefill paths), and the int4 decode GEMM benchmark on one shape."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparsekit.accel.kernels.int4 import op as int4_op
from sparsekit.accel import layers_int4
from sparsekit.accel.kernels.int4 import format as w4a16

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
ROOT = Path(__file__).resolve().parents[2]


def _w24(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k // 4, 4, generator=g)
    keep = w.abs().topk(2, dim=-1).indices
    return (w * torch.zeros_like(w).scatter_(-1, keep, 1.0)).reshape(n, k)


def rel_err(y, ref):
    y, ref = y.detach().double().cpu(), ref.detach().double().cpu()
    return ((y - ref).norm() / ref.norm()).item()


def _check(n, k, group, ms, config=None):
    q, s = layers_int4.rtn_int4(_w24(n, k), group)
    v24, meta, _ = w4a16.pack_24(q, s)
    vd, _ = w4a16.pack(q, s)
    bias = torch.randn(n).bfloat16()
    wdq = w4a16.dequantize(q, s, torch.float64)
    cases = ((w4a16.launch_24, int4_op.int4_24_mm, (v24, meta, s)),
             (w4a16.launch, int4_op.int4_mm, (vd, s)))
    for m in ms:
        x = torch.randn(m, k).bfloat16()
        ref64 = F.linear(x.double(), wdq, bias.double())
        for launch, op, args in cases:
            cuda_args = [a.cuda() for a in (x, *args, bias)]
            # the op (autotuned) or the launcher with one fixed tile
            y = op(*cuda_args) if config is None else launch(*cuda_args, config=config)
            assert y.dtype == torch.bfloat16 and y.shape == (m, n)
            ref = op(x, *args, bias)  # the CPU reference
            assert rel_err(y, ref) < 8e-3, (op, m)  # bf16 rounding of both (1 ulp: 0.8%)
            assert rel_err(y, ref64) < 8e-3, (op, m)


@pytest.mark.parametrize("shape", [(6144, 4096, 128), (4096, 14336, 128), (100, 512, 64)])
def test_widen_op_is_the_dequantization(shape):
    # the int4 2:4 prefill's one-pass Triton dequantization, bitwise (round to nearest even)
    n, k, group = shape
    q, s = layers_int4.rtn_int4(_w24(n, k), group)
    values, meta, scales = w4a16.pack_24(q, s)
    want = w4a16.dequantize_packed_24(values, meta, scales, torch.bfloat16)
    got = int4_op.int4_24_widen(values.cuda(), meta.cuda(), scales.cuda())
    assert torch.equal(got.cpu(), want)


def test_autotuned_kernels_match_reference_for_every_m():
    """Group 128, a partial last N tile, every decode M (all six autotuner buckets)."""
    _check(1000, 1024, 128, range(1, 33))


# per channel (tiles inside the one group) and group 32 (tiles covering several groups), with a
# fixed tile (each group size is another compilation of every autotuner config)
@pytest.mark.parametrize("n,k,group", [(512, 2048, 2048), (256, 512, 32)])
def test_fixed_tile_kernels_match_reference(n, k, group):
    _check(n, k, group, (1, 3, 8, 32), config={"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4})


# the word-tile kernels (M <= 4) with a fixed config: group 64 (one vector per iteration, an
# uneven split), per channel (two vectors per iteration)
@pytest.mark.parametrize("n,k,group,u", [(1000, 1984, 64, 1), (512, 2048, 2048, 2)])
def test_fixed_row_kernels_match_reference(n, k, group, u):
    _check(n, k, group, (1, 2, 3, 4),
           config={"BLOCK_N": 64, "U": u, "SPLIT_K": 5, "num_warps": 1})


@pytest.mark.parametrize("cls,prefill", [(layers_int4.Int4Sparse24, "dequant"),
                                         (layers_int4.Int4Sparse24, "bf16_2:4"),
                                         (layers_int4.Int4Dense, "dequant")])
def test_layers_on_cuda_decode_and_prefill(cls, prefill):
    torch.manual_seed(0)
    lin = nn.Linear(1024, 768)
    with torch.no_grad():
        lin.weight.copy_(_w24(768, 1024))
    layer = cls(lin.cuda(), prefill=prefill)
    w = layer.dequantized_weight(torch.float64)
    for m in (1, 16, 32, 300):  # decode kernels up to 32 tokens, prefill beyond
        x = torch.randn(m, 1024, device="cuda").bfloat16()
        ref = F.linear(x.double(), w, lin.bias.detach().double())
        assert rel_err(layer(x), ref) < 1e-2, m
    assert rel_err(w, lin.weight.detach()) < 0.1  # RTN int4 error


def test_bench_on_one_shape(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import bench_decode_gemm_int4 as bench
    finally:
        sys.path.pop(0)
    out = tmp_path / "int4.json"
    bench.main(["--out", str(out), "--shapes", "llama3-8b.o", "--tokens", "1,16"])
    res = json.loads(out.read_text())
    for row in res["rows"]:
        for v, r in row["variants"].items():
            assert r["rel_err"] < 1e-2, v
            assert 0 < r["pct_bound"] < 110, v  # above the bound: the L2 served the weight
            assert r["weight_copies"] >= 2
