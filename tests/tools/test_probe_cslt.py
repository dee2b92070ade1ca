"""tools/probe_cslt.py, probe_cslt_epilogue.py and probe_layout.py are GPU probes: without
CUDA each says so in one line."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the probe runs for real on a GPU")
@pytest.mark.parametrize("tool", ["probe_cslt.py", "probe_layout.py"])
def test_probe_needs_a_gpu_and_says_so(tool):
    done = subprocess.run([sys.executable, str(ROOT / "tools" / tool), "--out", "unused.json"],
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip() == f"{tool}: needs a CUDA GPU (it calls cuSPARSELt)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the probe runs for real on a GPU")
def test_epilogue_probe_needs_a_gpu_and_says_so():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "probe_cslt_epilogue.py")],
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip().startswith("probe_cslt_epilogue.py: needs a CUDA GPU")

