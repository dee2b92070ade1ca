"""The W4A16 (int4 weight, bf16 activation) formats, ops and layers on CPU: pack/unpack round
trips, the ops' references and the Triton kernels (under ``TRITON_INTERPRET=1``) against float64
matmuls of the dequantized masked weight, opcheck, shapes refused, and the int4 layers against
``F.linear`` of their dequantized weight."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparsekit.accel.kernels.int4 import op as int4_op
from sparsekit.accel import layers_int4
from sparsekit.accel import layers
from sparsekit.accel.kernels.triton24 import format as sk24
from sparsekit.accel.kernels.int4 import format as w4a16


def _q24(n, k, seed=0, sparse=True):
    """Random int4 values (N, K) int8 in [-8, 7]; 2:4 along K (some groups with fewer than two
    nonzeros) when ``sparse``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    if not sparse:
        return q
    q4 = q.reshape(n, -1, 4)
    keep = torch.rand(q4.shape, generator=g).topk(2, dim=-1).indices
    q4 = q4 * torch.zeros_like(q4).scatter_(-1, keep, 1)
    return q4.reshape(n, k)


def _scales(n, groups, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, groups, generator=g) * 0.2 + 0.01).to(dtype)


def _ref64(x, q, scales, bias):
    """float64 ``x @ (q * scale).T + bias``, each scale repeated over its group."""
    group = q.shape[1] // scales.shape[1]
    w = q.double() * scales.double().repeat_interleave(group, dim=1)
    y = x.double() @ w.t()
    return y if bias is None else y + bias.double()


def _close_bf16(y, ref):
    """y (bf16) is ref rounded to bf16, up to float32 summation order: within 1 bf16 ulp."""
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    torch.testing.assert_close(y.double(), ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())


