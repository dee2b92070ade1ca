"""tools/probe_cslt.py is a GPU probe: on a machine without CUDA it says so in one line."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the probe runs for real on a GPU")
def test_probe_needs_a_gpu_and_says_so():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "probe_cslt.py"), "--out",
                           "unused.json"], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip() == "probe_cslt.py: needs a CUDA GPU (it calls cuSPARSELt)"
