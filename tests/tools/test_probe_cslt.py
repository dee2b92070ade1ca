"""tools/probe_cslt.py, probe_cslt_epilogue.py and probe_layout.py are GPU probes: without
CUDA each says so in one line."""

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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the probe runs for real on a GPU")
def test_epilogue_probe_needs_a_gpu_and_says_so():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "probe_cslt_epilogue.py")],
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip().startswith("probe_cslt_epilogue.py: needs a CUDA GPU")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the probe runs for real on a GPU")
def test_layout_probe_needs_a_gpu_and_says_so():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "probe_layout.py"), "--out",
                           "unused.json"], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip() == "probe_layout.py: needs a CUDA GPU (it calls cuSPARSELt)"
