"""The docs pages besides the README: docs/gpu.md's example and docs/architecture.md's kernel
walk-through run as written, and every script in tools/ has a test and a line in
docs/tools.md."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_EXAMPLES = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "gpu.md").read_text(), re.S)


@pytest.mark.parametrize("index", range(len(GPU_EXAMPLES)))
def test_gpu_md_example_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(GPU_EXAMPLES[index], f"docs/gpu.md example {index}", "exec"), {})


def test_architecture_md_kernel_walk_through_runs():
    """The walk-through registers a kernel, a layer runs it (CPU: its reference), and it is
    unregistered again."""
    (example,) = re.findall(r"```python\n(.*?)```",
                            (ROOT / "docs" / "architecture.md").read_text(), re.S)
    exec(compile(example, "docs/architecture.md example", "exec"), {})


def test_every_tool_has_a_test_and_a_line_in_docs_tools_md():
    listed = (ROOT / "docs" / "tools.md").read_text()
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    for tool in sorted((ROOT / "tools").glob("*.py")):
        assert f"| `{tool.name}` |" in listed, f"{tool.name}: no line in docs/tools.md"
        if tool.name != "llm_common.py":  # a module the two LLM tools import, tested with them
            assert tool.name in tests or tool.stem in tests, f"{tool.name}: no test"
    for name in re.findall(r"^\| `(\w+\.py)` \|", listed, re.M):
        assert (ROOT / "tools" / name).is_file(), f"docs/tools.md lists a missing {name}"
