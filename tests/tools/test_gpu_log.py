"""tools/gpu_log.py: the nvidia-smi clock log beside a benchmark, read back against a recorded
H200 log (run 29, 2026-12-04) and a plain csv reference; bench_models' ``--gpu-log``."""

import csv
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_log  # noqa: E402

RUN29 = ROOT / "journal" / "data" / "bench_models_run29_clocks.csv"
RUN29_JSON = ROOT / "journal" / "data" / "bench_models_run29_llama32_bf16_clocks.json"
UTC = datetime.timezone.utc


def reference_mean_sm(path: Path, t0: float, t1: float) -> tuple[int, float]:
    """(samples, mean SM MHz) between two unix times, read with the csv module."""
    clocks = []
    with open(path) as f:
        for row in csv.reader(f):
            when = datetime.datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f")
            if t0 <= when.replace(tzinfo=UTC).timestamp() <= t1:
                clocks.append(float(row[1].split()[0]))
    return len(clocks), statistics.mean(clocks)


def test_spans_of_a_recorded_h200_log_match_a_plain_reading():
    samples = gpu_log.read_log(RUN29, tz=UTC)
    assert len(samples) > 1000
    rows = json.loads(RUN29_JSON.read_text())["models"]["llama_causal"]["variants"]
    for name in ("dense_compiled_ro", "sk_bf16_2:4", "dense_recheck"):
        t0, t1 = rows[name]["timed_at"]
        got = gpu_log.span_stats(samples, t0, t1)
        n, mean = reference_mean_sm(RUN29, t0, t1)
        assert got["samples"] == n > 10
        assert got["sm_mhz"] == pytest.approx(mean, abs=0.05)
        assert got["throttle"] == ["0x0000000000000004"] or "0x0000000000000004" in \
            got["throttle"]  # the power cap, throughout
    # the drift the paired timing removes: the first dense row was timed at a higher clock
    # than the paired blocks and the recheck
    first = gpu_log.span_stats(samples, *rows["dense_compiled_ro"]["timed_at"])["sm_mhz"]
    paired = gpu_log.blocks_stats(samples, rows["sk_bf16_2:4"]["paired_blocks"])
    recheck = gpu_log.span_stats(samples, *rows["dense_recheck"]["timed_at"])["sm_mhz"]
    assert first > paired["ref"]["sm_mhz"] + 50 and first > recheck + 50
    # blocks_stats pools the samples of every block of one side
    ref_blocks = [b for b in rows["sk_bf16_2:4"]["paired_blocks"] if b[0] == "ref"]
    pooled = [s[1] for b in ref_blocks for s in samples if b[1] <= s[0] <= b[2]]
    assert paired["ref"]["samples"] == len(pooled)
    assert paired["ref"]["sm_mhz"] == pytest.approx(statistics.mean(pooled), abs=0.05)
    # a span between two samples has none
    assert gpu_log.span_stats(samples, samples[0][0] + 0.001, samples[0][0] + 0.002) is None


def test_log_lines_that_are_not_samples_are_skipped(tmp_path):
    log = tmp_path / "log.csv"
    log.write_text("2026/12/04 05:45:00.100, 1500 MHz, 3201 MHz, 600.00 W, 55, 0x4\n"
                   "2026/12/04 05:45:00.200, [N/A], 3201 MHz, 600.00 W, 55, 0x4\n"
                   "2026/12/04 05:45:00.3")
    samples = gpu_log.read_log(log, tz=UTC)
    assert len(samples) == 1 and samples[0][1:5] == (1500.0, 3201.0, 600.0, 55.0)
    assert samples[0][0] == datetime.datetime(2026, 12, 4, 5, 45, 0, 100000,
                                              tzinfo=UTC).timestamp()


def test_the_logger_process_writes_and_stops(tmp_path):
    line = "2026/12/04 05:45:00.%03d, 1500 MHz, 3201 MHz, 600.00 W, 55, 0x4"
    fake = [sys.executable, "-c", "import time\nfor i in range(1000):\n"
            f"    print({line!r} % i, flush=True); time.sleep(0.01)"]
    log = gpu_log.GpuLog(tmp_path / "sub" / "clocks.csv", command=fake).start()
    proc = log.proc
    deadline = time.time() + 30
    while len(gpu_log.read_log(log.path)) < 3 and time.time() < deadline:
        time.sleep(0.05)
    log.stop()
    assert proc.poll() is not None and log.proc is None  # stopped, not left running
    assert len(gpu_log.read_log(log.path)) >= 3


