"""Safe by construction, round two: no file picks code or reaches the network, and the silent
wrong results and unclear errors an attack run found are refused in one line naming the input
(or fixed). Every test that reads a file runs with the network blocked (``no_network``)."""

from __future__ import annotations

import json
import os
import pickle
import socket
import warnings
from importlib import metadata
from pathlib import Path

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.errors import ConfigTypeError, FileFormatError, NumericsError, UnsafeFileError, \
    UsageError
from sparsekit.prune.criteria import CRITERIA
from sparsekit.registry import from_file
from sparsekit.run.cli import latest_run, main, resume_argv
from sparsekit.run.config import Config, ConfigError, validate
from sparsekit.run.pipeline import CHECKPOINT, run
from test_security import plant_run

pytestmark = pytest.mark.usefixtures("no_network")


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """An installed-looking criterion plugin ``evil`` (entry point of ``sparsekit.criteria``)
    whose module, when imported, creates the file ``marker``."""
    (tmp_path / "evil_plugin.py").write_text(
        f"open({str(tmp_path / 'marker')!r}, 'w').close()\n"
        "from sparsekit.prune.criteria import CRITERIA\nX = CRITERIA['magnitude']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = metadata.EntryPoint(name="evil", value="evil_plugin:X", group="sparsekit.criteria")
    monkeypatch.setattr(CRITERIA, "_plugins", lambda rescan=False: {"evil": ep})
    yield tmp_path / "marker"
    CRITERIA.unregister("evil")


# --- 1. names from files resolve among built-ins only ----------------------------------------

def test_registry_from_file_never_loads_a_plugin(plugin):
    assert "evil" in CRITERIA.names()  # typed in code, the plugin is honoured ...
    with pytest.raises(UnsafeFileError, match="run.json names criterion 'evil'.*not built in"):
        from_file(CRITERIA, "evil", "run.json")  # ... named by a file, never
    assert not plugin.exists()
    assert from_file(CRITERIA, "magnitude", "run.json") is CRITERIA["magnitude"]
    CRITERIA["evil"]  # loaded because code asked: still not a name a file may use
    assert plugin.exists()
    with pytest.raises(UnsafeFileError):
        from_file(CRITERIA, "evil", "run.json")


def test_resume_true_skips_a_run_that_names_a_plugin_and_says_which(tmp_path, plugin, capsys):
    safe = plant_run(tmp_path, ["prune.sparsity=0.5", "prune=unstructured"], "2026-01-01_00-00-00")
    evil = plant_run(tmp_path, ["prune.criterion=evil"], "2026-01-02_00-00-00")
    os.utime(evil / CHECKPOINT, (2e9, 2e9))  # the planted one is the newest
    assert latest_run(tmp_path / "runs") == safe
    err = capsys.readouterr().err
    assert f"skipped {evil}" in err and "prune.criterion=evil" in err and "resume=DIR" in err
    assert not plugin.exists()


def test_resume_dir_of_a_plugin_run_prints_it_first(tmp_path, plugin, capsys):
    d = plant_run(tmp_path, ["prune.criterion=evil"], "2026-01-01_00-00-00")
    argv = resume_argv([f"resume={d}"])
    err = capsys.readouterr().err
    assert "prune.criterion=evil" in err and "plugins" in err
    assert "prune.criterion=evil" in argv
    assert not plugin.exists()


def test_pruner_state_and_quant_plan_name_built_ins_only(plugin):
    model = nn.Sequential(nn.Linear(8, 8))
    pruner = sk.Pruner(model, 0.5)
    state = pruner.state_dict()
    state["criterion"] = "evil"
    with pytest.raises(UsageError, match="criterion='evil'"):
        pruner.load_state_dict(state)
    plan = sk.quant_plan(_quantized())
    plan["0"]["scheme"] = "evil"
    with pytest.raises(UnsafeFileError, match="quant plan entry '0' names quantization scheme"):
        sk.apply_quant_plan(nn.Sequential(nn.Linear(8, 8)), plan)
    assert not plugin.exists()


def _quantized() -> nn.Module:
    m = nn.Sequential(nn.Linear(8, 8))
    sk.quantize_(m, "int8_weight_only")
    return m


# --- 2. unpicklers admit plain data classes only; no file reaches the network ----------------

def test_dcp_metadata_naming_tcpstore_is_refused_before_any_connection(tmp_path):
    """A TCPStore importable from a DCP module was admitted before: constructing it connects.
    A listening socket (C++ connects bypass Python's socket layer) sees no connection."""
    import torch.distributed.checkpoint as dcp

    from sparsekit.run.distributed import load_sharded

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "c")
    module = "torch.distributed.checkpoint._async_process_executor"
    evil = (f"c{module}\nTCPStore\n(V127.0.0.1\nI{port}\nI1\nI00\ntR.").encode()
    (tmp_path / "c" / ".metadata").write_bytes(evil)
    with pytest.raises(UnsafeFileError, match=r"c/.metadata names .*TCPStore.*nothing in it"):
        load_sharded({"w": torch.zeros(3)}, tmp_path / "c")
    with pytest.raises(socket.timeout):
        server.accept()
    server.close()


