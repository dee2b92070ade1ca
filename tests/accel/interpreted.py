"""Run a snippet under Triton's CPU interpreter: ``TRITON_INTERPRET=1`` is read when
``triton.jit`` decorates (triton's own functions too, at ``import triton``), so the snippet runs
in a fresh process started with it set, from the project root."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -c code`` with ``TRITON_INTERPRET=1``, the project and this folder (the tests'
    own imports) on the path."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent),
                                          os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
