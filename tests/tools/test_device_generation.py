"""tools/device_generation.sh off the GPU: the shell parses, and a stage it does not know is
refused in one line naming the stages (exit 2), before anything runs."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "device_generation.sh"


def test_script_parses_and_refuses_an_unknown_stage(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    res = subprocess.run(["bash", str(SCRIPT), "nonsense"], capture_output=True, text=True,
                         env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert res.returncode == 2
    err = [line for line in res.stderr.splitlines() if "device_generation.sh" in line]
    assert len(err) == 1 and "unknown stage 'nonsense'" in err[0]
    for stage in ("kernels", "gen_bf16", "gen_fp8", "gen_b1", "gpu_tests"):
        assert stage in err[0]
