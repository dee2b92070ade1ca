"""README.md's Python examples run as written, and CI runs the README's test command."""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_examples():
    assert BLOCKS, "README.md has no python examples"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, tmp_path, monkeypatch):
    code = BLOCKS[index]
    if code.lstrip().startswith("# requires: cuda") and not torch.cuda.is_available():
        pytest.skip("example needs a CUDA GPU")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"README.md example {index}", "exec"), {"__name__": "__readme__"})


def test_quickstart_has_two_commands_and_ci_runs_the_test_one():
    quick = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", quick, flags=re.S)
    assert len(commands) == 2 and all(c.strip().count("\n") == 0 for c in commands)
    assert "<!-- test-command -->" in quick
    assert "README.md" in (ROOT / ".ci" / "run").read_text()
