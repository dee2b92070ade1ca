import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_table_matches_the_runs(tmp_path):
    """Each run's summary.json feeds one row; the diff column is run minus its seed's dense."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "seed_sweep.py"), "--smoke",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    res = json.loads((tmp_path / "seed_sweep.json").read_text())
    assert list(res) == ["ptq_int8", "ptq_fp8"] and list(res["ptq_int8"]) == ["0"]
    for name, per_seed in res.items():
        s = json.loads((tmp_path / "runs" / f"{name}_s0" / "summary.json").read_text())
        assert per_seed["0"]["compressed"] == s["compressed"]["accuracy"]
        assert per_seed["0"]["dense"] == s["dense"]["accuracy"]
        row = next(ln for ln in done.stdout.splitlines() if ln.startswith(f"| {name} |"))
        diff = 100 * (s["compressed"]["accuracy"] - s["dense"]["accuracy"])
        assert f"{diff:+.2f}" in row
    # one dense baseline trained for the seed, reused by the second run
    assert len(list((tmp_path / "cache" / "baselines").glob("*.safetensors"))) == 1