def test_every_global_a_real_dcp_index_names_is_on_the_allow_list(tmp_path):
    from sparsekit.io.pickles import PLAIN_CLASSES
    from sparsekit.run.distributed import check_sharded_metadata, load_sharded, save_sharded

    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3,
             "masks": {"a": torch.ones(4, 4, dtype=torch.bool)}, "h": torch.ones(2).half()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_sharded(state, tmp_path / "s")
        with open(tmp_path / "s" / ".metadata", "rb") as f:
            Recorder(f).load()
        assert seen <= PLAIN_CLASSES
        check_sharded_metadata(tmp_path / "s")
        back = {"model": nn.Linear(4, 4).state_dict(), "optim": opt.state_dict(), "step": 0,
                "masks": {"a": torch.zeros(4, 4, dtype=torch.bool)}, "h": torch.zeros(2).half()}
        load_sharded(back, tmp_path / "s")
    assert back["step"] == 3 and torch.equal(back["model"]["weight"], model.weight.detach())


def test_the_no_network_fixture_fails_on_a_connect():
    with pytest.raises(pytest.fail.Exception, match="network access"):
        socket.create_connection(("example.com", 80), timeout=0.1)
    with pytest.raises(pytest.fail.Exception, match="network access"):
        socket.socket().connect(("127.0.0.1", 9))


def test_hf_config_with_remote_code_is_refused(hf_dirs, tmp_path):
    from sparsekit.models.hf import build_from_config, load_pretrained

    d = tmp_path / "m"
    d.mkdir()
    for f in hf_dirs["llama"].iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    config = json.loads((d / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "someone/repo--modeling.Evil"}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsafeFileError, match="auto_map names model code"):
        load_pretrained(d)
    with pytest.raises(UnsafeFileError, match="auto_map"):
        build_from_config(str(d / "config.json"))


