import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_tool():
    """``run_tool("bench_cpu.py", "--smoke", ...)``: the script under tools/ in a subprocess;
    a failure shows the end of its stderr. Returns the CompletedProcess (text output)."""

    def run(script: str, *args) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, str(ROOT / "tools" / script), *map(str, args)],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    return run


@pytest.fixture
def tool_module():
    """``tool_module("bench_cpu")``: the script tools/bench_cpu.py imported as a module (with
    tools/ on sys.path while it imports, for the scripts that import each other)."""
    import importlib

    def load(name: str):
        sys.path.insert(0, str(ROOT / "tools"))
        try:
            return importlib.import_module(name)
        finally:
            sys.path.pop(0)

    return load
