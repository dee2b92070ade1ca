import json

import pytest


@pytest.mark.slow
def test_smoke_table_matches_the_runs_which_are_reused_only_with_the_same_arguments(
        tmp_path, tool_module, capsys):
    """Each run's summary.json feeds one row; the diff column is run minus its seed's dense.
    A second sweep reuses the smoke runs as they are, but a full sweep into the same folder
    would not: the stored arguments differ, so the run is made again. The sweeps run in this
    process (the runs they make are CLI processes, as from the tool's command line)."""
    sweep = tool_module("seed_sweep")
    assert sweep.main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out
    res = json.loads((tmp_path / "seed_sweep.json").read_text())["runs"]
    assert list(res) == ["ptq_int8", "ptq_fp8"] and list(res["ptq_int8"]) == ["0"]
    for name, per_seed in res.items():
        s = json.loads((tmp_path / "runs" / f"{name}_s0" / "summary.json").read_text())
        assert per_seed["0"]["compressed"] == s["compressed"]["accuracy"]
        assert per_seed["0"]["dense"] == s["dense"]["accuracy"]
        row = next(ln for ln in stdout.splitlines() if ln.startswith(f"| {name} |"))
        diff = 100 * (s["compressed"]["accuracy"] - s["dense"]["accuracy"])
        assert f"{diff:+.2f}" in row
    # one dense baseline trained for the seed, reused by the second run
    assert len(list((tmp_path / "cache" / "baselines").glob("*.safetensors"))) == 1

    # the sweep again
    summary = tmp_path / "runs" / "ptq_int8_s0" / "summary.json"
    first = summary.stat().st_mtime_ns
    sweep.main(["--smoke", "--out-dir", str(tmp_path)])
    assert summary.stat().st_mtime_ns == first  # reused
    args = tmp_path / "runs" / "ptq_int8_s0" / "sweep_args.json"
    args.write_text(json.dumps(["something", "else"]))  # as if RUNS had changed
    sweep.main(["--smoke", "--out-dir", str(tmp_path)])
    assert summary.stat().st_mtime_ns != first  # made again
    assert "data.kwargs.num_samples=300" in json.loads(args.read_text())


@pytest.mark.slow
def test_recipes_table_gives_mean_and_range_per_recipe(tmp_path, tool_module, capsys):
    """``--recipes`` runs the README's MNIST-1D recipes (smoke: the first, one seed) and
    prints one row per recipe from its summaries."""
    sweep = tool_module("seed_sweep")
    assert sweep.main(["--smoke", "--recipes", "--out-dir", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out
    res = json.loads((tmp_path / "seed_sweep.json").read_text())["runs"]
    assert list(res) == ["mnist1d_cnn_24"]
    for name in res:
        s = json.loads((tmp_path / "runs" / f"{name}_s0" / "summary.json").read_text())
        assert s["recipe"] == name
        row = next(ln for ln in stdout.splitlines() if ln.startswith(f"| `{name}` |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        dense, comp = 100 * s["dense"]["accuracy"], 100 * s["compressed"]["accuracy"]
        assert cells[1:4] == [f"{dense:.1f}%", f"{comp:.1f}%", f"{comp - dense:+.1f}"]
        assert cells[5] == f"{s['compressed']['size_bytes']:,}"
