"""accelerate's two option objects: each bad field is refused when the object is built, with the
field and what it allows in the message; the objects are inert (frozen, the inductor dict
copied); accelerate takes them, refuses other types and the keywords they replaced, and runs
the same with the defaults spelled out as with nothing passed."""

import dataclasses

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit import _compat
from sparsekit.accel import CompileOptions, PlanOptions
from sparsekit.errors import UsageError


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "fastest"}, r"CompileOptions\.mode must be None or one of \('default', "
                          r"'reduce-overhead'"),
    ({"dynamic": "yes"}, r"CompileOptions\.dynamic must be True, False or None, got 'yes'"),
    ({"capture": 1}, r"CompileOptions\.capture must be True, False or None, got 1"),
    ({"clone_outputs": None}, r"CompileOptions\.clone_outputs must be True or False"),
    ({"warmup": "no"}, r"CompileOptions\.warmup must be True or False"),
    ({"backend": "no_such_backend"}, r"CompileOptions\.backend must be a registered "
                                     r"torch\.compile backend .*'no_such_backend'"),
    ({"inductor": ["triton.multi_kernel"]}, r"CompileOptions\.inductor must be a dict of "
                                            r"inductor option names"),
    ({"inductor": {"triton.bogus": 1}}, r"^CompileOptions\.inductor: Unexpected optimization "
                                        r"option triton\.bogus"),
    ({"inductor": {"triton.multi_kernel": 1}, "backend": "eager"},
     r"CompileOptions\.inductor: inductor options \['triton\.multi_kernel'\] need "
     r"backend='inductor'"),
    ({"capture": True, "mode": "reduce-overhead"}, r"CompileOptions\(capture=True\) .* needs "
                                                   r"a mode other than 'reduce-overhead'"),
])
def test_compile_options_refuse_bad_fields(kwargs, match):
    with pytest.raises(UsageError, match=match):
        CompileOptions(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"min_speedup": 0}, r"PlanOptions\.min_speedup must be a number > 0, got 0"),
    ({"min_speedup": -1.5}, r"PlanOptions\.min_speedup must be a number > 0, got -1\.5"),
    ({"min_speedup": float("nan")}, r"PlanOptions\.min_speedup must be a number > 0, got nan"),
    ({"min_speedup": "1.05"}, r"PlanOptions\.min_speedup must be a number > 0, got '1\.05'"),
    ({"min_speedup": True}, r"PlanOptions\.min_speedup must be a number > 0, got True"),
    ({"dense_precision": "fp4"}, r"PlanOptions\.dense_precision must be one of \('bf16', "),
    ({"fused_quant": 1}, r"PlanOptions\.fused_quant must be True or False, got 1"),
    ({"search_algs": "off"}, r"PlanOptions\.search_algs must be True or False"),
    ({"cache": None}, r"PlanOptions\.cache must be True or False, got None"),
    ({"siblings": "yes"}, r"PlanOptions\.siblings must be True or False"),
    ({"whole_model": "auto"}, r"PlanOptions\.whole_model must be True, False or None"),
    ({"decode_dense": "no"}, r"PlanOptions\.decode_dense must be True or False, got 'no'"),
    ({"decode_dense": None}, r"PlanOptions\.decode_dense must be True or False, got None"),
])
def test_plan_options_refuse_bad_fields(kwargs, match):
    with pytest.raises(UsageError, match=match):
        PlanOptions(**kwargs)


def test_options_are_frozen_and_keep_their_own_inductor_dict():
    opts = {"triton.multi_kernel": 1}
    c = CompileOptions(inductor=opts)
    opts["triton.multi_kernel"] = 0  # the caller's dict changes later: the options do not
    assert c.inductor == {"triton.multi_kernel": 1}
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.mode = "default"
    with pytest.raises(dataclasses.FrozenInstanceError):
        PlanOptions().min_speedup = 2.0
    assert PlanOptions(min_speedup=2).min_speedup == 2  # an int is a number
    assert sk.CompileOptions is CompileOptions and sk.PlanOptions is PlanOptions
    assert {"CompileOptions", "PlanOptions"} <= set(sk.__all__) & set(sk.accel.__all__)


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 96))
    sk.prune_(net.eval(), pattern="2:4", exclude=["3"])
    return net


