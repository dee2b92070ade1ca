"""A GPU clock and power log beside a benchmark: ``nvidia-smi`` sampling every 100 ms into a CSV,
and the mean SM clock, power and throttle reasons over any wall-clock span of it.

Why: on the H200 the whole-model rows run at the card's power cap, and its SM clock falls as a
run goes on (run 29 of journal/gpu.md: 1581 MHz while the first dense row was timed, 1501-1506 MHz
30-50 s later); a compute-bound dense model's time follows the clock, a 2:4 model's
much less. A row's speed means little without the clock it ran at.

    log = GpuLog("out/gpu_clocks.csv").start()
    t0 = time.time(); work(); t1 = time.time()
    span_stats(read_log(log.path), t0, t1)   # {"samples": ..., "sm_mhz": ..., ...}
    log.stop()

A bench_models JSON and the log written beside it, read back (the clock of every row):

    python tools/gpu_log.py journal/data/bench_models_run29_llama32_bf16_clocks.json \
        journal/data/bench_models_run29_clocks.csv --tz UTC
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import subprocess
from pathlib import Path

FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


class GpuLog:
    """``nvidia-smi`` writing one CSV line per ``interval_ms`` to ``path`` until :meth:`stop`
    (``command`` replaces nvidia-smi's command line, for tests)."""

    def __init__(self, path: str | Path, interval_ms: int = 100,
                 command: list[str] | None = None):
        self.path = Path(path)
        self.command = command or ["nvidia-smi", f"--query-gpu={FIELDS}",
                                   "--format=csv,noheader", "-lms", str(interval_ms)]
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def available() -> bool:
        return shutil.which("nvidia-smi") is not None

    def start(self) -> GpuLog:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as out:  # the child keeps its own handle
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.DEVNULL)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None


def _number(field: str) -> float:
    return float(field.split()[0])


def read_log(path: str | Path, tz: datetime.tzinfo | None = None) -> list[tuple]:
    """The samples of a log written by :class:`GpuLog`: ``(unix time, SM MHz, memory MHz, W,
    deg C, throttle reasons)``. nvidia-smi writes local time without a zone: ``tz`` is the
    zone it was written in (default: this machine's, as when the log is read where it is
    written). Lines that are not samples (a partial last line, "[N/A]" values) are skipped."""
    samples = []
    for line in Path(path).read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 6:
            continue
        try:
            when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
            when = when.replace(tzinfo=tz) if tz is not None else when
            samples.append((when.timestamp(), _number(parts[1]), _number(parts[2]),
                            _number(parts[3]), _number(parts[4]), parts[5]))
        except ValueError:
            continue
    return samples


def span_stats(samples: list[tuple], t0: float, t1: float) -> dict | None:
    """Mean SM clock (MHz), mean power (W), the highest temperature and the throttle reasons
    seen among the samples taken between unix times ``t0`` and ``t1``; None if there are none
    (a span shorter than the sampling interval)."""
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if not inside:
        return None
    return {"samples": len(inside),
            "sm_mhz": round(statistics.mean(s[1] for s in inside), 1),
            "watts": round(statistics.mean(s[3] for s in inside), 1),
            "max_temp_c": max(s[4] for s in inside),
            "throttle": sorted({s[5] for s in inside})}


def blocks_stats(samples: list[tuple], blocks: list[list]) -> dict[str, dict]:
    """:func:`span_stats` over all of the paired blocks of each side (``"ref"``, ``"var"``;
    blocks as :func:`sparsekit.accel.planner.time_paired` records them: ``[side, t0, t1, ms]``)."""
    out = {}
    for side in ("ref", "var"):
        inside = [s for b in blocks if b[0] == side for s in samples if b[1] <= s[0] <= b[2]]
        if inside:
            out[side] = span_stats(inside, float("-inf"), float("inf"))
    return out


def add_clocks(res: dict, samples: list[tuple], after_s: float = 1.0) -> None:
    """Each timed row of a ``tools/bench_models.py`` result the GPU clock from the log: mean SM
    clock, power and throttle reasons while its calls were timed (``clocks["timed"]``), in the
    ``after_s`` seconds after them (``clocks["after"]``: where the bench's one profiled call
    runs) and over its paired blocks, each side (``clocks["ref"]``, the dense way, and
    ``clocks["var"]``). A span between two samples gets no entry."""
    for entry in res["models"].values():
        for row in entry["variants"].values():
            clocks = {}
            if "timed_at" in row:
                t0, t1 = row["timed_at"]
                clocks["timed"] = span_stats(samples, t0, t1)
                clocks["after"] = span_stats(samples, t1, t1 + after_s)
            if "paired_blocks" in row:
                clocks.update(blocks_stats(samples, row["paired_blocks"]))
            clocks = {k: c for k, c in clocks.items() if c}
            if clocks:
                row["clocks"] = clocks


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="the GPU clock of every row of a bench_models "
                                 "JSON, from the nvidia-smi log written beside it")
    ap.add_argument("bench_json")
    ap.add_argument("log_csv")
    ap.add_argument("--tz", default=None, help="the log's time zone: UTC or local (default)")
    args = ap.parse_args(argv)
    if args.tz not in (None, "UTC", "local"):
        raise SystemExit(f"--tz: expected UTC or local, got {args.tz!r}")
    tz = datetime.timezone.utc if args.tz == "UTC" else None
    res = json.loads(Path(args.bench_json).read_text())
    add_clocks(res, read_log(args.log_csv, tz=tz))
    for model, entry in res["models"].items():
        for name, row in entry["variants"].items():
            for part, c in row.get("clocks", {}).items():
                ms = row.get("ms") if part in ("timed", "after") else None
                print(f"{model} {name} {part}: SM {c['sm_mhz']:.0f} MHz, {c['watts']:.0f} W, "
                      f"{c['samples']} samples, throttle {' '.join(c['throttle'])}"
                      + (f" (row {ms:.3f} ms)" if ms is not None and part == "timed" else ""))
    return res


if __name__ == "__main__":
    main()
