"""Progress lines when the output is not a terminal (sparsekit.progress)."""

import io
import logging

import pytest

from sparsekit import progress as P


@pytest.fixture
def lines(monkeypatch):
    """The lines the ``sparsekit`` logger receives at INFO."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    P.LOG.addHandler(handler)
    monkeypatch.setattr(P.LOG, "level", logging.INFO)
    monkeypatch.delenv("SPARSEKIT_QUIET", raising=False)
    yield lambda: stream.getvalue().splitlines()
    P.LOG.removeHandler(handler)


def test_a_line_per_tenth_with_elapsed_and_eta(lines):
    ticks = iter(range(0, 1000, 3))  # each item takes 3 s
    items = list(P.progress_lines(range(20), "solve", total=20, clock=lambda: next(ticks)))
    assert items == list(range(20))
    got = lines()
    assert len(got) == 10 and got[-1] == "solve: 20/20 (100%), 1 min 0 s elapsed"
    assert got[0] == "solve: 2/20 (10%), 6.0 s elapsed, ETA 54 s"  # 3 s an item, 18 to go


def test_quiet_start_a_minute_at_most_and_a_resumed_loop(lines):
    ticks = iter([0, 1, 2, 3, 70, 71])  # start, then one tick per item
    list(P.progress_lines(range(5), "fit", total=1000, initial=995, every=1000,
                          clock=lambda: next(ticks)))
    # no line in the first 5 s; the 70 s tick is a minute after the start; the last item
    assert lines() == ["fit: 999/1000 (100%), 1 min 10 s elapsed, ETA 18 s",
                       "fit: 1000/1000 (100%), 1 min 11 s elapsed"]


def test_progress_off_a_terminal_logs_and_quiet_silences(lines, monkeypatch):
    monkeypatch.setattr(P, "QUIET_FIRST_S", 0.0)
    assert list(P.progress(range(3), desc="eval")) == [0, 1, 2]
    assert lines()[-1].startswith("eval: 3/3 (100%), ")
    before = len(lines())
    assert list(P.progress(range(3), quiet=True, desc="eval")) == [0, 1, 2]
    monkeypatch.setenv("SPARSEKIT_QUIET", "1")
    assert list(P.progress(range(3), desc="eval")) == [0, 1, 2]
    assert len(lines()) == before