def test_accelerate_refuses_other_types_and_the_replaced_keywords():
    x = torch.randn(4, 64)
    with pytest.raises(TypeError, match="compile must be True, False or a CompileOptions, got "
                                        "'yes'"):
        sk.accelerate(_net(), x, device="cpu", compile="yes")
    with pytest.raises(TypeError, match="plan must be a PlanOptions or None, got "
                                        r"\{'min_speedup': 2\.0\}"):
        sk.accelerate(_net(), x, device="cpu", plan={"min_speedup": 2.0})
    for old in ({"min_speedup": 1.1}, {"siblings": True}, {"backend": "eager"},
                {"plan_cache": False}, {"fuse": True}):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(old))}'"):
            sk.accelerate(_net(), x, device="cpu", **old)
    with pytest.raises(UsageError, match=r"CompileOptions\(capture=True\) needs a CUDA device"):
        sk.accelerate(_net(), x, device="cpu", compile=CompileOptions(capture=True))


def _same_run(a, b, x):
    ra, rb = a.report.to_dict(), b.report.to_dict()
    ra.pop("seconds"), rb.pop("seconds")
    assert ra == rb
    assert [type(m) for m in a.model.modules()] == [type(m) for m in b.model.modules()]
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


@pytest.mark.parametrize("precision, sparsity", [("fp8", "2:4"), ("int8", "dense"),
                                                 ("bf16", "2:4")])
def test_default_options_spelled_out_run_as_none_passed(precision, sparsity):
    x = torch.randn(8, 64)
    kw = dict(precision=precision, sparsity=sparsity, device="cpu")
    plain = sk.accelerate(_net(), x, compile=False, **kw)
    spelled = sk.accelerate(_net(), x, compile=False, plan=PlanOptions(), **kw)
    _same_run(plain, spelled, x)
    assert plain.compiled is False and plain.runner is plain.model and not plain.capture
    # compiled (eager backend: quick on CPU), every other field left to its default or
    # spelled out
    eager = CompileOptions(backend="eager")
    _compat.reset_compiled()  # each counts its own graphs (dynamo's cache would serve b's)
    a = sk.accelerate(_net(), x, compile=eager, **kw)
    _compat.reset_compiled()
    b = sk.accelerate(_net(), x, compile=CompileOptions(
        mode=None, dynamic=None, backend="eager", inductor=None, capture=None,
        clone_outputs=True, warmup=True), **kw)
    _same_run(a, b, x)
    assert a.compiled and a.options.backend == "eager" and a.options.capture is False


def test_plan_options_reach_the_plan():
    x = torch.randn(8, 64)
    fast = sk.accelerate(_net(), x, precision="bf16", device="cpu", compile=False,
                         plan=PlanOptions(dense_precision="fp8", min_speedup=1.5))
    assert {d.name: d.variant for d in fast.report.layers} == {
        "0": "bf16_2:4", "2": "bf16_2:4", "3": "fp8_dense"}
    assert fast.report.min_speedup == 1.5
    assert type(fast.model[3]).__name__ == "FP8Dense"


def test_without_warmup_the_first_call_compiles_and_runs_the_same():
    x = torch.randn(8, 64)
    _compat.reset_compiled()
    warm = sk.accelerate(_net(), x, device="cpu", compile=CompileOptions(backend="eager"))
    assert "compile" in warm.report.seconds and warm.report.compiles >= 1
    _compat.reset_compiled()
    before = _compat.compiled_graph_count()
    cold = sk.accelerate(_net(), x, device="cpu",
                         compile=CompileOptions(backend="eager", warmup=False))
    # accelerate compiled nothing: the example never ran through the compiled model
    assert "compile" not in cold.report.seconds
    assert _compat.compiled_graph_count() == before
    y = cold(x)
    assert _compat.compiled_graph_count() > before
    torch.testing.assert_close(y, warm(x), rtol=0, atol=0)
