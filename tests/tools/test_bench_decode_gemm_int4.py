"""tools/bench_decode_gemm_int4.py --smoke: the int4 decode GEMM benchmark's pipeline on CPU
(in process: main() with the arguments the command line takes)."""

import json

import pytest



@pytest.fixture
def bench(tool_module):
    return tool_module("bench_decode_gemm_int4")


def test_smoke_writes_rows_with_errors_bytes_and_speedups(bench, tmp_path):
    out = tmp_path / "int4.json"
    bench.main(["--smoke", "--out", str(out)])
    res = json.loads(out.read_text())
    assert [(r["shape"], r["M"]) for r in res["rows"]] == [
        ("tiny.a", 1), ("tiny.a", 4), ("tiny.b", 1), ("tiny.b", 4)]
    for row in res["rows"]:
        n, k, m = row["N"], row["K"], row["M"]
        v = row["variants"]
        assert set(v) == {"bf16_dense", "int4_dense", "int4_2:4"}
        assert v["bf16_dense"]["speedup"] == 1.0 and v["bf16_dense"]["rel_err"] < 1e-2
        # the int4 ops against the float32 product of the dequantized weight: bf16 rounding only
        assert v["int4_dense"]["rel_err"] < 1e-2 and v["int4_2:4"]["rel_err"] < 1e-2
        io = 2 * m * k + 2 * m * n
        assert v["bf16_dense"]["bytes"] == 2 * n * k + io
        assert v["int4_dense"]["bytes"] == n * k // 2 + n * (k // 128) * 4 + io
        assert v["int4_2:4"]["bytes"] == n * k // 4 + n * k // 8 + n * (k // 128) * 4 + io
        assert all(r["us"] > 0 and r["weight_copies"] == 1 for r in v.values())
    assert set(res["summary"]) == {f"M{m}.{v}.{s}" for m in (1, 4)
                                   for v in ("int4_dense", "int4_2:4")
                                   for s in ("speedup_geomean", "pct_bound_mean")}


def test_unknown_shape_is_one_line(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit, match="--shapes: unknown"):
        bench.main(["--out", str(tmp_path / "x.json"), "--shapes", "llama3-8b.o,nope"])
