import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_reaches_exact_count(tmp_path):
    out = tmp_path / "r.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "bench_global_prune.py"),
            "--smoke",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert result["exact"] and result["zeros"] == int(0.9 * result["parameters"] + 0.5)
