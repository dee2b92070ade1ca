"""The command line's validation, fuzzed over every key of the composed config: a bad value is
one line naming the key (exit 2 on the command line), never a traceback; a value it accepts is
legal (every accepted number is finite and in the range the schema declares)."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest
from hydra import compose, initialize_config_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from sparsekit.run.cli import main, override_error, register_configs, with_value
from sparsekit.run.config import BUILTIN_KWARGS, INT_MAX, Config, numeric_fields
from sparsekit.run.resources import conf_dir

# what a careless user or an attacker types: NaN, inf, negative, zero, huge, wrong type, empty
NASTY = ["nan", "inf", "-inf", "-1", "-0.5", "0", "0.5", "1", "1e30", str(2**63), "''", "abc",
         "[]", "{}", "null", "true", "[nan]", "' '"]


def composed_config(overrides: list[str] | None = None) -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose("config", overrides=overrides or [])


@pytest.fixture(scope="module")
def base() -> DictConfig:
    return composed_config()


def leaf_keys(node: object, prefix: str = "") -> list[str]:
    """Every key of the composed config down to its leaves (free-form kwargs included)."""
    if isinstance(node, dict):
        out = []
        for k, v in node.items():
            out += leaf_keys(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]
        return out
    return []


BASE = composed_config()
KEYS = leaf_keys(OmegaConf.to_container(BASE))


def numeric_keys(cls: type = Config, prefix: str = "") -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    out = {f"{prefix}{n}": kind for n, (kind, _) in numeric_fields(cls).items()}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(numeric_keys(hints[f.name], f"{prefix}{f.name}."))
    return out


NUMERIC = numeric_keys()
for (_section, _name), _schema in BUILTIN_KWARGS.items():  # the default run's builders' kwargs
    if _name == getattr(Config(), _section).name:
        NUMERIC.update(numeric_keys(_schema, f"{_section}.kwargs."))


def value_of(cfg: Config, key: str) -> object:
    node: object = cfg
    for part in key.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def check(base: DictConfig, key: str, text: str) -> None:
    """``key=text``: refused in one line naming the key, or accepted with a legal value."""
    line = override_error(base, f"{key}={text}")
    if line is not None:
        assert "\n" not in line and len(line) < 500, line
        assert key.rpartition(".")[2] in line, (key, text, line)
        return
    parsed = OverridesParser.create().parse_override(f"{key}={text}").value()
    value = value_of(with_value(base, key, parsed), key)
    if key in NUMERIC and value is not None:  # independent of the declared ranges
        assert not isinstance(value, bool) and isinstance(value, (int, float)), (key, value)
        assert math.isfinite(value) and value >= 0, (key, text, value)  # no key takes < 0
        if NUMERIC[key] is int:
            assert isinstance(value, int) and value <= INT_MAX


def test_every_numeric_key_declares_its_range():
    """The rule is the schema's: an int/float key without a Range would not be checked."""
    missing = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for name, (_, allowed) in numeric_fields(cls).items():
            if allowed is None:
                missing.append(prefix + name)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")

    walk(Config, "")
    assert not missing
    assert {"train.finetune_lr", "train.dense_lr", "data.batch_size", "train.seed"} <= set(NUMERIC)


def test_builtin_kwargs_schemas_match_the_builders():
    """Same names and defaults as the functions they describe (a renamed or added argument
    of a builder must reach its schema)."""
    import inspect

    from sparsekit.data.hf_text import text_data
    from sparsekit.data.mnist1d import mnist1d
    from sparsekit.data.text import stdlib_text
    from sparsekit.models.cnn1d import mnist1d_cnn
    from sparsekit.models.lm import tiny_lm

    builders = {("data", "mnist1d"): mnist1d, ("data", "stdlib_text"): stdlib_text,
                ("data", "text"): text_data, ("model", "mnist1d_cnn"): mnist1d_cnn,
                ("model", "tiny_lm"): tiny_lm}
    assert set(builders) == set(BUILTIN_KWARGS)
    # given by the pipeline (data=text's seq_len is the key data.seq_len)
    given = {("data", "text"): {"cache_dir", "path", "tokenizer", "seq_len", "task"}}
    for key, fn in builders.items():
        params = {n: p.default for n, p in inspect.signature(fn).parameters.items()}
        want = {n: d for n, d in params.items() if n not in given.get(key, {"cache_dir"})}
        got = {f.name: f.default for f in dataclasses.fields(BUILTIN_KWARGS[key])}
        assert got == want, key


@pytest.mark.parametrize("text", ["nan", "inf", "-1", str(2**40)])
def test_every_numeric_key_refuses_nan_inf_negative_and_huge(base, text):
    """(a huge float such as train.grad_clip=1e12 is legal: no clipping)"""
    for key in [k for k, kind in NUMERIC.items() if kind is int or "." in text or "n" in text
                or text.startswith("-")]:
        line = override_error(base, f"{key}={text}")
        assert line is not None and "\n" not in line and key in line, (key, text, line)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(KEYS),
       text=st.one_of(st.sampled_from(NASTY), st.floats().map(repr),
                      st.integers(min_value=-2**70, max_value=2**70).map(str),
                      st.text(alphabet="abc/*.:_-", max_size=6)))
def test_fuzz_one_override_per_key(key, text):
    check(BASE, key, text)


@pytest.mark.slow
@pytest.mark.parametrize("key", KEYS)
def test_every_key_with_every_nasty_value(base, key):
    for text in NASTY:
        check(base, key, text)


@pytest.mark.parametrize("args", [["train.finetune_lr=-1"], ["train.dense_lr=nan"],
                                  ["data.batch_size=0"], ["prune.include=[]"]])
def test_regressions_are_one_line_and_exit_2(args, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and err.startswith("sparsekit: error: "), err
    assert args[0].split("=")[0] in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()
