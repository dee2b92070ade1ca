"""The mma.sp 2:4 format (sparsekit/accel/kernels/mma_sp/launch.py) on CPU: the round trip,
the format read
lane by lane the way mma.sp.m16n8k32 reads its registers (PTX ISA's fragment layouts for the
A operand, its metadata and the sparsity selector) against dense matmul of the masked weight,
the reference, the op's opcheck and the errors."""

import contextlib
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import sparsekit as sk
from sparsekit.accel import build, libload
from sparsekit.accel.kernels import switches
from sparsekit.accel.kernels.mma_sp import launch as sk24_mma
from sparsekit.accel.kernels.mma_sp import op as mma_op
from test_decode_cpu import masked_24 as decode_masked_24


def masked_24(n: int, k: int, seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    """test_decode_cpu's 2:4 weight (empty and one-entry groups) plus a group keeping only its
    last position, in ``dtype``."""
    w = decode_masked_24(n, k, seed)
    w[2, 8:12] = torch.tensor([0.0, 0.0, 0.0, -0.25])
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("layout", sk24_mma.META_LAYOUTS)
def test_round_trip(dtype, layout):
    w = masked_24(48, 192, dtype=dtype)
    values, meta = sk24_mma.compress(w, layout)
    assert values.shape == (3, 6, 32, 8) and values.dtype == dtype
    assert meta.shape == ((3, 3, 32) if layout == "paired" else (3, 6, 32))
    assert meta.dtype == torch.int32
    back = sk24_mma.decompress(values, meta)
    assert back.dtype == dtype and torch.equal(back.float(), w.float())


def emulate(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """x @ W.T computed the way the kernel's warps compute it: per 16 x 32 step, each lane's
    four A registers and metadata word placed by PTX's layout for mma.sp.m16n8k32 (bf16): lane
    4q + t holds compressed columns (2t, 2t+1) of rows q, q+8, then (2t+8, 2t+9) of rows q,
    q+8; with sparsity selector s, lane 4q + 2s + p holds the 2-bit positions of half p of row
    q (low 16 bits) and of row q + 8 (high 16 bits), compressed column 8p + j at bits 2j."""
    rt_n, ks_n = values.shape[:2]
    paired = meta.shape[1] != ks_n
    y = torch.zeros(x.shape[0], rt_n * 16, dtype=torch.float64)
    for rt in range(rt_n):
        for ks in range(ks_n):
            a = torch.zeros(16, 16, dtype=torch.float64)
            pos = torch.zeros(16, 16, dtype=torch.int64)
            sel = ks % 2 if paired else 0
            words = meta[rt, ks // 2] if paired else meta[rt, ks]
            for lane in range(32):
                q, t = divmod(lane, 4)
                regs = values[rt, ks, lane].double().reshape(4, 2)
                for r, (row, col) in enumerate(((q, 2 * t), (q + 8, 2 * t), (q, 2 * t + 8),
                                                (q + 8, 2 * t + 8))):
                    a[row, col:col + 2] = regs[r]
                if t // 2 == sel:
                    p = t % 2
                    word = int(words[lane]) & 0xFFFFFFFF
                    for row, bits in ((q, word & 0xFFFF), (q + 8, word >> 16)):
                        for j in range(8):
                            pos[row, 8 * p + j] = (bits >> (2 * j)) & 3
            dense = torch.zeros(16, 32, dtype=torch.float64)
            for row in range(16):
                for c in range(16):
                    dense[row, 4 * (c // 2) + pos[row, c]] += a[row, c]
            y[:, rt * 16:(rt + 1) * 16] += x.double()[:, ks * 32:(ks + 1) * 32] @ dense.t()
    return y


@pytest.mark.parametrize("layout", sk24_mma.META_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_lane_layout_equals_dense_matmul(layout, dtype):
    w = masked_24(32, 128, seed=1, dtype=dtype)
    x = torch.randn(3, 128, dtype=torch.float64)
    values, meta = sk24_mma.compress(w, layout)
    want = x @ w.double().t()
    assert torch.allclose(emulate(x, values, meta), want, rtol=1e-12, atol=1e-12)


def test_reference_equals_dense_matmul_every_m():
    w = masked_24(64, 256, seed=2)
    values, meta = sk24_mma.compress(w)
    ws = torch.rand(64) + 0.5
    bias = torch.randn(64).to(torch.bfloat16)
    for m in range(1, 33):
        x = torch.randn(m, 256).to(torch.bfloat16)
        xs = torch.rand(m, 1) + 0.5
        got = mma_op.sk24_mma_mm(x, values, meta, xs, ws, bias)
        want = (x.double() @ w.double().t()) * xs.double() * ws.double() + bias.double()
        assert got.dtype == torch.bfloat16 and got.shape == (m, 64)
        assert torch.allclose(got.double(), want, rtol=1e-2, atol=1e-2), m


def test_op_passes_opcheck():
    w = masked_24(32, 128, seed=3)
    values, meta = sk24_mma.compress(w)
    x = torch.randn(4, 128).to(torch.bfloat16)
    torch.library.opcheck(mma_op.sk24_mma_mm, (x, values, meta, None, None, None))
    torch.library.opcheck(mma_op.sk24_mma_mm, (x, values, meta, torch.ones(4, 1),
                                            torch.ones(32), torch.zeros(32, dtype=torch.bfloat16)))


def test_refuses_bad_weights():
    with pytest.raises(ValueError, match="out_features 40 is not a multiple of 16"):
        sk24_mma.compress(masked_24(40, 128))
    with pytest.raises(ValueError, match="in_features 96 is not a multiple of 64"):
        sk24_mma.compress(masked_24(32, 96))
    with pytest.raises(ValueError, match="more than 2 nonzeros"):
        sk24_mma.compress(torch.ones(32, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        sk24_mma.compress(masked_24(32, 128).float())
    with pytest.raises(ValueError, match="meta_layout"):
        sk24_mma.compress(masked_24(32, 128), "rows")


def test_load_off_the_gpu_says_why_and_plan_options_choose_the_kernel():
    sk24_mma.load.cache_clear()
    try:
        assert sk24_mma.load() is None and sk24_mma.reason() == "no CUDA device"
    finally:
        sk24_mma.load.cache_clear()
    # PlanOptions.mma_sp (was SPARSEKIT_SK24_MMA): "off" turns the kernel off, "all" puts fp8
    # weights on it untimed; the defaults outside accelerate
    assert sk24_mma.enabled() and sk24_mma.dtypes() == (torch.bfloat16,)
    with switches.using(sk.PlanOptions(mma_sp="off").switches()):
        assert not sk24_mma.enabled()
    with switches.using(sk.PlanOptions(mma_sp="all").switches()):
        assert sk24_mma.enabled() and sk24_mma.dtypes() == sk24_mma.DTYPES
    assert sk24_mma.enabled() and sk24_mma.dtypes() == (torch.bfloat16,)


def emulate_e4m3(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """x @ W.T the way mma.sp.m16n8k64 (e4m3) reads the "e4m3" layout (PTX ISA's fragment
    layouts for 8-bit sparse A): lane 4q + t holds compressed columns 4t..4t+3 of rows q, q+8,
    then 16+4t..16+4t+3 of rows q, q+8 (four bytes a register); every lane supplies metadata
    (sparsity selector 0): lane 4q + p the 2-bit positions of row q + 8 (p & 1), compressed
    columns 16 (p >> 1) + j at bits 2j (PTX's 8-bit m16n8k64 metadata figures)."""
    rt_n, ks_n = values.shape[:2]
    y = torch.zeros(x.shape[0], rt_n * 16, dtype=torch.float64)
    for rt in range(rt_n):
        for ks in range(ks_n):
            a = torch.zeros(16, 32, dtype=torch.float64)
            pos = torch.zeros(16, 32, dtype=torch.int64)
            for lane in range(32):
                q, t = divmod(lane, 4)
                regs = values[rt, ks, lane].double().reshape(4, 4)
                for r, (row, col) in enumerate(((q, 4 * t), (q + 8, 4 * t), (q, 16 + 4 * t),
                                                (q + 8, 16 + 4 * t))):
                    a[row, col:col + 4] = regs[r]
                word = int(meta[rt, ks, lane]) & 0xFFFFFFFF
                row, first = q + 8 * (t & 1), 16 * (t >> 1)
                for j in range(16):
                    pos[row, first + j] = (word >> (2 * j)) & 3
            dense = torch.zeros(16, 64, dtype=torch.float64)
            for row in range(16):
                for c in range(32):
                    dense[row, 4 * (c // 2) + pos[row, c]] += a[row, c]
            y[:, rt * 16:(rt + 1) * 16] += x.double()[:, ks * 64:(ks + 1) * 64] @ dense.t()
    return y


def test_e4m3_layout_round_trip_and_lane_reading():
    w = masked_24(32, 192, seed=4, dtype=torch.float8_e4m3fn)
    values, meta = sk24_mma.compress(w, "e4m3")
    assert values.shape == (2, 3, 32, 16) and meta.shape == (2, 3, 32)
    assert torch.equal(sk24_mma.decompress(values, meta).float(), w.float())
    x = torch.randn(3, 192, dtype=torch.float64)
    assert torch.allclose(emulate_e4m3(x, values, meta), x @ w.double().t(), rtol=1e-12,
                          atol=1e-12)
    xq = torch.randn(5, 192).to(torch.float8_e4m3fn)
    got = mma_op.sk24_mma_mm(xq, values, meta, torch.full((5, 1), 0.5), None, None)
    want = (xq.double() @ w.double().t()) * 0.5
    assert torch.allclose(got.double(), want, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="e4m3 layout takes float8_e4m3fn"):
        sk24_mma.compress(masked_24(32, 192), "e4m3")


def test_source_ships_and_build_says_why_without_nvcc(monkeypatch, tmp_path):
    root = sk24_mma.SOURCE.parents[5]
    assert sk24_mma.SOURCE.is_file() and "mma.sp" in sk24_mma.SOURCE.read_text()
    assert '"*/csrc/*.cu"' in (root / "pyproject.toml").read_text()  # package data
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "none"))
    with pytest.raises(RuntimeError, match="no nvcc"):
        build.build_sk24_mma(tmp_path / "_lib")


# nvcc runs only on GPU machines: the default (CPU) test run compiles no CUDA where nvcc exists
NEEDS_NVCC = pytest.mark.skipif(not torch.cuda.is_available() or shutil.which("nvcc") is None,
                                reason="compiles CUDA: a GPU machine with the CUDA toolkit")


@pytest.mark.gpu
@NEEDS_NVCC
def test_build_makes_a_library_the_loader_opens(tmp_path):
    path = build.build_sk24_mma(tmp_path / "_lib")
    assert path.is_file() and not list(path.parent.glob("tmp*"))  # renamed into place
    lib = libload.load(sk24_mma.SPEC, path.parent)  # static CUDA runtime: loads without a GPU
    assert lib.sk24_mma_version() == sk24_mma.VERSION == 11
    assert hasattr(lib, "sk24_mma_launch") and hasattr(lib, "sk24_mma_e4m3_launch")


def test_config_for_picks_the_bucket_of_m():
    per_bucket = [(8, 4, 1, 0), (4, 4, 1, 1), (8, 4, 2, 1), (4, 4, 4, 1)]
    flat = [v for c in per_bucket for v in c]
    got = [sk24_mma.config_for(flat, m) for m in range(1, 33)]
    want = [per_bucket[0]] + [per_bucket[1]] * 7 + [per_bucket[2]] * 8 + [per_bucket[3]] * 16
    assert got == want
    assert sk24_mma.config_for((4, 4, 2, 1), 20) == (4, 4, 2, 1)  # one for every M
    assert sk24_mma.config_for(None, 5) is None
    e4m3 = [8, 8, 4, 8, 8, 4, 4, 4]  # the fp8 x fp8 kernel's (warps, unroll) per bucket
    assert sk24_mma.config_for(e4m3, 1) == (8, 8) and sk24_mma.config_for(e4m3, 32) == (4, 4)
    assert sk24_mma.config_text(per_bucket) == "8x4x1x0/4x4x1x1/8x4x2x1/4x4x4x1"
    assert all(len(c) == 4 and c in sk24_mma.CONFIGS for c in per_bucket)


def _int4_weight(n: int, k: int, group: int, seed: int = 0):
    """(q (N, K) int8 2:4 in [-8, 7] with zeros among the kept entries, scales (N, K/group))."""
    g = torch.Generator().manual_seed(seed)
    keep = decode_masked_24(n, k, seed) != 0
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8) * keep.to(torch.int8)
    return q, torch.rand(n, k // group, generator=g) + 0.1


def _widen_int4(word: int, j: int) -> tuple[float, float]:
    """The kernel's int4x2_to_bf16x2, bit for bit: nibbles j and j + 4 as the bf16 bits
    0x4300 | n (128 + n), minus 136 in bf16."""
    bits = ((word >> (4 * j)) & 0x000F000F) | 0x43004300
    out = []
    for half in (bits & 0xFFFF, bits >> 16):
        v = torch.tensor([half - 65536 if half >= 32768 else half], dtype=torch.int16)
        out.append((v.view(torch.bfloat16) - torch.tensor([136.0]).bfloat16()).item())
    return out[0], out[1]


@pytest.mark.parametrize("group", [128, 256, 512])
def test_int4_round_trip_and_the_kernels_widening(group):
    q, scales = _int4_weight(32, 512, group)
    values, meta, gs = sk24_mma.compress_int4(q, scales)
    assert values.shape == (2, 4, 32, 4) and values.dtype == torch.int32
    assert meta.shape == (2, 8, 32) and gs.shape == (2, 4, 16)
    back, per = sk24_mma.decompress_int4(values, meta, gs)
    assert torch.equal(back, q)
    assert torch.equal(per, scales.repeat_interleave(group // 128, 1))
    # a lane's registers, widened as the kernel does, are the bf16 layout's values of q: the
    # bf16 kernel's lane reading (test_lane_layout_equals_dense_matmul) then holds for int4
    bf_values, bf_meta = sk24_mma.compress(q.to(torch.bfloat16), "paired")
    assert torch.equal(bf_meta, meta)
    for rt, grp, lane in ((0, 0, 0), (1, 3, 31), (0, 2, 13), (1, 1, 6)):
        for step in range(4):
            word = int(values[rt, grp, lane, step]) & 0xFFFFFFFF
            got = [v for j in range(4) for v in _widen_int4(word, j)]
            want = bf_values[rt, 4 * grp + step, lane].float().tolist()
            assert got == want


def test_int4_reference_equals_float64_every_m():
    q, scales = _int4_weight(48, 256, 128, seed=3)
    values, meta, gs = sk24_mma.compress_int4(q, scales)
    w = q.double() * scales.double().repeat_interleave(128, 1)
    bias = torch.randn(48).bfloat16()
    for m in range(1, 33):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).bfloat16()
        want = x.double() @ w.t() + bias.double()
        got = mma_op.sk24_mma_int4_mm(x, values, meta, gs, bias).double()
        torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=1e-2)
    torch.library.opcheck(mma_op.sk24_mma_int4_mm, (x, values, meta, gs, bias, None))
    torch.library.opcheck(mma_op.sk24_mma_int4_mm, (x, values, meta, gs, None, [8, 4, 1, 0]))


def test_int4_refuses_what_the_format_cannot_take():
    q, scales = _int4_weight(32, 256, 128)
    with pytest.raises(ValueError, match="group_size 64 is not a multiple of 128"):
        sk24_mma.compress_int4(q, torch.ones(32, 4))
    with pytest.raises(ValueError, match="in_features 192 is not a multiple of 128"):
        sk24_mma.compress_int4(q[:, :192], torch.ones(32, 1))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        sk24_mma.compress_int4(q * 2, scales)
    dense = torch.ones(32, 256, dtype=torch.int8)
    with pytest.raises(ValueError, match="more than 2 nonzeros"):
        sk24_mma.compress_int4(dense, scales)
    assert sk24_mma.check_int4(32, 256, 256) is None and sk24_mma.check_int4(32, 256, 32)
    assert sk24_mma.int4_configs() and all(c[1] % 4 == 0 for c in sk24_mma.int4_configs())
    assert not sk24_mma.usable_int4(q, 128)  # a CPU tensor


def test_self_check_keeps_out_the_configurations_that_compute_wrong_or_raise(monkeypatch):
    # the library's self-check (on the GPU) by its selection logic: the kernel replaced by the
    # reference, off by 10% for one configuration and raising for another
    w = masked_24(32, 256)
    values, meta = sk24_mma.compress(w, "paired")
    bad, broken = sk24_mma.CONFIGS[1], sk24_mma.CONFIGS[2]

    def fake(lib, x, values, meta, xs, ws, bias, cfg, gs=None):
        if cfg == broken:
            raise RuntimeError("launch failed (code 7)")
        y = sk24_mma.reference(x, values, meta, xs, ws, bias)
        return y * 1.1 if cfg == bad else y
    monkeypatch.setattr(sk24_mma, "_launch", fake)
    failed = sk24_mma._failing(None, "bf16", sk24_mma.CONFIGS,
                               lambda m: torch.randn(m, 256).bfloat16(), values, meta)
    assert failed == {bad, broken}
    q, scales = _int4_weight(32, 256, 128)
    iv, im, gs = sk24_mma.compress_int4(q, scales)
    monkeypatch.setattr(sk24_mma, "_launch", lambda lib, x, v, m, xs, ws, b, cfg, gs=None:
                        sk24_mma.reference_int4(x, v, m, gs, b))
    assert sk24_mma._failing(None, "int4", sk24_mma.int4_configs(),
                             lambda m: torch.randn(m, 256).bfloat16(), iv, im, gs=gs) == set()


def test_graph_self_check_covers_the_int4_programmatic_configurations(monkeypatch):
    # the CUDA-graph self-check's selection logic (capture and replay faked, the kernel
    # replaced by the reference): an int4 PDL configuration that computes wrong in a graph is
    # kept out; only int4's own configurations are tried for an int4 weight
    class FakeGraph:
        def replay(self):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    int4_pdl = [c for c in sk24_mma.PDL_CONFIGS if c in sk24_mma.int4_configs()]
    assert int4_pdl and len(int4_pdl) < len(sk24_mma.PDL_CONFIGS)
    bad, tried = int4_pdl[0], []

    def fake(lib, x, v, m, xs, ws, b, cfg, gs=None):
        tried.append(cfg)
        y = sk24_mma.reference_int4(x, v, m, gs, b)
        return y * 1.1 if cfg == bad else y
    monkeypatch.setattr(sk24_mma, "_launch", fake)
    q, scales = _int4_weight(32, 256, 128)
    iv, im, gs = sk24_mma.compress_int4(q, scales)
    assert sk24_mma._graph_failing(None, iv, im, 256, gs) == {bad}
    assert set(tried) == set(int4_pdl)
    values, meta = sk24_mma.compress(masked_24(32, 256), "paired")
    monkeypatch.setattr(sk24_mma, "_launch", lambda lib, x, v, m, xs, ws, b, cfg, gs=None:
                        sk24_mma.reference(x, v, m, xs, ws, b))
    assert sk24_mma._graph_failing(None, values, meta, 256) == set()


def test_a_configuration_that_failed_one_way_is_left_out_of_that_way_only(monkeypatch):
    cfg = (8, 4, 1, 1)
    monkeypatch.setitem(sk24_mma._failed, "f16", {cfg})
    monkeypatch.setattr(sk24_mma, "fp8_f16_ok", lambda: True)  # fp8 layers pass f16 x
    v16, _ = sk24_mma.compress(masked_24(64, 256), "paired")
    v8, _ = sk24_mma.compress(masked_24(64, 256, dtype=torch.float8_e4m3fn), "paired")
    assert cfg in sk24_mma.candidates(v16) and cfg not in sk24_mma.candidates(v8)
    assert cfg not in sk24_mma.working("f16") and cfg in sk24_mma.working("int4")
    q, scales = _int4_weight(64, 256, 128)
    assert sk24_mma.candidates(sk24_mma.compress_int4(q, scales)[0]) == [
        c for c in sk24_mma.int4_configs() if 4 % c[2] == 0]


def test_lean_configurations_run_whole_rounds_only(monkeypatch):
    # the lean rounds (x mode bit 4) are staged and prefetched, and load every round whole:
    # a K whose steps of 32 columns are not a multiple of the configuration's steps a round is
    # refused by the launch and left out of the plan's candidates
    lean = sk24_mma.LEAN_CONFIGS
    assert lean and all(c[3] in (19, 23) for c in lean)
    assert {c for c in lean if c[3] & 4} <= set(sk24_mma.PDL_CONFIGS)  # graph-checked too
    monkeypatch.setattr(sk24_mma, "working", lambda way: list(sk24_mma.CONFIGS))
    six = sk24_mma.compress(masked_24(32, 192).bfloat16(), "paired")[0]  # 6 steps
    eight = sk24_mma.compress(masked_24(32, 256).bfloat16(), "paired")[0]  # 8 steps
    got6, got8 = sk24_mma.candidates(six), sk24_mma.candidates(eight)
    assert {c for c in lean if c[1] == 2 and c[2] == 1} <= set(got6)
    assert not {c for c in lean if c[1] == 4} & set(got6)
    assert {c for c in lean if c[2] == 1} <= set(got8)
    assert set(got8) - set(got6) == {c for c in lean if c[1] == 4 and 2 % c[2] == 0}
    q, scales = _int4_weight(32, 384, 128)  # 12 steps: whole rounds of 4
    iv = sk24_mma.compress_int4(q, scales)[0]
    assert {c for c in lean if c[1] == 4 and c[2] == 1} <= set(sk24_mma.candidates(iv))
    values, meta = sk24_mma.compress(masked_24(32, 192).bfloat16(), "paired")
    x = torch.randn(1, 192).bfloat16()
    cfg = next(c for c in lean if c[1] == 4 and c[2] == 1)
    with pytest.raises(ValueError, match=r"takes K a multiple of 128; K = 192"):
        sk24_mma._launch(None, x, values, meta, None, None, None, cfg)


@pytest.mark.gpu
@NEEDS_NVCC
def test_lean_load_offsets_equal_the_addresses_of_the_other_rounds(tmp_path):
    # the lean rounds' per-lane offsets (computed once, advanced a round at a time), built for
    # the host from the library's own source, against the expressions load_round and load_x
    # use for the same loads: every warp, round, row tile, step and lane, several kinds
    src = Path(__file__).with_name("sk24_mma_index_test.cu")
    exe = tmp_path / "index_test"
    subprocess.run([shutil.which("nvcc"), "-O1", "-arch=sm_90", "-o", str(exe), str(src)],
                   check=True, capture_output=True, timeout=300)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout[-2000:]


def test_self_check_runs_every_way_on_both_weights_and_keeps_out_what_fails(monkeypatch):
    # the load-time self-check's plan, the kernel and graphs faked: every way on the small
    # weight with every configuration, again on the several-rounds weight with the lean ones
    # (int4 with its own), a failure kept out of its way, a failing default refuses the library
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    calls, fail = [], {}

    def fake_failing(lib, way, configs, x_of, values, meta, ws=None, gs=None):
        k = values.shape[1] * (128 if gs is not None else 32)
        calls.append((way.split(",")[0], k, tuple(configs)))
        return {c for c in configs if (way.split(",")[0], c) in fail}
    monkeypatch.setattr(sk24_mma, "_failing", fake_failing)
    monkeypatch.setattr(sk24_mma, "_graph_failing", lambda *a, **k: set())
    monkeypatch.setattr(sk24_mma, "_failed", {w: set() for w in sk24_mma.WAYS})
    lean = sk24_mma.LEAN_CONFIGS
    fail[("int4", lean[0])] = fail[("fp8 with f16 x", sk24_mma.CONFIGS[0])] = True
    sk24_mma._self_check(None)
    int4 = tuple(sk24_mma.int4_configs())
    assert calls == [("torch.bfloat16", 256, sk24_mma.CONFIGS),
                     ("torch.float8_e4m3fn", 256, sk24_mma.CONFIGS),
                     ("fp8 with f16 x", 256, sk24_mma.CONFIGS), ("int4", 256, int4),
                     ("torch.bfloat16", 3200, lean), ("torch.float8_e4m3fn", 3200, lean),
                     ("fp8 with f16 x", 3200, lean),
                     ("int4", 3200, tuple(c for c in lean if c in int4))]
    assert sk24_mma._failed["int4"] == {lean[0]}
    assert sk24_mma._failed["f16"] == {sk24_mma.CONFIGS[0]} and not sk24_mma._failed["bf16"]
    fail[("torch.float8_e4m3fn", sk24_mma.DEFAULTS[0])] = True
    with pytest.raises(RuntimeError, match="default configurations"):
        sk24_mma._self_check(None)