def test_bench_rows_get_their_clocks():
    import bench_models as bm

    samples = [(100.0 + i / 10, 1900.0 - i, 3201.0, 600.0, 50.0, "0x4") for i in range(100)]
    done = {"ms": 1.0, "rel_err": 0.01, "compile_s": 1.0, "plan_s": 0.0, "compiles": 1}
    res = {"models": {"m": {"variants": {
        "dense": {**done, "timed_at": [100.0, 101.0]},
        "sk": {**done, "timed_at": [102.0, 103.0],
               "paired_blocks": [["ref", 104.0, 104.5, 1.0], ["var", 104.6, 105.0, 1.0],
                                 ["var", 105.1, 105.5, 1.0], ["ref", 105.6, 106.0, 1.0]]},
        "short": {**done, "timed_at": [100.01, 100.02]},  # between two samples
        "broken": {"error": "x"}}}}}
    gpu_log.add_clocks(res, samples)
    v = res["models"]["m"]["variants"]
    assert v["dense"]["clocks"]["timed"]["samples"] == 11
    assert v["dense"]["clocks"]["timed"]["sm_mhz"] == pytest.approx(1895.0)
    ref = [s[1] for s in samples if 104.0 <= s[0] <= 104.5 or 105.6 <= s[0] <= 106.0]
    assert v["sk"]["clocks"]["ref"]["sm_mhz"] == pytest.approx(statistics.mean(ref), abs=0.05)
    var = [s for s in samples if 104.6 <= s[0] <= 105.0 or 105.1 <= s[0] <= 105.5]
    assert v["sk"]["clocks"]["var"]["samples"] == len(var) >= 8
    assert "clocks" not in v["broken"] and "timed" not in v["short"]["clocks"]
    # the second after the timed calls (where the bench's profiled call runs)
    after = [s[1] for s in samples if 101.0 <= s[0] <= 102.0]
    assert v["dense"]["clocks"]["after"]["sm_mhz"] == pytest.approx(statistics.mean(after),
                                                                   abs=0.05)
    assert "| GPU clock (--gpu-log) |" in bm.to_markdown(
        {"device": "d", "torch": "t", "date": "now", "command": "c",
         "models": {"m": {"label": "m", "variants": v}}})


@pytest.mark.skipif(gpu_log.GpuLog.available(), reason="nvidia-smi is on this machine")
def test_gpu_log_without_nvidia_smi_is_one_line():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_models.py"), "--smoke",
                           "--gpu-log", "--models", "vit", "--out-dir", "/nonexistent/x"],
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "--gpu-log: nvidia-smi not found on PATH; run without --gpu-log"]


def test_bench_models_with_a_gpu_log_end_to_end(tmp_path, monkeypatch):
    """``--gpu-log`` on the CPU smoke run, nvidia-smi replaced by a writer of samples stamped
    with this machine's local time (as nvidia-smi stamps them): every timed row gets the clock
    of its own span, the log process is stopped, the markdown has the clock table."""
    import bench_models as bm

    writer = ("import datetime, time\nfor i in range(100000):\n"
              "    now = datetime.datetime.now().strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]\n"
              "    print(f'{now}, {1000 + i % 7} MHz, 3201 MHz, 500.00 W, 50, 0x4', flush=True)\n"
              "    time.sleep(0.001)")
    started = []

    class FakeLog(gpu_log.GpuLog):
        def __init__(self, path, interval_ms=100, command=None):
            super().__init__(path, interval_ms, [sys.executable, "-c", writer])
            started.append(self)

    monkeypatch.setattr(bm.gpu_log, "GpuLog", FakeLog)
    monkeypatch.setattr(FakeLog, "available", staticmethod(lambda: True))
    res = bm.main(["--smoke", "--gpu-log", "--models", "vit", "--variants", "sk_bf16_2:4",
                   "--out-dir", str(tmp_path), "--cache-dir", str(tmp_path / "cache")])
    assert res["gpu_log"] == "gpu_clocks.csv" and (tmp_path / "gpu_clocks.csv").exists()
    assert started and started[0].proc is None  # stopped at the end
    v = res["models"]["vit"]["variants"]
    row = v["sk_bf16_2:4"]
    assert {"ref", "var"} <= set(row["clocks"])  # 8 blocks a side: tens of ms each
    for c in row["clocks"].values():  # "timed" (3 calls here) may fall between samples
        assert c["samples"] >= 1 and 1000 <= c["sm_mhz"] <= 1006 and c["throttle"] == ["0x4"]
    saved = json.loads((tmp_path / "bench_models.json").read_text())
    assert saved["models"]["vit"]["variants"]["sk_bf16_2:4"]["clocks"] == row["clocks"]
    assert "| GPU clock (--gpu-log) |" in (tmp_path / "bench_models.md").read_text()


def test_the_command_line_reads_a_bench_json_beside_its_log(capsys):
    """``python tools/gpu_log.py BENCH_JSON LOG --tz UTC`` on run 29 (its JSON and clock log
    in journal/data/): the first dense row timed near 1581 MHz, the profiled call after it at
    the boost clock, the paired blocks near 1500 MHz."""
    res = gpu_log.main([str(RUN29_JSON), str(RUN29), "--tz", "UTC"])
    v = res["models"]["llama_causal"]["variants"]
    first = v["dense_compiled_ro"]["clocks"]
    assert first["timed"]["sm_mhz"] == pytest.approx(1580.9, abs=0.1)
    assert first["after"]["sm_mhz"] > first["timed"]["sm_mhz"] + 200  # rising to the boost
    paired = v["sk_bf16_2:4"]["clocks"]
    assert paired["ref"]["sm_mhz"] < 1530 and paired["var"]["sm_mhz"] < 1530
    out = capsys.readouterr().out
    assert "llama_causal dense_compiled_ro timed: SM 1581 MHz" in out
    with pytest.raises(SystemExit):
        gpu_log.main([str(RUN29_JSON), str(RUN29), "--tz", "Mars"])
