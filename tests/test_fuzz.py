"""Property-based fuzzing (hypothesis) of the public API, the checkpoint reader and the command
line. Every generated case ends in one of two ways:

- a :class:`sparsekit.errors.SparsekitError` whose message names the offending input (an
  argument name, the layer, the option or the file), or
- a correct result, checked by a property (sparsity reached, N:M pattern holds, thresholds
  respected, state_dict keys unchanged, quantized output close to the float one, ...).

Anything else (a KeyError, IndexError, RuntimeError or re.error from inside torch or the
standard library, a silently wrong result, a marker file from a payload) fails the test.
Tiny models and ``max_examples`` keep the whole file well under a minute on two CPU cores.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import sparsekit as sk
from sparsekit.run.cli import check_overrides, register_configs
from sparsekit.errors import SparsekitError

COUNTS: Counter = Counter()  # (property, "error" | "ok") -> cases
# no shrink phase: composing configs and tracing models make shrinking take minutes; the
# failing case is printed as generated (with its draws), which is enough to reproduce it
FAST = settings(deadline=None, database=None, print_blob=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def outcome(prop: str, fn, names: tuple[str, ...]):
    """Run one case: returns fn()'s result, or None after a SparsekitError whose message
    names one of ``names``. Any other exception propagates (and fails the case)."""
    try:
        result = fn()
    except SparsekitError as e:
        msg = str(e)
        assert msg and "\n" not in msg.strip(), msg
        assert any(n in msg for n in names), f"{msg!r} names none of {names}"
        COUNTS[prop, "error"] += 1
        return None
    COUNTS[prop, "ok"] += 1
    return result


# ---------------------------------------------------------------------------------------------
# models and batches


def make_model(kind: str) -> nn.Module:
    if kind == "conv":
        return nn.Sequential(nn.Conv1d(4, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32, 4))
    dims = {"mlp8": (8, 16, 4), "mlp6": (6, 8, 2), "mlp16": (16, 12, 4)}[kind]
    return nn.Sequential(nn.Linear(dims[0], dims[1]), nn.ReLU(), nn.Linear(dims[1], dims[2]))


def input_shape(kind: str) -> tuple[int, ...]:
    return {"conv": (4, 6), "mlp8": (8,), "mlp6": (6,), "mlp16": (16,)}[kind]


def batches(kind: str, how: str):
    shape = input_shape(kind)
    good = [torch.randn(3, *shape) for _ in range(2)]
    if how == "good":
        return good
    if how == "wrong_shape":
        return [torch.randn(3, *shape[:-1], shape[-1] + 1)]
    if how == "nan":
        x = torch.randn(3, *shape)
        x[0].view(-1)[0] = float("nan")
        return [x]
    if how == "empty":
        return []
    if how == "tensor":
        return good[0]
    if how == "pairs":
        return [(x, torch.zeros(3)) for x in good]
    return None


MODELS = st.sampled_from(["mlp8", "mlp6", "mlp16", "conv"])
SELECT = st.sampled_from(["*"] * 8 + ["0", "re:[0-9]", ["0", "*"], [], None, "re:[", "re:(",
                                       "nope", 3, [b"0"]])
EXCLUDE = st.sampled_from([()] * 8 + [None, "0", "re:.*", "re:[", "nope"])
CALIB = st.sampled_from(["good"] * 10 + ["wrong_shape", "nan", "empty", "none", "tensor",
                                         "pairs"])


@st.composite
def schedules(draw, valid: bool = False):
    """A schedule factory: valid schedules, or (unless ``valid``) invalid arguments/objects."""
    kinds = ["none", "oneshot", "linear", "cubic"] + ([] if valid else ["bad_args", "bad_object"])
    kind = draw(st.sampled_from(kinds))
    if kind == "none":
        return lambda: None
    if kind == "bad_object":
        bad = draw(st.sampled_from(["linear", 3, object()]))
        return lambda: bad
    if kind == "bad_args":
        cls = draw(st.sampled_from([sk.Linear, sk.Cubic]))
        args = draw(st.lists(st.sampled_from([-1, 0, 1.5, True, "3", None, 2]), min_size=3,
                             max_size=3))
        return lambda: cls(*args)
    start = draw(st.integers(0, 3))
    if kind == "oneshot":
        return lambda: sk.OneShot(step=start)
    end, every = start + draw(st.integers(0, 3)), draw(st.integers(1, 3))
    cls = sk.Linear if kind == "linear" else sk.Cubic
    return lambda: cls(start, end, every)


def check_pruned(model: nn.Module, report, pattern, criterion, scope, sparsity, before):
    """The properties a successful pruning must have."""
    assert list(model.state_dict()) == list(before)  # plain module, same keys
    assert not any(type(m).__name__.startswith("Parametrized") for m in model.modules())
    layers = {n: s for n, s in report.layers.items() if s.skipped is None}
    for name, s in report.layers.items():
        w = model.get_submodule(name).weight.detach()
        assert s.numel == w.numel() and s.zeros == int((w == 0).sum()), name  # report is true
    if not layers:
        return
    if pattern not in ("unstructured",):
        n, m = (int(v) for v in pattern.split(":"))
        for name in layers:
            w = model.get_submodule(name).weight.detach()
            groups = (w.reshape(w.shape[0], -1, m) != 0).sum(-1)
            assert bool((groups <= n).all()), f"{name}: more than {n} of {m} kept"
        return

    def level_of(name: str) -> float:
        if isinstance(sparsity, dict):
            from sparsekit.nn.select import name_matches
            return next(v for p, v in sparsity.items() if name_matches(name, p))
        return float(sparsity)

    if scope == "global" and criterion == "magnitude":
        total = sum(s.numel for s in layers.values())
        zeros = sum(s.zeros for s in layers.values())
        assert abs(zeros - level_of(next(iter(layers))) * total) <= 1
        kept = torch.cat([model.get_submodule(n).weight.detach().abs().flatten() for n in layers])
        orig = torch.cat([before[f"{n}.weight"].abs().flatten() for n in layers])
        if zeros and zeros < total:  # magnitude: every pruned weight was no larger than any kept
            assert orig[kept == 0].max() <= orig[kept != 0].min()
        return
    for name, s in layers.items():
        level = level_of(name)
        cols = s.numel // model.get_submodule(name).weight.shape[0]
        slack = 1 if criterion == "magnitude" else s.numel / cols * 0.5 + 1
        assert abs(s.zeros - level * s.numel) <= slack, (name, s.zeros, level, s.numel)
        if criterion == "magnitude" and 0 < s.zeros < s.numel:
            w0 = before[f"{name}.weight"].abs().flatten()
            w = model.get_submodule(name).weight.detach().flatten()
            assert w0[w == 0].max() <= w0[w != 0].min()


@st.composite
def valid_pruner_args(draw):
    """Arguments every Pruner must accept, with a schedule it must complete."""
    kind = draw(MODELS)
    pattern = draw(st.sampled_from(["unstructured", "2:4", "1:4", "4:8", "1:2"]))
    criterion = draw(st.sampled_from(["magnitude", "wanda", "sparsegpt"]))
    nm = pattern != "unstructured"
    if nm:
        sparsity = None
    elif draw(st.booleans()):
        sparsity = draw(st.floats(0, 0.95))
    else:
        sparsity = {"re:0": draw(st.floats(0, 0.95)), "*": draw(st.floats(0, 0.95))}
    scope = "layer" if criterion != "magnitude" or isinstance(sparsity, dict) else draw(
        st.sampled_from(["layer", "global"]))
    if criterion == "wanda" and nm:
        scope = draw(st.sampled_from(["layer", "global"]))
    schedule = draw(schedules(valid=True))
    if criterion == "sparsegpt":
        start = draw(st.integers(0, 2))
        schedule = (lambda: sk.OneShot(step=start)) if draw(st.booleans()) else (lambda: None)
    include = draw(st.sampled_from(["*", "0", "re:[0-9]+", ["0", "*"]]))
    exclude = draw(st.sampled_from([(), [], None]))
    return dict(kind=kind, sparsity=sparsity, pattern=pattern, criterion=criterion, scope=scope,
                schedule=schedule, include=include, exclude=exclude, calib="good")


def run_pruner(model, a, live):
    sched = a["schedule"]()
    pruner = live["pruner"] = sk.Pruner(
        model, a["sparsity"], pattern=a["pattern"], criterion=a["criterion"], scope=a["scope"],
        schedule=sched, include=a["include"], exclude=a["exclude"],
        calibration=batches(a["kind"], a["calib"]))
    end = getattr(sched, "end", getattr(sched, "step", 0)) if sched is not None else 0
    for step in range(int(end) + 1):
        live["masks"] = {n: m.clone() for n, m in pruner.masks.items()}
        pruner.step(step)
    report = pruner.report()
    pruner.finalize()
    return report


@settings(FAST, max_examples=40)
@given(args=valid_pruner_args())
def test_fuzz_pruner_valid_arguments_reach_their_target(args):
    torch.manual_seed(0)
    model = make_model(args["kind"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = outcome("Pruner (valid)", lambda: run_pruner(model, args, {}), ())
    check_pruned(model, report, args["pattern"], args["criterion"], args["scope"],
                 args["sparsity"], before)


INVALID = {  # argument -> bad values, and the words an error about it must contain
    "sparsity": ([float("nan"), float("inf"), -0.1, 1.0, 1.5, True, "0.5", {"nope": 0.5},
                  {"*": 1.5}], ("sparsity",)),
    "pattern": (["3:2", "0:4", "2:0", "4:4", "", "2:4:8", "a:b", None, 24, "-1:4"],
                ("pattern",)),
    "criterion": (["random", None, "Magnitude", 3], ("criterion",)),
    "scope": (["all", None, "Layer"], ("scope",)),
    "schedule": ([lambda: "linear", lambda: 3, lambda: sk.Linear(3, 1, 1),
                  lambda: sk.Cubic(0, 4, 0), lambda: sk.OneShot(step=-1),
                  lambda: sk.Linear(True, 2, 1), lambda: sk.Linear(0, "4", 1)],
                 ("schedule",)),
    "include": (["re:[", "re:(", "nope", 3, [b"0"], ["0", 7]], ("include", "re:", "pattern")),
    "exclude": (["re:[", "nope", 5], ("exclude", "re:", "pattern")),
    "calib": (["wrong_shape", "nan", "empty", "none", "tensor", "pairs"],
              ("calibration", "batch", "layer")),
}


@settings(FAST, max_examples=60)
@given(args=valid_pruner_args(), arg=st.sampled_from(sorted(INVALID)), data=st.data())
def test_fuzz_pruner_one_bad_argument_is_named(args, arg, data):
    torch.manual_seed(0)
    values, names = INVALID[arg]
    bad = data.draw(st.sampled_from(values), label=arg)
    if arg == "calib":  # a criterion that calibrates, on layers it certainly prunes
        args.update(criterion=data.draw(st.sampled_from(["wanda", "sparsegpt"])), scope="layer",
                    pattern="unstructured", sparsity=0.5, schedule=lambda: None)
    if arg == "sparsity" and args["pattern"] != "unstructured":
        args["pattern"], args["scope"] = "unstructured", "layer"
    args[arg] = bad
    model = make_model(args["kind"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    live = {}
    if arg == "schedule" and not callable(bad):
        args["schedule"] = lambda: bad
    report = outcome("Pruner (one bad argument)", lambda: run_pruner(model, args, live), names)
    assert report is None, f"{arg}={bad!r} was accepted"
    if "pruner" not in live:  # refused at construction: the model is as it was
        assert list(model.state_dict()) == list(before)
        assert not any(type(m).__name__.startswith("Parametrized") for m in model.modules())
        torch.testing.assert_close(dict(model.state_dict()), before, equal_nan=True)
    else:  # a refused update leaves the masks where they were
        masks = live["pruner"].masks
        assert all(torch.equal(masks[n], m) for n, m in live["masks"].items())


@settings(FAST, max_examples=25)
@given(kind=MODELS, scheme=st.sampled_from(["int8_weight_only", "int8", "fp8"] * 3 +
                                           ["int4", "", None, 8]),
       include=SELECT, exclude=EXCLUDE, calib=CALIB, strict=st.sampled_from([False, False, True]))
def test_fuzz_quantize(kind, scheme, include, exclude, calib, strict):
    torch.manual_seed(0)
    model = make_model(kind).eval()
    x = torch.randn(5, *input_shape(kind))
    with torch.no_grad():
        ref = model(x)
    report = outcome("quantize_", lambda: sk.quantize_(model, scheme, include=include,
                                                       exclude=exclude,
                                                       calibration=batches(kind, calib),
                                                       strict=strict),
                     ("scheme", "include", "exclude", "calibration", "layer", "batch",
                      "calling the model", "re:", "nope"))
    if report is None:
        assert not any(hasattr(m, "scheme") for m in model.modules())  # nothing half-done
        return
    quantized = [m for m in model.modules() if getattr(m, "scheme", None) == scheme]
    assert len(quantized) == len(report.quantized) > 0 or not report.quantized
    with torch.no_grad():
        out = model(x)
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0)
    assert out.shape == ref.shape and float(cos) > 0.98


@settings(FAST, max_examples=20)
@given(ratio=st.one_of(st.floats(0, 0.9), st.floats(0, 0.9), st.floats(-0.2, 1.2),
                      st.sampled_from([0.25, 0.5, "0.5", float("nan")])),
       importance=st.sampled_from(["magnitude", "magnitude", "taylor", "lamp", "l2"]),
       scope=st.sampled_from(["layer", "layer", "global", "all"]),
       round_to=st.sampled_from([None, 1, 4, 4, 0, -1, 2.5]), steps=st.sampled_from([1, 1, 2, 0]),
       inputs=st.sampled_from(["good", "good", "good", "wrong_shape", "tuple"]),
       loss=st.booleans(), quantized=st.sampled_from([False, False, False, True]))
def test_fuzz_prune_channels(ratio, importance, scope, round_to, steps, inputs, loss, quantized):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    if quantized:
        sk.quantize_(model, "int8_weight_only", exclude="4")
    x = torch.randn(2, 8)
    example = {"good": x, "wrong_shape": torch.randn(2, 7), "tuple": (x,)}[inputs]
    loss_fn = (lambda m: m(x).pow(2).mean()) if loss else None
    params = sum(p.numel() for p in model.parameters())
    report = outcome(
        "prune_channels_",
        lambda: sk.prune_channels_(model, example, ratio=ratio, criterion=importance,
                                   scope=scope, round_to=round_to, steps=steps, loss_fn=loss_fn),
        ("ratio", "criterion", "scope", "round_to", "steps", "loss_fn", "example_inputs",
         "quantized", "trace", "module", "layer"),
    )
    with torch.no_grad():
        out = model(x)
    assert out.shape == (2, 4)  # outputs are never pruned
    if report is not None:
        assert sum(p.numel() for p in model.parameters()) <= params
        if isinstance(ratio, float) and ratio >= 0.25 and (round_to or 1) <= 4:
            # something was removed, as asked (a global ranking may take it all from one layer)
            assert model[0].out_features + model[2].out_features < 32


@settings(FAST, max_examples=20)
@given(kind=MODELS, fraction=st.floats(0, 1), pattern=st.sampled_from([None, "2:4", "1:4",
                                                                       "x", 5]),
       include=SELECT)
def test_fuzz_sparsity_report(kind, fraction, pattern, include):
    torch.manual_seed(0)
    model = make_model(kind)
    with torch.no_grad():
        for p in model.parameters():
            p.masked_fill_(torch.rand_like(p) < fraction, 0)
    report = outcome("sparsity_report", lambda: sk.sparsity_report(model, include=include,
                                                                   pattern=pattern),
                     ("pattern", "include", "re:", "nope"))
    if report is None:
        return
    zeros = sum(int((model.get_submodule(n).weight == 0).sum()) for n in report.layers)
    numel = sum(model.get_submodule(n).weight.numel() for n in report.layers)
    assert report.zeros == zeros and report.numel == numel
    assert report.global_sparsity == pytest.approx(zeros / numel)


@settings(FAST, max_examples=40)
@given(kind=st.sampled_from(["oneshot", "linear", "cubic"]),
       args=st.lists(st.one_of(st.integers(-3, 50), st.sampled_from([1.5, True, None, "2"])),
                     min_size=0, max_size=4),
       steps=st.lists(st.integers(-5, 80), min_size=1, max_size=12))
def test_fuzz_schedules(kind, args, steps):
    cls = {"oneshot": sk.OneShot, "linear": sk.Linear, "cubic": sk.Cubic}[kind]
    args = args[:1] if kind == "oneshot" else args[:3]  # Python itself checks the arity
    sched = outcome("schedules", lambda: cls(*args), ("step", "start", "end", "every",
                                                      "argument"))
    if sched is None:
        return
    values = [sched.progress(s) for s in sorted(steps)]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert values == sorted(values)  # never moves back
    last = getattr(sched, "end", getattr(sched, "step", 0))
    assert sched.progress(last) == 1.0 and sched.progress(last + 7) == 1.0
    first = getattr(sched, "start", getattr(sched, "step", 0))
    assert first == 0 or sched.progress(first - 1) == 0.0


JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True),
                 st.text(max_size=5), st.just({}), st.just([]),
                 st.just(torch.ones(2, dtype=torch.bool)), st.just({"0": torch.ones(1)}))


@settings(FAST, max_examples=40)
@given(pattern=st.sampled_from(["unstructured", "2:4"]),
       field=st.sampled_from(["version", "pattern", "criterion", "scope", "progress",
                              "last_step", "masks", "mask0", "drop", "none"]),
       value=st.one_of(JUNK, st.sampled_from([1, 0.0, 0.5, 1.0, 3, -1, "magnitude", "global",
                                              "unstructured", "2:4"])))
def test_fuzz_pruner_load_state_dict(pattern, field, value):
    torch.manual_seed(0)
    src = sk.Pruner(make_model("mlp8"), 0.5 if pattern == "unstructured" else None,
                     pattern=pattern)
    src.step(0)
    state = dict(src.state_dict())
    if field == "drop":
        state.pop("masks")
    elif field == "mask0":
        state["masks"] = {**state["masks"], "0": value}
    elif field != "none":
        state[field] = value
    dst = sk.Pruner(make_model("mlp8"), 0.5 if pattern == "unstructured" else None,
                     pattern=pattern)
    before = {n: m.clone() for n, m in dst.masks.items()}
    done = outcome("Pruner.load_state_dict", lambda: dst.load_state_dict(state) or True,
                   ("pruner state", "masks", "version", "progress", "last_step", "pattern",
                    "criterion"))
    if done is None:
        assert all(torch.equal(dst.masks[n], before[n]) for n in before)  # nothing changed
        return
    assert 0.0 <= dst.progress <= 1.0
    for n, m in dst.masks.items():
        assert m.dtype == torch.bool and torch.equal(m, state["masks"][n])


# ---------------------------------------------------------------------------------------------
# the checkpoint reader


def _write(path, header_len: int, header: bytes, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", header_len) + header + data)


def _split(raw: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Linear(8, 4))
    sk.prune_(model, pattern="2:4", include="0")
    sk.prune_(model, 0.75, include="2")  # one 2:4-packed, one bitmask tensor
    path = tmp_path_factory.mktemp("ckpt") / "m.safetensors"
    sk.save(model, path)
    return model, path.read_bytes()


HEADER_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=5),
                          st.just({}), st.just([]), st.just([8, 8]), st.just(1e300),
                          st.just({"shape": [8, 8]}), st.just({"shape": [3, 7]}),
                          st.just({"shape": [-1]}), st.just({"0.weight": {"shape": "x"}}),
                          st.just({"0.weight": "2.weight"}), st.just({"x": "y"}))


@settings(FAST, max_examples=50)
@given(what=st.sampled_from(["meta", "meta_key", "tensor_entry", "bytes", "body_bytes",
                             "truncate", "length"]),
       data=st.data())
def test_fuzz_checkpoint_reader(saved, tmp_path_factory, what, data):
    model, raw = saved
    header, body = _split(raw)
    meta = json.loads(header["__metadata__"]["sparsekit"])
    d = tmp_path_factory.mktemp("fuzz")
    path = d / "m.safetensors"
    if what in ("meta", "meta_key"):
        key = data.draw(st.sampled_from(sorted(meta)), label="field")
        if what == "meta":
            meta[key] = data.draw(HEADER_VALUES, label="value")
        elif isinstance(meta[key], dict) and meta[key]:
            inner = data.draw(st.sampled_from(sorted(meta[key])), label="entry")
            meta[key][inner] = data.draw(HEADER_VALUES, label="value")
        else:
            meta.pop(key)
        header["__metadata__"]["sparsekit"] = json.dumps(meta)
        text = json.dumps(header).encode()
        _write(path, len(text), text, body)
    elif what == "tensor_entry":
        key = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        header[key][field] = data.draw(st.sampled_from(
            ["F32", "U8", "BOOL", "XX", [1], [0, 1], [2, 2, 2], [10**9, 10**9 + 4], -1]))
        text = json.dumps(header).encode()
        _write(path, len(text), text, body)
    elif what == "body_bytes":  # tensor data only: loads, with other values
        buf = bytearray(raw)
        start = len(raw) - len(body)
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(start, start + 399))  # the float tensors, not masks
            buf[i] = data.draw(st.integers(0, 255))
        path.write_bytes(bytes(buf))
    elif what == "bytes":
        buf = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(buf) - 1))
            buf[i] = data.draw(st.integers(0, 255))
        path.write_bytes(bytes(buf))
    elif what == "truncate":
        path.write_bytes(raw[:data.draw(st.integers(0, len(raw) - 1))])
    else:
        n = struct.unpack("<Q", raw[:8])[0]
        new = data.draw(st.sampled_from([0, 1, n - 1, n + 1, 2**63, len(raw)]))
        path.write_bytes(struct.pack("<Q", new) + raw[8:])
    fresh = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Linear(8, 4))
    loaded = outcome("sk.load", lambda: sk.load(path, model=fresh),
                     (str(path), "checkpoint", "m.safetensors"))
    if loaded is None:
        return
    # a file that loads holds tensors of the right shapes (the model is usable); when only
    # the structure was touched and it still loads, the weights must be the saved ones
    assert loaded(torch.randn(2, 8)).shape == (2, 4)
    if what == "meta" or what == "meta_key":
        for k, v in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[k], v), k


PAYLOADS = [
    {"_target_": "subprocess.run", "args": ["touch", "{marker}"]},
    {"_target_": "sparsekit.models.build_model", "name": None, "target": "subprocess.run",
     "kwargs": {"args": ["touch", "{marker}"]}},
    {"_target_": "os.system", "command": "touch {marker}"},
    {"_target_": "torchvision.models._api.load_state_dict_from_url", "url": "file://{marker}"},
    {"_target_": "builtins.exec", "source": "open('{marker}', 'w')"},
]


@settings(FAST, max_examples=10)
@given(payload=st.sampled_from(PAYLOADS), where=st.sampled_from(["model", "channels", "quant"]))
def test_fuzz_checkpoint_payloads_never_run(saved, tmp_path_factory, payload, where):
    _, raw = saved
    header, body = _split(raw)
    d = tmp_path_factory.mktemp("payload")
    marker = d / "PWNED"
    meta = json.loads(header["__metadata__"]["sparsekit"])
    meta[where] = json.loads(json.dumps(payload).replace("{marker}", str(marker)))
    header["__metadata__"]["sparsekit"] = json.dumps(meta)
    text = json.dumps(header).encode()
    _write(d / "m.safetensors", len(text), text, body)
    with contextlib.suppress(SparsekitError):
        outcome("sk.load payloads", lambda: sk.load(d / "m.safetensors"),
                (str(d / "m.safetensors"), "model", "checkpoint"))
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# the command line


def _keys(node, prefix=""):
    import dataclasses

    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _keys(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def _config_keys() -> list[str]:
    from sparsekit.run.config import Config

    return sorted(_keys(Config()))


VALUES = st.one_of(
    st.integers(-5, 5).map(str), st.floats(allow_nan=True).map(str),
    st.sampled_from(["null", "true", "false", "nan", "inf", "-inf", "[1,2]", "{a: 1}", "''",
                     "2:4", "unstructured", "re:[", "a=b", "${oops}", "'x'", "1e9", "none",
                     "[]", "0.5,0.7", "magnitude"]),
    st.text(alphabet="abc:=,.[]{}$ ", max_size=6),
)


VALID = {  # values each option accepts, so that cases also reach a composed config
    "prune": ["none", "unstructured", "nm24", "channel"], "model": ["mnist1d_cnn", "tiny_lm"],
    "prune.sparsity": ["0.5", "0.9", "null"], "prune.pattern": ["2:4", "unstructured", "none"],
    "prune.criterion": ["magnitude", "wanda"], "schedule.end": ["10", "0"],
    "train.finetune_steps": ["0", "5"], "data.eval_batches": ["1", "null", "3"],
    "quant.scheme": ["int8", "fp8", "none"], "train.distill.alpha": ["0.5", "0"],
    "prune.channel.ratio": ["0.25", "0"], "bench.repeats": ["1", "3"], "recipe": ["mnist1d_cnn_24"],
}


@pytest.mark.slow
@settings(FAST, max_examples=35)
@given(data=st.data())
def test_fuzz_command_line(data):
    register_configs()
    keys = _config_keys() + ["prune.typo", "nope", "model", "prune", "recipe", "+model.kwargs.w"]
    n = data.draw(st.integers(1, 3), label="n")
    args = []
    for _ in range(n):
        key = data.draw(st.sampled_from(keys), label="key")
        valid = VALID.get(key, [])
        value = data.draw(st.one_of(VALUES, st.sampled_from(valid)) if valid else VALUES,
                          label="value")
        args.append(f"{key}={value}")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            check_overrides(args)
            code = 0
        except SystemExit as e:
            code = e.code
    text = err.getvalue()
    if code == 0:
        COUNTS["check_overrides", "ok"] += 1
        assert text == ""
        return
    COUNTS["check_overrides", "error"] += 1
    assert code == 2, (args, code, text)
    assert text.count("\n") == 1 and text.startswith("sparsekit: error: "), (args, text)
    named = [a.split("=", 1)[0].lstrip("+~").split(".")[-1] for a in args]
    assert any(k in text for k in named) or "cannot parse" in text, (args, text)


def test_fuzz_counts():
    """At least 200 generated cases ran, each a clean error or a checked result; the counts
    are written to $SPARSEKIT_FUZZ_COUNTS (JSON) when set, for the issue's report."""
    props = {p for p, _ in COUNTS}
    if len(props) < 8:
        pytest.skip("run the whole file to count its cases")
    total = sum(COUNTS.values())
    errors = sum(v for (_, k), v in COUNTS.items() if k == "error")
    assert total >= 200, COUNTS
    assert errors > 0 and total - errors > 0  # both sides of every contract were exercised
    out = os.environ.get("SPARSEKIT_FUZZ_COUNTS")
    if out:
        table = {f"{p}/{k}": v for (p, k), v in sorted(COUNTS.items())}
        with open(out, "w") as f:
            json.dump({"cases": total, "clean_errors": errors, "correct_results": total - errors,
                       "by_property": table}, f, indent=2)
