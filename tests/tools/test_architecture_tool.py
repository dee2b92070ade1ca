import json


def test_smoke_reports_the_package_shape(tmp_path, run_tool):
    out = tmp_path / "shape.json"
    done = run_tool("architecture.py", "--no-time", "--json", out)
    shape = json.loads(out.read_text())
    assert shape["import_cycles"] == [] and shape["upward_imports"] == []
    assert shape["lines"] == sum(shape["lines_per_module"].values()) > 5000
    assert all(n > 80 for _, n in shape["functions_over_80_lines"])
    assert "import cycles: 0" in done.stdout
