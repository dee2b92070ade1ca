"""Every recipe and every option of every config group composes through Hydra and validates."""

from __future__ import annotations

import dataclasses

import pytest
from hydra import compose, initialize_config_dir

from sparsekit.run.cli import recipe_names, register_configs, to_config
from sparsekit.run.config import Config, ConfigError, parse_nm, validate
from sparsekit.run.resources import conf_dir, recipes_dir

GROUPS = ("model", "data", "prune", "schedule", "quant", "train", "tracker", "bench", "accel")


@pytest.fixture(scope="module")
def composer():
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        yield lambda overrides=(): to_config(compose("config", overrides=list(overrides)))


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def test_default_is_mnist1d_24(composer):
    cfg = composer()
    assert (cfg.model.name, cfg.data.name, cfg.prune.pattern, cfg.prune.fine_tune) == (
        "mnist1d_cnn", "mnist1d", "2:4", True
    )


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_composes_and_validates(composer, group):
    names = options(group)
    assert len(names) >= 2, f"group {group} has only {names}"
    for name in names:
        overrides = [f"{group}={name}"]
        if group == "prune" and name == "unstructured":
            overrides.append("schedule=cubic")
        if group == "train":  # the masks reach their target before the last fine-tuning step
            overrides.append("schedule.end=100")
        if name == "custom":  # the factory is the user's to name (??? = mandatory)
            overrides.append(f"{group}._target_=my.factory")
        cfg = composer(overrides)
        assert isinstance(cfg, Config)
        # every key of the file reached the config (nothing silently dropped)
        from omegaconf import OmegaConf

        file_cfg = OmegaConf.load(conf_dir() / group / f"{name}.yaml")
        section = getattr(cfg, group)
        for key in file_cfg:
            got = getattr(section, key)
            if key == "_target_" and name == "custom":
                assert got == "my.factory"
                continue
            if dataclasses.is_dataclass(got):
                got = dataclasses.asdict(got)
            assert OmegaConf.to_container(file_cfg)[key] == got, (group, name, key)


def test_agreed_schema_names():
    cfg = Config()
    assert {f.name for f in dataclasses.fields(cfg.prune)} >= {
        "pattern", "sparsity", "criterion", "scope", "include", "exclude",
        "calibration_batches", "strict", "fine_tune", "channel",
    }
    assert {f.name for f in dataclasses.fields(cfg.prune.channel)} == {
        "ratio", "criterion", "scope", "round_to", "steps", "exclude"
    }
    assert {f.name for f in dataclasses.fields(cfg.accel)} == {
        "enabled", "precision", "sparsity", "min_speedup", "siblings", "decode_dense", "capture"
    }
    assert {"none", "int8_weight_only", "int8", "fp8"} <= set(options("quant"))
    assert {"nm24", "unstructured", "none"} <= set(options("prune"))
    assert {"oneshot", "linear", "cubic"} <= set(options("schedule"))


def test_accel_capture_is_null_by_default_and_takes_a_bool(composer):
    assert composer(["accel=gpu"]).accel.capture is None
    assert composer(["accel=fp8", "accel.capture=false"]).accel.capture is False


def test_every_recipe_composes_and_changes_something(composer):
    names = recipe_names()
    assert {"mnist1d_cnn_24", "mnist1d_cnn_unstructured90_cubic", "mnist1d_cnn_24_wanda_oneshot",
            "stdlib_lm_24"} <= set(names)
    for name in names:
        assert (recipes_dir() / f"{name}.yaml").read_text().startswith("# @package _global_")
        cfg = composer([f"recipe={name}"])
        assert isinstance(cfg, Config)
    unstructured = composer(["recipe=mnist1d_cnn_unstructured90_cubic"])
    assert (unstructured.prune.pattern, unstructured.prune.sparsity) == ("unstructured", 0.9)
    assert unstructured.schedule.kind == "cubic"
    oneshot = composer(["recipe=mnist1d_cnn_24_wanda_oneshot"])
    assert (oneshot.prune.criterion, oneshot.prune.fine_tune) == ("wanda", False)
    lm = composer(["recipe=stdlib_lm_24"])
    assert (lm.model.name, lm.data.task, lm.prune.exclude) == ("tiny_lm", "lm", ["lm_head"])
    # plain overrides apply after the recipe
    assert composer(["recipe=stdlib_lm_24", "prune.pattern=4:8"]).prune.pattern == "4:8"


