"""Safe by construction, round three: the surfaces added since round two. Every name or file
that can lead to code is checked before use (recipes, group options, ``_target_`` overrides,
model and tokenizer directories with remote code); checkpoint contents are checked against
their format; the silent wrongs found (a layer pruned to 100%, a schedule past the last step)
are warnings or errors; the internal errors are one line; files get the promised modes."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from torch import nn

import sparsekit as sk
from sparsekit.io.files import atomic_torch_save
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
    check_overrides(["recipe=file:mine.yaml", "train.finetune_steps=10"])  # no exit: valid
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