@pytest.mark.parametrize("where", ["config.json", "header"])
def test_hf_config_naming_a_hub_attention_kernel_is_refused(hf_dirs, tmp_path, where):
    from sparsekit.models.hf import load_pretrained

    kernel = "kernels-community/flash-attn"
    if where == "config.json":
        d = tmp_path / "m"
        d.mkdir()
        for f in hf_dirs["llama"].iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        config = json.loads((d / "config.json").read_text())
        config["attn_implementation"] = kernel
        (d / "config.json").write_text(json.dumps(config))
        with pytest.raises(UnsafeFileError, match="attn_implementation='kernels-community"):
            load_pretrained(d)
        return
    model = load_pretrained(hf_dirs["llama"])
    path = tmp_path / "m.safetensors"
    sk.save(model, path)
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()["sparsekit"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    header["model"]["kwargs"]["config"]["_attn_implementation"] = kernel
    save_file(tensors, str(path), metadata={"sparsekit": json.dumps(header)})
    with pytest.raises(UnsafeFileError, match="_attn_implementation='kernels-community"):
        sk.load(path)


def test_hf_model_loads_offline_with_the_network_blocked(hf_dirs):
    from sparsekit.models.hf import load_pretrained, load_tokenizer

    model = load_pretrained(hf_dirs["llama"])
    assert load_tokenizer(hf_dirs["llama"]) is not None
    assert model(torch.tensor([[1, 2, 3]])).logits.isfinite().all()


# --- 3. a bad run directory does not block the others ----------------------------------------

@pytest.mark.parametrize("bad", [
    '- !!python/object/apply:os.system ["touch pwned"]\n',
    "[unclosed\n",
    "{not: a list}\n",
    "\x00\xff",
])
def test_bad_run_directory_is_skipped_with_a_note(tmp_path, bad, capsys):
    good = plant_run(tmp_path, ["prune.sparsity=0.5", "prune=unstructured"], "2026-01-01_00-00-00")
    bad_dir = plant_run(tmp_path, bad, "2026-01-02_00-00-00")
    os.utime(bad_dir / CHECKPOINT, (2e9, 2e9))
    assert latest_run(tmp_path / "runs") == good
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"skipped {bad_dir}" in err
    assert not (Path.cwd() / "pwned").exists() and not (tmp_path / "pwned").exists()


# --- 5. the silent wrongs -------------------------------------------------------------------

def test_model_path_and_data_path_without_a_recipe_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("hello\n")
    with pytest.raises(SystemExit) as exit_:
        main([f"model.path={tmp_path}", f"data.path={tmp_path / 't.txt'}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "model.path=" in err and "model=hf" in err
    cfg = Config()
    cfg.data.path = str(tmp_path / "t.txt")
    with pytest.raises(ConfigError, match="data.path=.* is read only by data=text"):
        validate(cfg)


def test_masked_lm_task_on_a_model_without_an_mlm_head_is_refused(hf_dirs, tmp_path):
    from transformers import BertModel

    from sparsekit.models.hf import load_pretrained

    bare = tmp_path / "bare"
    BertModel.from_pretrained(hf_dirs["bert"]).save_pretrained(bare)
    with pytest.raises(UsageError, match=r"holds no weights .* masked_lm .*set model.task="
                                         "feature_extraction"):
        load_pretrained(bare, "masked_lm")
    assert load_pretrained(hf_dirs["bert"], "masked_lm") is not None


def test_lm_task_on_a_classifier_is_refused_before_training(tmp_path):
    cfg = Config()
    cfg.cache_dir, cfg.data.kwargs = str(tmp_path / "cache"), {"num_samples": 200}
    cfg.data.task = "lm"
    cfg.train.quiet, cfg.tracker.kind = True, "none"
    with pytest.raises(UsageError, match=r"data.task=lm needs token logits .*\(2, 10\)"):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "cache" / "baselines").exists()  # nothing was trained


@pytest.mark.parametrize("recipe", ["llm_sparsegpt_24", "llm_wanda_24_distill", "stdlib_lm_24"])
@pytest.mark.parametrize("scheme", ["int8", "int8_weight_only", "fp8"])
def test_llm_recipes_keep_the_lm_head_out_of_every_scheme(recipe, scheme):
    from hydra import compose, initialize_config_dir

    from sparsekit.nn.select import name_matches
    from sparsekit.run.cli import register_configs
    from sparsekit.run.resources import conf_dir

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=[f"recipe={recipe}", f"quant={scheme}"])
    assert cfg.quant.scheme == scheme
    assert any(name_matches("lm_head", p) for p in cfg.quant.exclude)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        asked = compose("config", overrides=[f"recipe={recipe}", f"quant={scheme}",
                                             "quant.exclude=[]"])
    assert list(asked.quant.exclude) == []  # unless asked


def test_save_pretrained_of_a_quantized_model_keeps_its_function(hf_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    from sparsekit.models.hf import load_pretrained

    model = load_pretrained(hf_dirs["llama"])
    sk.quantize_(model, "int8_weight_only", exclude="lm_head")
    ids = torch.tensor([[1, 5, 9, 3]])
    want = model(ids).logits
    with pytest.warns(UserWarning, match="dequantized weights"):
        model.save_pretrained(tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    torch.testing.assert_close(back(ids).logits, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_quantize_and_prune_channels_refuse_non_finite_weights(bad):
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        m[0].weight[1, 2] = bad
    with pytest.raises(NumericsError, match="layer '0' has 1 non-finite"):
        sk.quantize_(m, "int8")
    assert isinstance(m[0], nn.Linear)  # nothing swapped
    with pytest.raises(NumericsError, match="layer '0' has 1 non-finite"):
        sk.prune_channels_(m, torch.randn(2, 8), ratio=0.5)
    assert m[0].out_features == 16


def test_empty_include_is_refused_not_read_as_everything():
    m = nn.Sequential(nn.Linear(8, 8))
    before = m[0].weight.detach().clone()
    for call in (lambda: sk.prune_(m, 0.5, include=[]),
                 lambda: sk.quantize_(m, "int8", include=[]),
                 lambda: sk.prune_channels_(m, torch.randn(1, 8), ratio=0.5, include=[])):
        with pytest.raises(UsageError, match=r"include=\[\] selects no layer"):
            call()
    assert torch.equal(m[0].weight, before) and isinstance(m[0], nn.Linear)
    assert sk.prune_(m, 0.5, include=None).global_sparsity == 0.5  # None: every layer


def test_pruner_finalize_before_step_and_step_after_finalize_are_refused():
    m = nn.Sequential(nn.Linear(8, 8))
    pruner = sk.Pruner(m, 0.5)
    with pytest.raises(UsageError, match=r"finalize\(\) before any step"):
        pruner.finalize()
    pruner.step(0)
    pruner.finalize()
    assert float((m[0].weight == 0).float().mean()) == 0.5
    with pytest.raises(UsageError, match=r"step\(\) after finalize"):
        pruner.step(1)
    with pytest.raises(UsageError, match="called already"):
        pruner.finalize()


# --- 6. unclear errors become one line naming the input --------------------------------------

@pytest.fixture
def good_file(tmp_path):
    path = tmp_path / "m.safetensors"
    sk.save(nn.Linear(4, 4), path)
    return path


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"device": "nope"}, UsageError, "device='nope' is not a torch device"),
    ({"model": "x"}, ConfigTypeError, "model must be a freshly built nn.Module.*got str"),
    ({"model": nn.Linear(4, 4), "strict": "no"}, ConfigTypeError, "strict must be True or False"),
    ({"accelerate": "yes"}, ConfigTypeError, "accelerate must be a dict"),
])
def test_load_arguments_are_checked_before_the_file(good_file, kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        sk.load(good_file, **kwargs)
    assert "not a valid" not in str(info.value) and "\n" not in str(info.value)


def test_load_of_a_directory_points_to_load_pretrained(tmp_path):
    with pytest.raises(UsageError, match="is a directory.*load_pretrained"):
        sk.load(tmp_path)


def test_degenerate_layers_get_a_sparsekit_error_or_a_skip():
    zero = nn.Sequential(nn.Linear(0, 4), nn.Linear(4, 4))
    report = sk.prune_(zero, 0.5)
    assert "0" in report.skipped and "zero-size" in report.skipped["0"]
    assert sk.quantize_(zero, "int8").skipped
    meta = nn.Sequential(nn.Linear(8, 8, device="meta"))
    with pytest.raises(UsageError, match="meta device.*materialize"):
        sk.prune_(meta, 0.5)
    with pytest.raises(ConfigTypeError, match=r"sparsities must be a list of numbers.*'0.5'"):
        sk.sensitivity(nn.Sequential(nn.Linear(8, 8)), lambda m: 1.0, sparsities="0.5")


def returns_a_string():
    return "train.csv"


def test_data_factory_returning_a_string_is_named():
    from sparsekit.data import build_data

    with pytest.raises(ConfigTypeError, match=r"data._target_=.*returned str .*\(train_dataset, "
                                              "eval_dataset\\)"):
        build_data("custom", f"{__name__}.returns_a_string")


def test_missing_tokenizer_is_one_clear_line(hf_dirs, tmp_path):
    from sparsekit.models.hf import load_tokenizer

    d = tmp_path / "no_tok"
    d.mkdir()
    (d / "config.json").write_text((hf_dirs["llama"] / "config.json").read_text())
    with pytest.raises(FileFormatError, match="holds no tokenizer .*tokenizer.save_pretrained") \
            as info:
        load_tokenizer(d)
    assert "\n" not in str(info.value)


def test_missing_data_path_is_reported_before_the_model_loads(hf_dirs, tmp_path, monkeypatch):
    import sparsekit.models.hf as hf

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the paths were checked")

    monkeypatch.setattr(hf, "load_pretrained", never)
    cfg = Config()
    cfg.model.name, cfg.model.path = "hf", str(hf_dirs["llama"])
    cfg.data.name, cfg.data.path = "text", str(tmp_path / "missing.txt")
    cfg.prune.pattern = "2:4"
    with pytest.raises(UsageError, match="data.path=.*missing.txt.*no such file"):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_missing_data_path_on_the_command_line_is_one_line_before_the_run(hf_dirs, tmp_path,
                                                                          monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for args, named in ((["model=hf", f"model.path={hf_dirs['llama']}", "data=text"],
                         "data=text needs data.path"),
                        (["model=hf", f"model.path={hf_dirs['llama']}", "data=text",
                          "data.path=nope/*.txt"], "data.path='nope/*.txt' matches no")):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and named in err, err
    assert not (tmp_path / "runs").exists()  # refused before the run directory was made
