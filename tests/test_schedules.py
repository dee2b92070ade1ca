import pytest

import sparsekit as sk


def zhu_gupta(t, t0, n, dt, s_i=0.0, s_f=1.0):
    return s_f + (s_i - s_f) * (1 - (t - t0) / (n * dt)) ** 3


@pytest.mark.parametrize("t", [100, 200, 300, 500, 800, 1000])
def test_cubic_matches_zhu_gupta_formula(t):
    sched = sk.Cubic(start=100, end=1000, every=100)
    assert sched.progress(t) == pytest.approx(zhu_gupta(t, 100, 9, 100))


def test_cubic_holds_between_updates_and_saturates():
    sched = sk.Cubic(start=0, end=1000, every=100)
    assert sched.progress(150) == sched.progress(100)
    assert sched.progress(99) == 0.0
    assert sched.progress(5000) == 1.0


def test_linear_and_oneshot():
    lin = sk.Linear(start=10, end=50, every=10)
    assert [lin.progress(t) for t in (0, 10, 25, 30, 50)] == [0.0, 0.0, 0.25, 0.5, 1.0]
    assert sk.OneShot(step=3).progress(2) == 0.0 and sk.OneShot(step=3).progress(3) == 1.0


@pytest.mark.parametrize("cls", [sk.Linear, sk.Cubic])
def test_progress_monotone(cls):
    sched = cls(start=7, end=333, every=13)
    values = [sched.progress(t) for t in range(0, 400)]
    assert values == sorted(values) and values[-1] == 1.0


def test_end_before_start_rejected():
    with pytest.raises(ValueError, match="end .* before its start"):
        sk.Cubic(start=100, end=50, every=10)
    with pytest.raises(ValueError, match="every"):
        sk.Linear(start=0, end=50, every=0)
