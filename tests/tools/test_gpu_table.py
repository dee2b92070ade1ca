"""tools/gpu_table.py: the table of current GPU figures in docs/gpu.md, rendered from the bench
JSON in docs/bench/."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_table", ROOT / "tools" / "gpu_table.py")
gt = importlib.util.module_from_spec(_spec)
sys.modules["gpu_table"] = gt  # its dataclasses look their module up there
_spec.loader.exec_module(gt)


def test_docs_gpu_md_holds_the_tools_table(run_tool):
    doc = gt.DOC.read_text()
    assert gt.with_table(doc, gt.render()) == doc, "run python tools/gpu_table.py --write"
    run_tool("gpu_table.py", "--check")
    assert all((gt.BENCH / row.file).is_file() for row in gt.ROWS)


def _bench(tmp_path, ratio, paired):
    variant = {"ms": 5.0, "ratio": ratio, "rel_err": 0.0114, "plan_s": 2.0, "compile_s": 20.4}
    if paired is not None:
        variant.update(paired_ratio=paired, target=1.2, met=paired >= 1.2)
    data = {"date": "2026-12-04 13:08 UTC", "device": "GPU X", "torch": "2.11",
            "models": {"bert": {"fastest_dense": "dense_compiled_ro", "variants": {
                "dense_compiled_ro": {"ms": 6.5, "ratio": 1.0, "rel_err": 0.0113},
                "sk_bf16_2:4": variant}}}}
    (tmp_path / "run.json").write_text(json.dumps(data))


def test_a_row_shows_its_json_figures_and_judges_the_target_on_the_paired_ratio(
        tmp_path, monkeypatch):
    monkeypatch.setattr(gt, "BENCH", tmp_path)
    row = [gt.Row("run.json", "bert", "sk_bf16_2:4")]
    _bench(tmp_path, ratio=1.25, paired=1.18)  # sequentially over 1.2, paired under it
    line = gt.render(row).splitlines()[2]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells == ["BERT-large 8x512", "`sk_bf16_2:4`", "5.00", "6.50", "1.25x", "1.18x",
                     ">= 1.2: NOT met", "0.0114 (0.0113)", "22", "run, 2026-12-04"]
    _bench(tmp_path, ratio=1.1, paired=1.3)
    assert ">= 1.2: met" in gt.render(row)
    assert "Device: GPU X, torch 2.11." in gt.render(row)


def test_with_table_replaces_only_between_the_markers():
    doc = f"intro\n{gt.BEGIN}\nold\n{gt.END}\nrest\n"
    assert gt.with_table(doc, "new") == f"intro\n{gt.BEGIN}\nnew\n{gt.END}\nrest\n"
    with pytest.raises(ValueError, match="no table markers"):
        gt.with_table("no markers here", "new")


def test_check_fails_on_a_stale_table(tmp_path):
    doc = tmp_path / "gpu.md"
    doc.write_text(f"{gt.BEGIN}\nstale\n{gt.END}\n")
    assert gt.main(["--check", "--doc", str(doc)]) == 1
    assert gt.main(["--write", "--doc", str(doc)]) == 0
    assert gt.main(["--check", "--doc", str(doc)]) == 0
