"""tools/bench_attention.py off the GPU: it says it needs one (exit 2, one line), and its HF way
(repeat_kv + SDPA with the mask) is the attention the reference computes."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsekit.accel.kernels.attention import decode as attention

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import bench_attention  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_without_a_gpu_exits_with_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_attention.py"), "--out",
                          str(tmp_path / "x.json")], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == "bench_attention: needs a CUDA GPU"


def test_hf_way_is_the_reference_attention():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 1, 16, generator=g)
    k, v = torch.randn(2, 2, 2, 40, 16, generator=g)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, :5] = False
    mask[:, 30:] = False
    got = bench_attention.hf_way(q, k, v, mask, 0.25)
    torch.testing.assert_close(got, attention.reference(q, k, v, mask, 0.25), atol=1e-5,
                               rtol=1e-5)