def test_nibble_pack_round_trip_and_layout():
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 2)  # every value, both nibbles
    p = w4a16.pack_nibbles(q)
    assert p.dtype == torch.uint8 and p.shape == (3, 16)
    assert torch.equal(w4a16.unpack_nibbles(p), q)
    # column 2j in the low nibble, 2j + 1 in the high one, each as q + 8
    assert int(p[0, 0]) == (-8 + 8) | ((-7 + 8) << 4)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_pack_round_trips_and_bytes(group):
    q24, qd = _q24(8, 256), _q24(8, 256, sparse=False)
    s = _scales(8, 256 // group)
    values, meta, s2 = w4a16.pack_24(q24, s)
    assert values.shape == (8, 64) and values.dtype == torch.uint8
    assert meta.shape == (8, 8) and meta.dtype == torch.int32 and torch.equal(s2, s)
    assert torch.equal(w4a16.unpack_24(values, meta), q24)
    # the elementwise dequantization (prefill, references) is q * scale exactly
    assert torch.equal(w4a16.dequantize_packed_24(values, meta, s), w4a16.dequantize(q24, s))
    bytes_per_weight = (values.numel() + 4 * meta.numel()) / q24.numel()
    assert bytes_per_weight == 0.25 + 0.125
    dvalues, _ = w4a16.pack(qd, s)
    assert dvalues.shape == (8, 128) and torch.equal(w4a16.unpack(dvalues), qd)
    assert torch.equal(w4a16.dequantize_packed(dvalues, s, torch.bfloat16),
                       w4a16.dequantize(qd, s, torch.bfloat16))
    assert w4a16.bound_bytes(1, 8, 256, group, True) == 8 * 96 + 8 * (256 // group) * 4 + 512 + 16


def test_references_equal_float64_matmul_for_every_m():
    n, k, group = 24, 128, 64
    q24, qd = _q24(n, k), _q24(n, k, seed=3, sparse=False)
    bias = torch.randn(n).bfloat16()
    for scale_dtype in (torch.float32, torch.bfloat16):
        s = _scales(n, k // group, dtype=scale_dtype)
        v24, meta, _ = w4a16.pack_24(q24, s)
        vd, _ = w4a16.pack(qd, s)
        for m in range(1, 33):
            x = torch.randn(m, k).bfloat16()
            b = bias if m % 2 else None
            _close_bf16(int4_op.int4_24_mm(x, v24, meta, s, b), _ref64(x, q24, s, b))
            _close_bf16(int4_op.int4_mm(x, vd, s, b), _ref64(x, qd, s, b))


def test_opcheck_int4_ops():
    q24, qd = _q24(32, 128), _q24(32, 128, sparse=False)
    s = _scales(32, 2)
    v24, meta, _ = w4a16.pack_24(q24, s)
    vd, _ = w4a16.pack(qd, s)
    x = torch.randn(5, 128).bfloat16()
    bias = torch.randn(32).bfloat16()
    torch.library.opcheck(int4_op.int4_24_mm, (x, v24, meta, s, bias))
    torch.library.opcheck(int4_op.int4_mm, (x, vd, s.bfloat16(), None))


def test_odd_shapes_refused_naming_the_shape():
    with pytest.raises(ValueError, match=r"8x96.*not a multiple of 64"):
        w4a16.pack(_q24(8, 96, sparse=False), _scales(8, 1))
    # RTN's default group 128 does not divide 192: the largest group that does (64)
    assert layers_int4.Int4Dense(nn.Linear(192, 8)).group_size == 64
    with pytest.raises(ValueError, match=r"8x192.*group_size must be a multiple of 64"):
        w4a16.pack(_q24(8, 192, sparse=False), _scales(8, 4))  # 4 groups of 48
    with pytest.raises(ValueError, match=r"scales \(8, 5\) do not fit the weight 8x192"):
        w4a16.pack(_q24(8, 192, sparse=False), _scales(8, 5))
    reason = w4a16.check_shape(8, 192, 128)
    assert "8x192" in reason and "not a multiple of group_size" in reason
    assert "group_size must be a multiple of 64" in w4a16.check_shape(8, 192, 48)
    assert "in_features is not a multiple of 64" in w4a16.check_shape(8, 96, 96)
    assert w4a16.check_shape(8, 192, 64) is None and w4a16.check_shape(8, 128, 32) is None
    with pytest.raises(ValueError, match=r"in \[-8, 7\]"):
        w4a16.pack(torch.full((4, 64), 9, dtype=torch.int8), _scales(4, 1))
    with pytest.raises(ValueError, match="more than 2 nonzeros"):
        w4a16.pack_24(_q24(4, 64, sparse=False) | 1, _scales(4, 1))
    with pytest.raises(ValueError, match=r"int4_dense layer \(8x96\).*not a multiple of 64"):
        layers_int4.Int4Dense(nn.Linear(96, 8))
    with pytest.raises(ValueError, match=r"int4_2:4 layer \(8x64\).*more than 2 nonzeros"):
        layers_int4.Int4Sparse24(nn.Linear(64, 8))
    v, meta, s = w4a16.pack_24(_q24(8, 128), _scales(8, 1))
    with pytest.raises(ValueError, match=r"x must be \(M, 128\)"):
        int4_op.int4_24_mm(torch.randn(2, 64).bfloat16(), v, meta, s, None)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        int4_op.int4_24_mm(torch.randn(2, 128), v, meta, s, None)


# --- Triton kernels under TRITON_INTERPRET=1 ---------------------------------------------------
# triton.jit reads TRITON_INTERPRET when it decorates, triton's own library functions included
# (at `import triton`): the interpreted kernels run in a fresh process started with it set,
# which runs this file as a script (the __main__ block at the end).

# (group size, BLOCK_K): the tile inside one group, the tile covering two groups, per channel
CASES = [(64, 64), (32, 64), (128, 64), (64, 128)]


def _check_interpreted_kernels(quick: bool = False) -> None:
    """Every case; ``quick``: the first tile case and the first row case, sparse and dense
    (the default run's sibling of the slow test)."""
    from triton.runtime.interpreter import InterpretedFunction

    from sparsekit.accel.kernels.int4 import kernel as w4a16_triton

    assert isinstance(w4a16_triton.int4_kernel, InterpretedFunction)
    n, k = 24, 128  # 24 rows: the last BLOCK_N tile is partly masked
    for sparse in (True, False):
        for group, block_k in CASES[:1] if quick else CASES:
            q = _q24(n, k, seed=group + block_k, sparse=sparse)
            s = _scales(n, k // group)
            bias = torch.randn(n).bfloat16()
            packed = w4a16.pack_24(q, s)[:2] if sparse else w4a16.pack(q, s)[:1]
            run = w4a16.launch_24 if sparse else w4a16.launch
            # CUDA cores up to 4 rows, tl.dot beyond; 40: two M tiles (once per kernel)
            for m in (1, 17, 40) if block_k == 128 else (1, 17)[:1 if quick else 2]:
                x = torch.randn(m, k).bfloat16()
                b = bias if m != 1 else None
                y = run(x, *packed, s, b, config={"BLOCK_N": 16, "BLOCK_K": block_k})
                _close_bf16(y, _ref64(x, q, s, b))
                print(f"ok sparse={sparse} group={group} BLOCK_K={block_k} M={m}")
    _check_interpreted_row_kernels(quick)


# the word-tile kernels of M <= 4: (K, group, U, SPLIT_K): one iteration per group with an
# uneven split, two vectors per iteration, per channel with the default CPU config (None)
ROW_CASES = [(320, 64, 1, 2), (256, 128, 2, 2), (256, 256, None, None)]


def _check_interpreted_row_kernels(quick: bool = False) -> None:
    n = 40  # two BLOCK_N tiles of 32, the second partly masked
    for sparse in (True, False):
        for k, group, u, split in ROW_CASES[:1] if quick else ROW_CASES:
            q = _q24(n, k, seed=k + group, sparse=sparse)
            s = _scales(n, k // group)
            bias = torch.randn(n).bfloat16()
            packed = w4a16.pack_24(q, s)[:2] if sparse else w4a16.pack(q, s)[:1]
            run = w4a16.launch_24 if sparse else w4a16.launch
            config = None if u is None else {"BLOCK_N": 32, "U": u, "SPLIT_K": split,
                                              "num_warps": 1}
            for m in (1, 2, 3)[:1 if quick else 3]:  # BLOCK_M 1, 2 and 4 (a padded row)
                x = torch.randn(m, k).bfloat16()
                b = bias if m != 1 else None
                y = run(x, *packed, s, b, config=config)
                _close_bf16(y, _ref64(x, q, s, b))
                print(f"ok rows sparse={sparse} K={k} group={group} M={m}")


def _interpret_this_file(*args: str) -> str:
    """This file run as a script under the interpreter (its ``__main__`` block); its stdout."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run.stdout


@pytest.mark.slow  # every tile and row case (the quick test below runs the first of each)
def test_triton_kernels_interpreted_equal_reference():
    out = _interpret_this_file()
    assert out.count("ok ") == 2 * (2 * len(CASES) + 1) + 2 * 3 * len(ROW_CASES)


def test_triton_kernels_interpreted_equal_reference_quick():
    # both kernels (tile, row), sparse and dense, on their first case at M = 1
    out = _interpret_this_file("quick")
    assert out.count("ok ") == 2 * 2


_WIDEN_24 = """
import torch
from sparsekit.accel.kernels.int4 import format as w4a16
from test_int4_kernels_cpu import _q24, _scales
# row and group tails of a program's block; groups of 32, 64, 128 and one per row; bf16 scales
for n, k, group, dtype in ((5, 512, 128, torch.float32), (17, 1024, 64, torch.float32),
                           (40, 2048, 2048, torch.float32), (3, 256, 32, torch.bfloat16)):
    q = _q24(n, k, seed=n)
    q[0, :4] = torch.tensor([0, 0, 0, 5])  # one kept value, at the last position
    q[1, :8] = 0  # groups with none
    values, meta, s = w4a16.pack_24(q, _scales(n, k // group, dtype=dtype))
    got = w4a16.widen_24(values, meta, s)
    want = w4a16.dequantize_packed_24(values, meta, s, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want), (n, k, group)
print("ok")
"""


def test_int4_widen_kernel_under_interpreter_is_the_dequantization():
    # an int4 2:4 layer's prefill weight in one pass, bitwise against the elementwise ops
    # (float32 products rounded to nearest even)
    pytest.importorskip("triton")
    from interpreted import run_interpreted

    out = run_interpreted(_WIDEN_24)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_int4_widen_op_is_the_prefill_weight_behind_one_op():
    q, s = _q24(48, 512, seed=2), _scales(48, 4)
    values, meta, scales = w4a16.pack_24(q, s)
    got = int4_op.int4_24_widen(values, meta, scales)
    assert torch.equal(got, w4a16.dequantize_packed_24(values, meta, scales, torch.bfloat16))
    torch.library.opcheck(int4_op.int4_24_widen, (values, meta, scales))
    # the layer's "dequant" prefill multiplies with it: one op in its graph, no where-selects
    from torch.fx.experimental.proxy_tensor import make_fx

    lin = nn.Linear(512, 48)
    with torch.no_grad():
        lin.weight.copy_(q.float() * 0.01)
    layer = layers_int4.Int4Sparse24(lin)
    x = torch.randn(w4a16.MAX_M + 1, 512).bfloat16()
    gm = make_fx(lambda x: layer(x))(x)
    targets = [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
    assert any("int4_24_widen" in t for t in targets)
    assert not any("where" in t for t in targets)
    want = F.linear(x, layer.dequantized_weight(torch.bfloat16), layer.bias)
    assert torch.equal(layer(x), want)


@pytest.mark.slow  # a GPU compiler build (Triton for sm_90); the gpu tests build it for real
def test_int4_widen_kernel_compiles_for_sm90():
    """The widening kernel reaches the GPU compiler (no GPU needed: Triton compiles for an
    sm_90 target here)."""
    pytest.importorskip("triton")
    from interpreted import compile_sm90

    from sparsekit.accel.kernels.int4 import kernel as w4a16_triton

    bn, bg = sk24.WIDEN_BLOCK
    kernel = compile_sm90(w4a16_triton.widen_24_kernel,
                          {"v_ptr": "*u8", "m_ptr": "*i32", "s_ptr": "*fp32", "w_ptr": "*bf16",
                           "N": "i32", "K": "i32", "GROUPS": "i32"},
                          {"BLOCK_N": bn, "BLOCK_G": bg})
    assert "st.global" in kernel.asm["ptx"]


def test_x_planes_are_x_times_the_nibble_factors():
    """The word-tile kernels' x layouts against their formulas in float64: dense [:, b, j, i] =
    x[:, 8(4b + i) + j] * 16**-(j if j < 4 else j - 3); 2:4 [:, b, s, i, p] =
    x[:, 32(2b + i) + 4s + p] * 16**-(0, 2, 1, 3)[s % 4]; the second call reuses the factors."""
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    for _ in range(2):
        dense, sparse = w4a16.x_planes(x), w4a16.x_planes_24(x)
        assert dense.dtype == sparse.dtype == torch.float32
        assert dense.is_contiguous() and sparse.is_contiguous()
        for b, j, i in [(0, 0, 0), (1, 3, 2), (7, 4, 3), (5, 7, 1)]:
            want = x[:, 8 * (4 * b + i) + j].double() * 16.0 ** -(j if j < 4 else j - 3)
            assert torch.equal(dense[:, b, j, i].double(), want)
        for b, s_, i, p in [(0, 0, 0, 0), (1, 2, 1, 3), (3, 5, 0, 2), (2, 7, 1, 1)]:
            want = x[:, 32 * (2 * b + i) + 4 * s_ + p].double() * 16.0 ** -(0, 2, 1, 3)[s_ % 4]
            assert torch.equal(sparse[:, b, s_, i, p].double(), want)


def test_metadata_codes_every_pair():
    """The 2:4 codes P | Q << 1 | R << 2 of every kept pair (i0, i1), decoded back by
    ``positions`` and by the kernels' selects ``x[i0] = x0 if P else (x1 if Q else x2)``,
    ``x[i1] = x3 if R else (x2 if Q else x1)``."""
    pairs = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    q = torch.zeros(1, 64, dtype=torch.int8)
    for g, (i0, i1) in enumerate(pairs * 2):
        q[0, 4 * g + i0], q[0, 4 * g + i1] = 1 + g % 7, -1 - g % 8
    v, meta, _ = w4a16.pack_24(q, _scales(1, 1))
    i0, i1 = w4a16.positions(meta)
    assert list(zip(i0[0, :12].tolist(), i1[0, :12].tolist())) == pairs * 2
    code = ((meta[0, :, None] >> torch.arange(0, 32, 4)) & 0xF).reshape(-1)[:6]
    for c, (a, b) in zip(code.tolist(), pairs):
        p_, q_, r_ = c & 1, (c >> 1) & 1, (c >> 2) & 1
        assert (0 if p_ else (1 if q_ else 2), 3 if r_ else (2 if q_ else 1)) == (a, b)
    assert torch.equal(w4a16.unpack_24(v, meta), q)


def test_tile_fit_rule():
    from sparsekit.accel.kernels.int4 import kernel as w4a16_triton

    assert w4a16_triton.fits(4096, 128, 64) and w4a16_triton.fits(4096, 128, 512)
    assert not w4a16_triton.fits(4096, 192, 128)  # neither inside one group nor whole groups
    assert w4a16_triton.fits(14336, 14336, 512)  # per channel: any tile that divides K
    assert not w4a16_triton.fits(4160, 4160, 128)


# --- layers ------------------------------------------------------------------------------------

def _linear24(k=128, n=48, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        g = lin.weight.reshape(n, -1, 4)
        keep = g.abs().topk(2, dim=-1).indices
        lin.weight.copy_((g * torch.zeros_like(g).scatter_(-1, keep, 1.0)).reshape(n, k))
    return lin


def test_variants_registered():
    assert "int4" in layers.precisions()
    assert layers.VARIANTS["int4_2:4"] is layers_int4.Int4Sparse24
    assert layers.VARIANTS["int4_dense"] is layers_int4.Int4Dense
    assert layers.variant_name("int4", True) == "int4_2:4"


def test_rtn_matches_the_float64_formula():
    w = torch.randn(6, 256, dtype=torch.float64)
    w[0, :128] = 0  # an all-zero group: tiny scale, zeros stay zeros
    w[1, :128] = w[1, :128].clamp(-6, 6)
    w[1, :4] = torch.tensor([7.0, 2.5, -3.5, 0.5])  # scale 1: halves go to even
    q, s = layers_int4.rtn_int4(w, 128)
    amax = w.abs().reshape(6, 2, 128).amax(-1).clamp_min(1e-12)
    torch.testing.assert_close(s.double(), amax / 7, rtol=1e-6, atol=0)
    t = w / s.double().repeat_interleave(128, 1)
    assert ((q.double() - t).abs() <= 0.5 + 1e-5).all()  # nearest (ties: float32 rounding)
    assert q[1, :4].tolist() == [7, 2, -4, 0] and (q[0, :128] == 0).all()
    assert int(q.max()) == 7 and int(q.min()) >= -7  # symmetric absmax never reaches -8


@pytest.mark.parametrize("cls", [layers_int4.Int4Sparse24, layers_int4.Int4Dense])
def test_layer_from_linear_equals_f_linear_of_dequantized(cls):
    lin = _linear24()
    layer = cls(lin)
    q, s = layers_int4.rtn_int4(lin.weight, 128)
    assert torch.equal(layer.int_weight(), q)
    assert torch.equal(layer.weights(layer.plan.kernels()[0]).scales, s)
    assert layer.group_size == 128 and layer.bias.dtype == torch.bfloat16
    w = layer.dequantized_weight(torch.float64)
    for shape in ((1, 128), (4, 8, 128), (40, 128)):  # decode op, decode op, prefill
        x = torch.randn(*shape).bfloat16()
        # prefill multiplies the weight dequantized into bf16
        wm = w if x.numel() // 128 <= 32 else w.bfloat16().double()
        _close_bf16(layer(x), F.linear(x.double(), wm, lin.bias.detach().bfloat16().double()))
    # and the int4 weight is close to the float one (RTN error only)
    dense = lin.weight.detach().double()
    assert (w - dense).norm() / dense.norm() < 0.1


def test_layer_from_int4_quantlinear_takes_its_values():
    """The QuantLinear contract: weight int8 (N, K) in [-8, 7], weight_scale float32
    (N, K // group_size), group_size; the layer keeps them exactly."""
    n, k = 32, 256
    for group in (128, k):  # int4_weight, int4_weight_channel
        ql = nn.Module()
        ql.in_features, ql.out_features, ql.group_size = k, n, group
        ql.weight = nn.Parameter(_q24(n, k, seed=group), requires_grad=False)
        ql.register_buffer("weight_scale", _scales(n, k // group))
        ql.bias = nn.Parameter(torch.randn(n))
        dequant = ql.weight.double() * ql.weight_scale.double().repeat_interleave(group, 1)
        for cls in (layers_int4.Int4Sparse24, layers_int4.Int4Dense):
            layer = cls(ql)
            assert torch.equal(layer.int_weight(), ql.weight)
            assert torch.equal(layer.weights(layer.plan.kernels()[0]).scales, ql.weight_scale)
            assert layer.group_size == group
            x = torch.randn(3, k).bfloat16()
            ref = F.linear(x.double(), dequant, ql.bias.detach().bfloat16().double())
            _close_bf16(layer(x), ref)


def test_prefill_bf16_24_copy_and_choices():
    lin = _linear24()
    lean, copy = layers_int4.Int4Sparse24(lin), layers_int4.Int4Sparse24(lin, prefill="bf16_2:4")
    assert lean.plan.text() == "M 1-32: int4_24_triton; M 33+: int4_24_dequant"
    assert copy.plan.text() == "M 1-32: int4_24_triton; M 33+: cusparselt"
    assert set(lean.formats) == {"int4_24"} and set(copy.formats) == {"int4_24", "cslt"}
    assert copy.weights("cusparselt").packed.dtype == torch.bfloat16
    x = torch.randn(64, 128).bfloat16()
    torch.testing.assert_close(copy(x), lean(x), rtol=2 ** -7, atol=1e-3)
    with pytest.raises(ValueError, match=r"int4_dense: prefill must be one of \('dequant',\)"):
        layers_int4.Int4Dense(lin, prefill="bf16_2:4")


def test_layer_traces_without_graph_breaks():
    layer = layers_int4.Int4Sparse24(_linear24())
    for m in (4, 40):  # the decode op and the prefill dequantization
        explain = torch._dynamo.explain(layer)(torch.randn(m, 128).bfloat16())
        assert explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()


@pytest.mark.parametrize("sparsity,variant", [("2:4", "int4_2:4"), ("dense", "int4_dense")])
def test_accelerate_precision_int4(sparsity, variant):
    """The public entry: accelerate(precision="int4") swaps the int4 layers in; the output is
    the float model's up to int4 rounding."""
    import sparsekit as sk

    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)).eval()
    sk.prune_(model, pattern="2:4", criterion="magnitude")
    x = torch.randn(4, 128)
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(x.double())
    fast = sk.accelerate(model, x, precision="int4", sparsity=sparsity, device="cpu",
                         compile=sk.CompileOptions(backend="eager"))
    assert [d.variant for d in fast.report.layers] == [variant, variant]
    assert isinstance(fast.model[0], layers.VARIANTS[variant])
    y = fast(x)
    assert (y.double() - ref).norm() / ref.norm() < 0.12

if __name__ == "__main__":
    _check_interpreted_kernels(quick=sys.argv[1:] == ["quick"])


def test_2_4_layer_decodes_on_the_sparse_tensor_core_format_where_it_fits(monkeypatch):
    # on a GPU where the mma.sp library loads (here its CPU reference): the layer keeps the
    # int4 mma format too, and its decode equals the Triton format's for every group it takes
    from sparsekit.accel import kernels
    from sparsekit.accel.kernels.mma_sp import launch as sk24_mma
    monkeypatch.setattr(sk24_mma, "usable_int4",
                        lambda q, group: sk24_mma.check_int4(*q.shape, group) is None)
    g = torch.Generator().manual_seed(5)
    for group, mma in ((128, True), (256, True), (64, False)):
        lin = nn.Linear(256, 32)
        with torch.no_grad():
            lin.weight.copy_(_q24(32, 256, seed=group).float() * 0.01)
        layer = layers_int4.Int4Sparse24(lin)
        layer.group_size = group
        q, s = layers_int4.rtn_int4(lin.weight, group)
        layer.start((q, s))
        assert (layer.path == "mma_sp_int4") == mma
        assert set(layer.formats) == ({"int4_24", "mma_int4"} if mma else {"int4_24"})
        if mma:  # the copy gives back the layer's values and group scales exactly
            fmt = kernels.get("mma_sp_int4").format
            got_q, got_s = fmt.unpack(layer, layer.weights("mma_sp_int4").items())
            assert torch.equal(got_q, q) and torch.equal(got_s, s)
        x = torch.randn(5, 256, generator=g).bfloat16()
        want = _ref64(x, q, s, layer.bias)
        _close_bf16(layer(x), want)
        assert f"M 1-32: {'mma_sp_int4' if mma else 'int4_24_triton'}" in repr(layer)