@pytest.mark.parametrize(
    ("change", "option"),
    [
        ({"pattern": "3:2"}, "prune.pattern"),
        ({"pattern": "2-4"}, "prune.pattern"),
        ({"pattern": "unstructured", "sparsity": 1.5}, "prune.sparsity"),
        ({"pattern": "unstructured", "sparsity": None}, "prune.sparsity"),
        ({"sparsity": 0.3}, "prune.sparsity"),  # contradicts 2:4
        ({"criterion": "random"}, "prune.criterion"),
        ({"scope": "model"}, "prune.scope"),
    ],
)
def test_validate_names_the_option(change, option):
    cfg = Config()
    for k, v in change.items():
        setattr(cfg.prune, k, v)
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")) as e:
        validate(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("scheme,precision,ok", [
    ("fp8_static", "bf16", False), ("fp8_static", "fp8", True), ("int8", "fp8", False),
    ("int8", "int8", True), ("int8_weight_only", "bf16", True), ("none", "int8", True),
    ("fp8_weight_only", "fp8w", True), ("fp8_weight_only", "fp8", False),
    ("fp8", "fp8w", False)])
def test_accel_precision_must_keep_the_quant_schemes_numerics(scheme, precision, ok):
    """A W8A8-quantized model runs accelerated only at its own activation format: caught
    before the run starts, not at the accel stage after training."""
    cfg = Config()
    cfg.quant.scheme, cfg.accel.enabled, cfg.accel.precision = scheme, True, precision
    if ok:
        validate(cfg)
        return
    with pytest.raises(ConfigError, match=r"accel\.precision=.* set accel\.precision=") as e:
        validate(cfg)
    assert "\n" not in str(e.value)


def test_parse_nm():
    assert parse_nm("2:4") == (2, 4)
    assert parse_nm("4:8") == (4, 8)
    assert parse_nm("unstructured") is None
    for bad in ("3:2", "0:4", "4:4", "a:b", "2:"):
        with pytest.raises(ConfigError):
            parse_nm(bad)


def test_enum_fields_take_strings_and_give_plain_values():
    from sparsekit.run.config import Scope, TrackerKind, choices

    cfg = Config()
    cfg.prune.scope, cfg.tracker.kind = "global", "none"
    cfg.prune.pattern, cfg.prune.sparsity = "unstructured", 0.5
    validate(cfg)
    assert cfg.prune.scope is Scope["global"] and cfg.tracker.kind is TrackerKind.none
    assert cfg.prune.scope == "global" and f"{cfg.prune.scope}" == "global"
    # every enum of the schema is listed with its values, and so are the registry-backed keys
    listed = choices()
    assert listed["prune.scope"] == ("layer", "global")
    assert listed["schedule.kind"] == ("oneshot", "linear", "cubic")
    assert listed["quant.scheme"] == ("none", "int8_weight_only", "fp8_weight_only", "int8",
                                      "fp8", "int8_static", "fp8_static", "fp8_static_tensor",
                                      "int4_weight", "int4_weight_g64", "int4_weight_g32",
                                      "int4_weight_channel")
    assert listed["quant.method"] == ("rtn", "gptq")
    assert listed["accel.precision"] == ("bf16", "fp8", "fp8w", "int8", "int4")
    for key, values in listed.items():  # each value is accepted, and nothing else
        section, _, name = key.rpartition(".")
        node = cfg
        for part in section.split("."):
            node = getattr(node, part)
        before = getattr(node, name)
        setattr(node, name, "no-such-value")
        with pytest.raises(ConfigError, match=f"{key}='no-such-value' is not allowed; choose "
                                              f"one of: {', '.join(values)}"):
            validate(cfg)
        setattr(node, name, before)


def test_range_checks_live_in_the_dataclasses():
    from sparsekit.run.config import DistillConfig, ScheduleConfig

    with pytest.raises(ConfigError,
                       match=r"train\.distill\.alpha=1\.5 must be a finite number in \[0, 1\]"):
        DistillConfig(alpha=1.5)
    with pytest.raises(ConfigError, match=r"schedule\.end=1 must be >= schedule\.start=5"):
        ScheduleConfig(start=5, end=1)
    with pytest.raises(ConfigError, match=r"schedule\.kind='step' is not allowed"):
        ScheduleConfig(kind="step")
    assert ScheduleConfig(kind="cubic").kind == "cubic"


def test_channel_keys_are_criterion_and_exclude_as_in_the_api(composer):
    cfg = composer(["prune=channel", "prune.channel.criterion=lamp",
                    "prune.channel.exclude=[fc]"])
    assert cfg.prune.channel.criterion == "lamp" and cfg.prune.channel.exclude == ["fc"]


def test_every_registered_scheme_has_a_quant_config_file():
    from sparsekit.quant.formats import SCHEMES
    from sparsekit.run.resources import conf_dir

    files = {p.stem for p in (conf_dir() / "quant").glob("*.yaml")}
    assert files == {"none", *SCHEMES.names()}


def test_gptq_options_are_checked():
    cfg = Config()
    cfg.quant.scheme, cfg.quant.method = "int8", "gptq"
    with pytest.raises(ConfigError, match="quant.method=gptq quantizes int4 weights"):
        validate(cfg)
    cfg.quant.scheme, cfg.quant.qat = "int4_weight", True
    with pytest.raises(ConfigError, match="post-training"):
        validate(cfg)
    cfg.quant.qat, cfg.prune.criterion, cfg.prune.fine_tune = False, "sparsegpt", False
    cfg.schedule.kind, cfg.quant.exclude = "oneshot", ["lm_head"]
    with pytest.raises(ConfigError, match="same include/exclude"):
        validate(cfg)
    cfg.prune.exclude = ["lm_head"]
    validate(cfg)
    cfg.quant.act_order = True
    with pytest.raises(ConfigError, match="act_order=true cannot go with a joint"):
        validate(cfg)
