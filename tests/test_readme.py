"""README.md's and the docs pages' Python examples run as written, their links lead somewhere,
and CI runs the README's test command."""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# the pages whose examples are complete programs (gpu.md and distributed.md hold sketches)
PAGES = ["README.md", "docs/cli.md", "docs/api.md", "docs/llm.md", "docs/tensorboard.md"]
BLOCKS = [(page, i, code) for page in PAGES for i, code in
          enumerate(re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S))]


def test_readme_has_examples():
    assert [page for page, _, _ in BLOCKS].count("README.md") >= 2


@pytest.mark.parametrize("page,index,code", BLOCKS, ids=[f"{p}-{i}" for p, i, _ in BLOCKS])
def test_example_runs(page, index, code, tmp_path, monkeypatch):
    if code.lstrip().startswith("# requires: cuda") and not torch.cuda.is_available():
        pytest.skip("example needs a CUDA GPU")
    monkeypatch.chdir(tmp_path)
    # a reader runs an example in a fresh process: no compile cache or automatic-dynamic record
    # left by earlier tests (an example counting its compiles would see them)
    torch._dynamo.reset()
    from sparsekit.prune.channels import CHANNEL_CRITERIA
    from sparsekit.prune.criteria import CRITERIA
    from sparsekit.quant.formats import SCHEMES

    before = [(reg, set(reg.names())) for reg in (CRITERIA, CHANNEL_CRITERIA, SCHEMES)]
    try:
        exec(compile(code, f"{page} example {index}", "exec"), {"__name__": "__readme__"})
    finally:  # what an example registers (a toy criterion) stays in the example
        for reg, names in before:
            for name in set(reg.names()) - names:
                reg.unregister(name)


def test_quickstart_has_two_commands_and_ci_runs_the_test_one():
    quick = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", quick, flags=re.S)
    assert len(commands) == 2 and all(c.strip().count("\n") == 0 for c in commands)
    assert "<!-- test-command -->" in quick
    assert "README.md" in (ROOT / ".ci" / "run").read_text()


def test_readme_is_a_map_with_the_llm_path_on_its_first_screen():
    lines = README.splitlines()
    assert len(lines) <= 300
    first_screen = "\n".join(lines[:30])
    assert "Hugging Face" in first_screen and "model.path=" in first_screen
    # one spelling of the quantization choice: the group's option, not the schema key
    for page in PAGES:
        assert "quant.scheme=" not in (ROOT / page).read_text(), page


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_lead_to_files(page):
    path = ROOT / page
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
        assert (path.parent / target).exists(), f"{page} links to missing {target}"
