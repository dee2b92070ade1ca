"""Safe by construction, round three: the surfaces added since round two. Every name or file
that can lead to code is checked before use (recipes, group options, ``_target_`` overrides,
model and tokenizer directories with remote code); checkpoint contents are checked against
their format; the silent wrongs found (a layer pruned to 100%, a schedule past the last step)
are warnings or errors; the internal errors are one line; files get the promised modes."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import warnings

import pytest
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import sparsekit as sk
from sparsekit.errors import FileFormatError, SparsekitError, UnsafeFileError
from sparsekit.io.files import atomic_torch_save
from sparsekit.quant.formats import get_scheme
from sparsekit.run.cli import check_overrides, hydra_argv, main, register_configs
from test_security import plant_run

pytestmark = pytest.mark.usefixtures("no_network")


def _evil_yaml(path, marker):
    """A YAML overlay whose model is ``subprocess.run`` touching ``marker``."""
    path.write_text("# @package _global_\nmodel:\n  name: custom\n  _target_: subprocess.run\n"
                    f"  kwargs:\n    args: [touch, {marker}]\n")
    return path


# --- 1. names and files that can lead to code ------------------------------------------------

@pytest.mark.parametrize("how", ["relative", "absolute", "group", "hydra_group"])
def test_a_yaml_path_as_a_group_option_is_refused_in_one_line(tmp_path, monkeypatch, capsys,
                                                              how):
    marker = tmp_path / "pwned"
    evil = _evil_yaml(tmp_path / "x.yaml", marker)
    monkeypatch.chdir(tmp_path)
    up = "../" * (len(__import__("sparsekit.run.resources", fromlist=["conf_dir"])
                      .conf_dir().resolve().parts) + 1)
    arg = {"relative": f"recipe={up}{str(evil)[1:-5]}", "absolute": f"recipe={str(evil)[:-5]}",
           "group": f"model={up}{str(evil)[1:-5]}",
           "hydra_group": f"hydra/launcher={up}{str(evil)[1:-5]}"}[how]
    for argv in ([arg, "train.dense_steps=0"], [arg, "--cfg", "job"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("sparsekit: error: ")
        assert ("unknown option" in err or "not an option name" in err) and arg in err
    assert not marker.exists()


def test_recipe_file_form_runs_a_checked_overlay(tmp_path, monkeypatch, capsys):
    (tmp_path / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /prune: unstructured\n"
        "prune:\n  sparsity: 0.7\n")
    monkeypatch.chdir(tmp_path)
    register_configs()
    check_overrides(["recipe=file:mine.yaml", "schedule.end=100"])  # no exit: valid
    main(["recipe=file:mine.yaml", "--cfg", "job"])
    out = capsys.readouterr().out
    assert "pattern: unstructured" in out and "sparsity: 0.7" in out


@pytest.mark.parametrize("text,why", [
    ("model:\n  name: custom\n  _target_: subprocess.run\n", "model._target_: a file may not"),
    ("prune:\n  options:\n    _args_: [1]\n", "prune.options._args_: a file may not"),
    ("hydra:\n  callbacks: {}\n", "unknown key 'hydra'"),
    ("defaults:\n  - override /model: ../../x\n", "defaults entry"),
    ("defaults:\n  - /model: custom\n", "defaults entry"),
    ("[1, 2]\n", "not a YAML mapping"),
])
def test_recipe_file_that_names_code_or_a_path_is_refused(tmp_path, monkeypatch, capsys, text,
                                                          why):
    (tmp_path / "r.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["recipe=file:r.yaml", "train.dense_steps=0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and why in err and "recipe=file:r.yaml" in err


@pytest.mark.parametrize("override,key", [
    ("+prune._target_=evilmod.f", "prune._target_"),
    ("+prune.foo=1", "prune.foo"),
    ("+model.kwargs._target_=evilmod.f", "model.kwargs._target_"),
    ("+train.distill._args_=[1]", "train.distill._args_"),
    ("+_target_=evilmod.f", "_target_"),
])
def test_target_anywhere_in_an_override_is_an_unknown_key(override, key, capsys):
    register_configs()
    with pytest.raises(SystemExit) as exit_:
        check_overrides([override])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{key}: unknown key" in err


@pytest.mark.parametrize("name", ["it's_a_run", "a'b\\", "x ${oc.env:HOME},y"])
def test_resume_true_in_a_run_dir_with_quotes(tmp_path, monkeypatch, name):
    d = plant_run(tmp_path, ["prune.sparsity=0.5", "prune=unstructured"], name)
    monkeypatch.chdir(tmp_path)
    argv = hydra_argv(["resume=true"])  # before: OverrideParseException, "internal error"
    run_dir = [a for a in argv if a.startswith("hydra.run.dir=")]
    parsed = OverridesParser.create().parse_override(run_dir[-1]).value()
    assert parsed.replace("\\${", "${") == str(d.resolve())
    assert "prune.sparsity=0.5" in argv and "resume=true" in argv


# --- 5. files get the permissions the docs promise (the umask's) -----------------------------

@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield 0o644
    os.umask(old)


def test_saved_safetensors_follow_the_umask(tmp_path, umask_022):
    model = nn.Sequential(nn.Linear(4, 4))
    path = sk.save(model, tmp_path / "model.safetensors") or tmp_path / "model.safetensors"
    assert stat.S_IMODE(os.stat(path).st_mode) == umask_022  # safetensors alone writes 0600
    atomic_torch_save({"a": torch.zeros(1)}, tmp_path / "last.pt")
    assert stat.S_IMODE(os.stat(tmp_path / "last.pt").st_mode) == umask_022
    os.umask(0o077)
    sk.save(model, tmp_path / "private.safetensors")
    assert stat.S_IMODE(os.stat(tmp_path / "private.safetensors").st_mode) == 0o600


def test_hf_export_follows_the_umask(tmp_path, hf_dirs, umask_022):
    from transformers import AutoModelForCausalLM

    from sparsekit.models.hf import export_pretrained

    model = AutoModelForCausalLM.from_pretrained(hf_dirs["llama"])
    out = export_pretrained(model, tmp_path / "hf", quiet=True)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {umask_022}, modes


@pytest.mark.parametrize("file", ["tokenizer_config.json", "config.json"])
@pytest.mark.parametrize("loader", ["tokenizer", "model"])
def test_a_directory_with_remote_code_is_refused_never_prompted(tmp_path, hf_dirs, monkeypatch,
                                                                file, loader):
    from sparsekit.models.hf import load_pretrained, load_tokenizer

    d = tmp_path / "llama"
    shutil.copytree(hf_dirs["llama"], d)
    marker = tmp_path / "pwned"
    (d / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                               "from transformers import PreTrainedTokenizerFast as EvilTok\n"
                               "from transformers import LlamaConfig as EvilConfig\n")
    data = json.loads((d / file).read_text())
    data["auto_map"] = {"AutoTokenizer": ["evil.EvilTok", "evil.EvilTok"],
                        "AutoConfig": "evil.EvilConfig"}
    (d / file).write_text(json.dumps(data))
    monkeypatch.setattr("builtins.input", lambda *a: "y")  # transformers' question: answered y
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    with pytest.raises(UnsafeFileError, match=rf"\({file}\): auto_map names model code") as e:
        (load_tokenizer if loader == "tokenizer" else load_pretrained)(d)
    assert "\n" not in str(e.value) and "model.path=" in str(e.value)
    assert not marker.exists()


# --- 2. checkpoint contents against their format ---------------------------------------------

def _quantized(scheme: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 4))
    sk.quantize_(model, scheme, calibration=[torch.randn(2, 128)] if "static" in scheme
                 else None)
    return model


def _fresh() -> nn.Module:
    return nn.Sequential(nn.Linear(128, 4))


@pytest.mark.parametrize("scheme,tensor,value,why", [
    ("int4_weight", "weight", 8, r"0\.weight: 1 of 512 \(e\.g\. 8\.0 .*int4's \[-8, 7\]"),
    ("int4_weight_channel", "weight", -9, r"0\.weight: 1 of 512 .*\[-8, 7\]"),
    ("int4_weight", "weight_scale", float("nan"), r"0\.weight_scale: 1 of 4 .*finite and pos"),
    ("int4_weight", "weight_scale", 0.0, r"0\.weight_scale: .*finite and positive"),
    ("int4_weight", "weight_scale", -0.5, r"0\.weight_scale: .*finite and positive"),
    ("int8_weight_only", "weight", -128, r"0\.weight: .*int8's \[-127, 127\]"),
    ("int8_weight_only", "weight_scale", float("inf"), r"0\.weight_scale: .*finite"),
    ("fp8_weight_only", "weight", float("nan"), r"0\.weight: .*fp8's \[-448, 448\]"),
    ("int8_static", "input_scale", 0.0, r"0\.input_scale: 1 of 1 .*finite and positive"),
    ("fp8_static", "input_scale", float("nan"), r"0\.input_scale: .*finite and positive"),
])
def test_a_checkpoint_outside_its_format_is_refused_naming_the_tensor(tmp_path, scheme, tensor,
                                                                      value, why):
    model = _quantized(scheme)
    with torch.no_grad():
        getattr(model[0], tensor).view(-1)[0] = value
    sk.save(model, tmp_path / "q.safetensors")
    with pytest.raises(FileFormatError, match=why) as e:
        sk.load(tmp_path / "q.safetensors", model=_fresh())
    assert "q.safetensors" in str(e.value) and "\n" not in str(e.value)


def test_a_checkpoint_with_another_dtype_or_scale_shape_is_refused(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model = _quantized("int4_weight_channel")
    sk.save(model, tmp_path / "q.safetensors")
    with safe_open(tmp_path / "q.safetensors", "pt") as f:
        meta = f.metadata()
    for key, change, why in [("0.weight", lambda t: t.float(), r"0\.weight is torch\.float32"),
                             ("0.weight_scale", lambda t: t.reshape(2, 2),
                              r"0\.weight_scale has shape \[2, 2\]; the model's 0\.weight_sc"),
                             ("0.weight_scale", lambda t: t.to(torch.int32), "weight_scale")]:
        tensors = load_file(tmp_path / "q.safetensors")
        tensors[key] = change(tensors[key])
        save_file(tensors, tmp_path / "bad.safetensors", metadata=meta)
        with pytest.raises(FileFormatError, match=why):
            sk.load(tmp_path / "bad.safetensors", model=_fresh())


_SCALES = st.one_of(st.floats(1e-6, 10.0), st.sampled_from(
    [0.0, -0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e-30]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(scheme=st.sampled_from(["int4_weight", "int4_weight_channel", "int8_weight_only",
                               "fp8_weight_only", "int8_static", "fp8"]),
       low=st.one_of(st.integers(-8, 0), st.integers(-300, 0)),
       high=st.one_of(st.integers(0, 7), st.integers(0, 300)),
       special=st.sampled_from([None, None, float("nan"), float("inf"), 1e4]),
       scales=st.one_of(st.lists(st.floats(1e-6, 10.0), min_size=5, max_size=5),
                        st.lists(_SCALES, min_size=5, max_size=5)),
       seed=st.integers(0, 2**16))
def test_loading_a_checkpoint_refuses_or_reproduces_its_outputs(tmp_path, scheme, low, high,
                                                                special, scales, seed):
    """Random stored values (any range, NaN, inf) and scales (zero, negative, NaN, inf, tiny):
    sk.load either refuses with a FileFormatError, exactly when a value is outside the format
    or a scale is not finite and positive, or gives the outputs of the model that was saved."""
    model = _quantized(scheme)
    q = model[0]
    g = torch.Generator().manual_seed(seed)
    fmt = get_scheme(scheme).weight
    with torch.no_grad():
        raw = torch.randint(low, high + 1, q.weight.shape, generator=g).float()
        if special is not None:
            raw.view(-1)[seed % raw.numel()] = special
        if fmt.integer:
            raw = raw.nan_to_num(nan=fmt.qmax + 1, posinf=fmt.qmax + 1).clamp(-128, 127)
        q.weight.copy_(raw.to(q.weight.dtype))
        q.weight_scale.copy_(torch.tensor(scales[:q.weight_scale.numel()] * 4)[
            :q.weight_scale.numel()].reshape(q.weight_scale.shape))
        if "input_scale" in q._buffers:
            q.input_scale.fill_(scales[-1])
    stored = q.weight.float()
    values_ok = bool((stored.isfinite() & (stored >= fmt.qmin) & (stored <= fmt.qmax)).all())
    scale_ts = [q.weight_scale] + ([q.input_scale] if "input_scale" in q._buffers else [])
    scales_ok = all(bool((t.isfinite() & (t > 0)).all()) for t in scale_ts)
    path = tmp_path / f"q{seed}.safetensors"
    sk.save(model, path)
    x = torch.randn(3, 128, generator=g)
    try:
        back = sk.load(path, model=_fresh())
    except FileFormatError as e:
        assert not (values_ok and scales_ok), f"refused a valid checkpoint: {e}"
        event("refused")
        return
    event("loaded")
    assert values_ok and scales_ok, "loaded values outside the format without a word"
    torch.testing.assert_close(back(x), model(x), rtol=0, atol=0, equal_nan=True)
    if get_scheme(scheme).activation is None:  # weight-only: the float64 formula
        w = stored.double().reshape(4, -1, q.group_size if hasattr(q, "group_size") else 128)
        wd = (w * q.weight_scale.double().reshape(4, -1, 1)).reshape(4, 128)
        ref = x.double() @ wd.T
        # float32 sums of 128 products: their rounding grows with the sum of the magnitudes
        bound = float((x.double().abs() @ wd.abs().T).max())
        torch.testing.assert_close(back(x).double(), ref + q.bias.double(), rtol=1e-5,
                                   atol=1e-4 + 1e-6 * bound)


# --- 3. guards that turn silent wrongs into a warning or an error ----------------------------

def test_a_global_threshold_that_empties_a_layer_is_named_in_a_warning_and_the_report():
    from sparsekit.models.cnn1d import mnist1d_cnn

    model = mnist1d_cnn()  # its classifier's weights start smallest: 90% global empties it
    with pytest.warns(UserWarning, match=r"pruned layer 'linear' to 100\.0%.*max_layer_spars"):
        report = sk.prune_(model, 0.9, scope="global")
    assert bool((model.linear.weight == 0).all())
    assert set(report.warnings) == {"linear"} and "WARNING" in str(report)
    after = sk.sparsity_report(model)  # the finalized model alone: still flagged
    assert set(after.warnings) == {"linear"}
    assert after.to_dict()["layers"]["linear"]["warning"].startswith("100.0% zeros")


def test_a_small_first_layer_pruned_hard_by_a_global_threshold_warns():
    from sparsekit.models.cnn1d import mnist1d_cnn

    model = mnist1d_cnn()
    with torch.no_grad():
        model.conv1.weight.mul_(0.05)  # small first-layer weights, as after training
    with pytest.warns(UserWarning, match=r"layer 'conv1', the first layer \(160 weights.*"
                                         r"exclude=\['conv1'\]"):
        report = sk.prune_(model, 0.9, scope="global", max_layer_sparsity=0.95)
    assert report.layers["conv1"].sparsity >= 0.5 and "conv1" in report.warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # excluded (as the recipe does): no word
        sk.prune_(mnist1d_cnn(), 0.9, scope="global", exclude=["conv1"], max_layer_sparsity=0.95)


def test_max_layer_sparsity_caps_every_layer_and_keeps_the_global_target():
    from sparsekit.models.cnn1d import mnist1d_cnn

    model = mnist1d_cnn()
    weights = {n: m.weight.detach().abs().clone() for n, m in model.named_modules()
               if isinstance(m, (nn.Conv1d, nn.Linear))}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = sk.prune_(model, 0.9, scope="global", max_layer_sparsity=0.95)
    total = sum(w.numel() for w in weights.values())
    assert report.zeros == int(0.9 * total + 0.5)  # the global target, exactly
    capped = {n for n, s in report.layers.items() if s.zeros == int(0.95 * s.numel + 0.5)}
    assert capped == {"linear"} and all(s.sparsity <= 0.95 for s in report.layers.values())
    kept = {n: dict(model.named_modules())[n].weight.detach() != 0 for n in weights}
    # the capped layer keeps its largest weights; the others share one threshold
    top = weights["linear"].flatten().topk(int(kept["linear"].sum())).values.min()
    assert bool((weights["linear"][kept["linear"]] >= top).all())
    free = [n for n in weights if n not in capped]
    pruned_max = max(float(weights[n][~kept[n]].max()) for n in free)
    kept_min = min(float(weights[n][kept[n]].min()) for n in free)
    assert pruned_max <= kept_min


@pytest.mark.parametrize("cap,scope,why", [(0.8, "global", "below sparsity=0.9"),
                                           (0.95, "layer", "scope='global'"),
                                           (1.0, "global", r"\[0, 1\)")])
def test_max_layer_sparsity_outside_its_range_is_one_line(cap, scope, why):
    with pytest.raises(ValueError, match=why):
        sk.Pruner(nn.Sequential(nn.Linear(8, 8)), 0.9, scope=scope, max_layer_sparsity=cap)


def test_the_readme_example_zeroes_no_layer():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", readme, flags=re.S)
                if "scope=\"global\"" in c)
    code = code.split("sk.quantize_")[0]  # the pruning part
    scope: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layer named in a warning
        exec(compile(code, "README example", "exec"), scope)
    assert max(s.sparsity for s in scope["report"].layers.values()) <= 0.95


@pytest.mark.parametrize("overrides,key", [
    (["schedule.end=2000"], "schedule.end=2000"),
    (["schedule=cubic", "train=lm", "model=tiny_lm", "data=stdlib_text"], "schedule.end=1500"),
    (["schedule=oneshot", "schedule.start=2500", "schedule.end=2500"], "schedule.start=2500"),
])
def test_a_schedule_ending_after_the_last_fine_tuning_step_is_an_error(overrides, key, capsys):
    register_configs()
    with pytest.raises(SystemExit) as exit_:
        check_overrides(overrides)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{key} is not before the last fine-tuning step" in err
    check_overrides([*overrides, "prune.fine_tune=false"])  # pruned without fine-tuning: fine


# --- 4. internal errors and unclear messages become one line ---------------------------------

@pytest.fixture
def bad_plugin(tmp_path, monkeypatch):
    """An installed-looking criterion plugin ``notone`` whose entry point is not a criterion
    (a function returning a number)."""
    from importlib import metadata

    from sparsekit.prune.criteria import CRITERIA

    (tmp_path / "notone_plugin.py").write_text("def make():\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = metadata.EntryPoint(name="notone", value="notone_plugin:make",
                             group="sparsekit.criteria")
    monkeypatch.setattr(CRITERIA, "_plugins", lambda rescan=False: {"notone": ep})
    yield "notone"
    CRITERIA.unregister("notone")


def test_a_criterion_plugin_that_is_not_a_criterion_is_one_line(bad_plugin, tmp_path,
                                                                monkeypatch, capsys):
    with pytest.raises(TypeError, match=r"criterion 'notone' \(entry point 'notone_plugin:make'"
                                        r".*is not a criterion: a criterion has a score"):
        sk.Pruner(nn.Sequential(nn.Linear(8, 8)), 0.5, criterion=bad_plugin)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:  # before: "internal error: AttributeError"
        main(["prune.criterion=notone", "prune=unstructured", "train.dense_steps=0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a criterion" in err
    assert "internal error" not in err


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _weight_norm() -> nn.Module:
    model = _mlp()
    nn.utils.parametrizations.weight_norm(model[0])
    return model


def _meta() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8, device="meta"), nn.ReLU(), nn.Linear(8, 4, device="meta"))


_CAL = [torch.randn(4, 8)]
# (call, what the one line names): each was an AttributeError, RuntimeError or
# NotImplementedError from deep inside before (the 14 unclear messages and their kin)
API_CASES = {
    "Pruner(str)": (lambda: sk.Pruner("model", 0.5), "model must be a torch.nn.Module, got str"),
    "prune_(None)": (lambda: sk.prune_(None, 0.5), "model must be a torch.nn.Module, got None"),
    "quantize_(str)": (lambda: sk.quantize_("model", "int8"), "model must be a torch.nn.Module"),
    "sparsity_report(None)": (lambda: sk.sparsity_report(None), "model must be a torch.nn"),
    "prepare_qat_(dict)": (lambda: sk.prepare_qat_({}, "int8"), "model must be a torch.nn"),
    "convert_(str)": (lambda: sk.convert_("m"), "convert_: model must be a torch.nn.Module"),
    "save(str)": (lambda: sk.save("m", "x.safetensors"), "sk.save: model must be a torch.nn"),
    "save(path=int)": (lambda: sk.save(_mlp(), 3), "sk.save: path must be a file path"),
    "Distiller(None)": (lambda: sk.Distiller(None), "sk.Distiller: teacher must be a torch.nn"),
    "distill_(teacher=str)": (lambda: sk.distill_(_mlp(), "t", _CAL, steps=1),
                              "teacher must be a torch.nn.Module, got str"),
    "sensitivity(str)": (lambda: sk.sensitivity("m", lambda m: 0.0), "sk.sensitivity: model"),
    "quant_plan(None)": (lambda: sk.quant_plan(None), "quant_plan: model must be a torch.nn"),
    "channel_plan(int)": (lambda: sk.channel_plan(3), "channel_plan: model must be a torch.nn"),
    "apply_quant_plan(plan=str)": (lambda: sk.apply_quant_plan(_mlp(), "x"),
                                   "apply_quant_plan: plan must be a dict"),
    "apply_channel_plan(plan=str)": (lambda: sk.apply_channel_plan(_mlp(), "x"),
                                     "apply_channel_plan: plan must be a dict"),
    "ChannelPruner(str)": (lambda: sk.ChannelPruner("m", torch.randn(1, 8), ratio=0.5),
                           "sk.ChannelPruner: model must be a torch.nn.Module"),
    "allocate(str)": (lambda: sk.allocate("bad", 0.5), "allocate: table must be the Sensitiv"),
    "sparsity_report(meta)": (lambda: sk.sparsity_report(_meta()),
                              "layer '0' has its weight on the meta device"),
    "Pruner(weight_norm)": (lambda: sk.Pruner(_weight_norm(), 0.5),
                            "layer '0': its weight is computed by a parametrization"),
    "prune_(weight_norm, 2:4)": (lambda: sk.prune_(_weight_norm(), pattern="2:4"),
                                 "layer '0': its weight is computed"),
    "wanda(meta batch)": (lambda: sk.prune_(_mlp(), 0.5, criterion="wanda", calibration=[
        torch.randn(4, 8, device="meta")]), "holds a tensor on the meta device"),
    "quantize_(meta batch)": (lambda: sk.quantize_(_mlp(), "int8_static", calibration=[
        torch.randn(4, 8, device="meta")]), "holds a tensor on the meta device"),
    "accelerate(str)": (lambda: sk.accelerate("m", torch.randn(2, 8), device="cpu"),
                        "sk.accelerate: model must be a torch.nn.Module"),
    "accelerate(meta)": (lambda: sk.accelerate(_meta(), torch.randn(2, 8), device="cpu"),
                         "sk.accelerate: '0.weight' is on the meta device"),
    "accelerate(meta inputs)": (lambda: sk.accelerate(_mlp(), torch.randn(
        2, 8, device="meta"), device="cpu"), "example_inputs (tensor(2, 8)) holds a tensor on"),
    "accelerate(wrong shape)": (lambda: sk.accelerate(_mlp(), torch.randn(2, 5), device="cpu"),
                                "failed in layer '0' (Linear)"),
    "accelerate(device)": (lambda: sk.accelerate(_mlp(), torch.randn(2, 8), device="tpu9"),
                           "sk.accelerate: device='tpu9' is not a torch device"),
}


@pytest.mark.parametrize("case", list(API_CASES))
def test_wrong_api_arguments_are_one_line_naming_the_argument(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    call, says = API_CASES[case]
    with pytest.raises((ValueError, TypeError)) as e:
        call()
    assert isinstance(e.value, SparsekitError), f"{type(e.value).__name__}: {e.value}"
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_weight_norm_model_saves_its_effective_weights(tmp_path):
    model = _weight_norm()
    sk.save(model, tmp_path / "w.safetensors")  # before: 'ParametrizationList' ... 'original'
    back = sk.load(tmp_path / "w.safetensors", model=_mlp())
    x = torch.randn(3, 8)
    torch.testing.assert_close(back(x), model(x))


def test_resume_true_skips_a_run_made_from_a_recipe_file(tmp_path, capsys):
    from sparsekit.run.cli import latest_run

    d = plant_run(tmp_path, ["recipe=file:mine.yaml"])
    assert latest_run(tmp_path / "runs") is None  # a file's contents may have changed since
    err = capsys.readouterr().err
    assert f"skipped {d}" in err and "recipe=file:mine.yaml" in err and "resume=DIR" in err
