"""The lagged stop check (sparsekit/accel/lagged_stop.py): its decisions on scripted flags, and
an accelerated tiny Llama whose sequences end early at an EOS token generating exactly HF's
own sequences (per-step check) with it in place, the steps it ran past the end undone."""

import pytest
import torch

import sparsekit as sk
from sparsekit.accel import lagged_stop
from sparsekit.accel.lagged_stop import LaggedStopCheck
from test_decode_cpu import _tiny_llama


def _run(check, finished_at: list[int], length0: int):
    """Feed ``check`` one step at a time: step s (1-based) has every sequence finished when
    s >= finished_at (per row); returns the step at which it said stop."""
    rows = len(finished_at)
    for step in range(1, 100):
        unfinished = torch.tensor([int(step < f) for f in finished_at]).reshape(rows)
        if check(unfinished, torch.zeros(rows, dtype=torch.long), length0 + step):
            return step
    raise AssertionError("never stopped")


@pytest.mark.parametrize("lag", [0, 1, 2, 3])
def test_stops_lag_steps_late_and_undoes_them(lag):
    check = LaggedStopCheck(max_length=10 + 50, lag=lag)
    stop = _run(check, [5, 7], 10)  # every sequence finished from step 7
    assert stop == 7 + lag and check.finish() == lag


def test_max_length_reads_every_pending_flag():
    # every sequence finished at step 4; max length reached at step 5 (lag 3 not yet passed)
    check = LaggedStopCheck(max_length=10 + 5, lag=3)
    assert _run(check, [4], 10) == 5 and check.finish() == 1
    check = LaggedStopCheck(max_length=10 + 5, lag=3)  # never finished: stop at max, undo 0
    assert _run(check, [99], 10) == 5 and check.finish() == 0
    with pytest.raises(ValueError, match="lag must be >= 0"):
        LaggedStopCheck(5, lag=-1)


# "0" (the check off) is the plain loop test_decode_cpu's generate tests run; slow here
@pytest.mark.parametrize("lagged", ["1", pytest.param("0", marks=pytest.mark.slow)])
def test_generate_with_early_eos_equals_hf(lagged, monkeypatch):
    made = []
    real = LaggedStopCheck.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        made.append(self)
    monkeypatch.setattr(LaggedStopCheck, "__init__", spy)
    model, ref = _tiny_llama()
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))
    fast = sk.accelerate(model, {"input_ids": ids}, device="cpu",
                         compile=sk.CompileOptions(backend="eager"),
                         plan=sk.PlanOptions(lagged_stop=lagged == "1"))
    assert fast.plan.lagged_stop == (lagged == "1")
    free = ref.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    # EOS = row 0's third new token: row 0 ends there, row 1 at its first such token (or not)
    eos = int(free[0, 11 + 2])
    for batch in (ids[:1], ids):
        want = ref.generate(batch, max_new_tokens=12, do_sample=False, pad_token_id=0,
                            eos_token_id=eos)
        got = fast.generate(batch, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(got, want)
    # row 0 alone ends at its first EOS, within 3 new tokens (the tokens before may repeat it)
    end = int((free[0, 11:] == eos).nonzero()[0]) + 1
    assert end <= 3 and ref.generate(ids[:1], max_new_tokens=12, pad_token_id=0,
                                     eos_token_id=eos).shape[1] == 11 + end
    # batch 1 ended early: the loop ran LAG steps more and dropped them (0: checked each step)
    lag = lagged_stop.LAG if lagged == "1" else 0
    assert made and made[0].lag == lag and made[0].undo == lag
