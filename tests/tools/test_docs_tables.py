"""The generated blocks of README.md, docs/cli.md and docs/gpu.md equal what
tools/docs_tables.py gives now, and what it gives comes from the measurement files and the
registries."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import docs_tables  # noqa: E402

from sparsekit.run.cli import group_options  # noqa: E402
from sparsekit.run.config import choices  # noqa: E402


@pytest.mark.parametrize("name", list(docs_tables.BLOCKS))
def test_generated_block_is_up_to_date(name):
    path, make = docs_tables.BLOCKS[name]
    assert docs_tables.current(name) == make(), (
        f"{path.name}'s {name} block is out of date: python tools/docs_tables.py --write")


def test_groups_list_every_option_and_every_allowed_value():
    text = docs_tables.current("groups")
    for group in [p.name for p in (ROOT / "conf").iterdir() if p.is_dir()] + ["recipe"]:
        for option in group_options(group):
            assert f"- `{group}={option}`" in text, (group, option)
    for key, values in choices().items():
        assert f"- `{key}`: {', '.join(values)}" in text
    for option in ("model=hf", "data=text", "data=synthetic"):  # the ones the README missed
        assert option in text


def test_results_rows_come_from_the_json_files(tmp_path):
    """Change a figure in a copy of docs/ and the table changes with it; every row names a
    command listed under the table."""
    import shutil

    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs, ignore=shutil.ignore_patterns("*.png", "*.csv"))
    table = docs_tables.results_table(docs)
    llama = json.loads((docs / "small_llama_h200.json").read_text())
    after = llama["recipes"]["llm_sparsegpt_24"]["perplexity_after"]
    assert f"perplexity {after:.2f}" in table
    llama["recipes"]["llm_sparsegpt_24"]["perplexity_after"] = 123.456
    (docs / "small_llama_h200.json").write_text(json.dumps(llama))
    assert "perplexity 123.46" in docs_tables.results_table(docs)
    file, batch, way, _ = docs_tables.GEN_ROWS[-1]
    gen = json.loads((docs / "bench" / file).read_text())
    gen["generate"][batch]["ways"][way]["ratio"] = 9.876
    (docs / "bench" / file).write_text(json.dumps(gen))
    table = docs_tables.results_table(docs)
    assert "**9.88x**" in table
    assert (f"--batches {batch} --precisions {gen['args']['precisions']} "
            f"--dense {gen['args']['dense']}") in table
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    commands = [ln for ln in table.splitlines() if ln[:1].isdigit()]
    assert len(rows) == len(docs_tables.MNIST_ROWS + docs_tables.LLM_ROWS
                            + docs_tables.REAL_LLM_ROWS + docs_tables.SPEED_ROWS
                            + docs_tables.GEN_ROWS)
    real = json.loads((docs / "bench" / docs_tables.REAL_LLM).read_text())
    key = docs_tables.REAL_LLM_ROWS[-1][0]
    real["rows"][key]["ratio"]["man"] = 7.654
    (docs / "bench" / docs_tables.REAL_LLM).write_text(json.dumps(real))
    assert "**7.65x / " in docs_tables.results_table(docs)
    for row in rows:
        n = int(row.rstrip(" |").rsplit("(", 1)[1].rstrip(")"))
        assert 1 <= n <= len(commands)
    assert all("python tools/" in c for c in commands)


def test_check_mode_fails_on_a_stale_block(tmp_path, monkeypatch):
    page = tmp_path / "cli.md"
    page.write_text("x\n<!-- generated: groups (python tools/docs_tables.py --write) -->\nold\n"
                    "<!-- end generated: groups -->\ny\n")
    monkeypatch.setitem(docs_tables.BLOCKS, "groups", (page, lambda: "new"))
    monkeypatch.setitem(docs_tables.BLOCKS, "results", (page, lambda: "new"))
    monkeypatch.setattr(docs_tables, "ROOT", tmp_path)
    monkeypatch.delitem(docs_tables.BLOCKS, "results")
    monkeypatch.delitem(docs_tables.BLOCKS, "generation")
    assert docs_tables.main(["--check"]) == 1
    assert docs_tables.main(["--write"]) == 0
    assert page.read_text().split("\n")[2] == "new" and page.read_text().endswith("y\n")
    assert docs_tables.main(["--check"]) == 0


def test_gpu_generation_table_follows_its_json(tmp_path):
    """docs/gpu.md's generate() table reads each figure from its JSON, judges the target on the
    recorded ratio and numbers each row by a command listed under the table."""
    import shutil

    bench = tmp_path / "bench"
    shutil.copytree(ROOT / "docs" / "bench", bench)
    file, batch, way, _, target = next(r for r in docs_tables.GPU_GEN_ROWS if r[4])
    table = docs_tables.generation_table(bench)
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert len(rows) == len(docs_tables.GPU_GEN_ROWS)
    commands = [ln for ln in table.splitlines() if ln[:1].isdigit()]
    assert all(1 <= int(r.rstrip(" |").rsplit("(", 1)[1].rstrip(")")) <= len(commands)
               for r in rows)
    for ratio, verdict in ((target + 0.01, "met"), (target - 0.01, "not met")):
        gen = json.loads((bench / file).read_text())
        gen["generate"][batch]["ways"][way]["ratio"] = ratio
        (bench / file).write_text(json.dumps(gen))
        assert f"**{ratio:.2f}x** | " in docs_tables.generation_table(bench)
        assert f"| {target}x: {verdict} |" in docs_tables.generation_table(bench)


GENERATE_FILES = sorted({r[0] for r in docs_tables.GEN_ROWS + docs_tables.GPU_GEN_ROWS})


@pytest.mark.parametrize("file", GENERATE_FILES)
def test_generate_rows_command_reruns_the_recorded_options(file, tmp_path, tool_module):
    """bench_generate parses the command a generate row names into the options its JSON
    recorded (run here in smoke mode with no section, which only parses and records)."""
    import shlex

    recorded = json.loads((ROOT / "docs" / "bench" / file).read_text())["args"]
    words = shlex.split(docs_tables.generate_command(recorded))
    assert words[:2] == ["python", "tools/bench_generate.py"]
    res = tool_module("bench_generate").main([*words[2:], "--smoke", "--sections", "none",
                                              "--out", str(tmp_path / "g.json")])
    skip = {"sections", "smoke", "out", "jobs", "explore", "ms", "shapes"}  # not generate's
    assert {k: res["args"][k] for k in recorded if k not in skip} == \
        {k: v for k, v in recorded.items() if k not in skip}
    assert not any(res["args"][k] for k in res["args"].keys() - recorded.keys()
                   if k.startswith("inductor_"))  # options added since the run: off

