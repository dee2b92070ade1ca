"""The ``sparsekit`` command: a Hydra app over conf/ (the only module that imports Hydra).

Recipes (recipes/*.yaml, ``# @package _global_`` overlays) are registered as the ``recipe``
config group, so ``sparsekit recipe=NAME`` works from a checkout and from an installed wheel.
Bad input (an unknown option, a value outside its allowed set) is reported as one line naming
the option and the allowed values, with exit code 2.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sparsekit.config import Config, validate
from sparsekit.data import check_data_name
from sparsekit.distributed import is_main, share_run_dir
from sparsekit.models import check_model_name
from sparsekit.resources import conf_dir, recipes_dir

EXIT_USAGE = 2
RUNS = Path("runs")
_FLAGS_WITHOUT_CHECK = ("--help", "-h", "--hydra-help", "--info", "--version", "--shell-completion",
                        "-sc", "--cfg", "-c", "--resolve", "--package", "-p")


def recipe_names() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def register_configs() -> None:
    """The schema as ``sparsekit_schema`` and every recipe file as option ``recipe/<name>``."""
    cs = ConfigStore.instance()
    cs.store(name="sparsekit_schema", node=Config)
    for name in recipe_names():
        node = OmegaConf.load(recipes_dir() / f"{name}.yaml")
        cs.store(group="recipe", name=name, node=node, package="_global_")


def to_config(cfg: DictConfig) -> Config:
    """The composed Hydra config as the :class:`~sparsekit.config.Config` dataclass, validated."""
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg
    config = OmegaConf.to_object(cfg)
    assert isinstance(config, Config)
    validate(config)
    check_model_name(config.model.name, config.model._target_)
    check_data_name(config.data.name, config.data._target_)
    return config


def one_line(err: BaseException) -> str:
    """A Hydra/OmegaConf/sparsekit error as one line naming the option and allowed values."""
    text = str(err)
    missing = re.search(r"Could not find '([^']+)/([^']+)'", text)
    if missing:
        group, option = missing.groups()
        allowed = recipe_names() if group == "recipe" else sorted(
            p.stem for p in (conf_dir() / group).glob("*.yaml")
        )
        return f"{group}={option}: unknown option; allowed: {', '.join(allowed)}"
    unknown = re.search(r"Could not override '([^']+)'", text)
    if unknown:
        key = unknown.group(1)
        parent, _, _ = key.rpartition(".")
        node = Config()
        for part in filter(None, parent.split(".")):
            node = getattr(node, part, None)
        if not dataclasses.is_dataclass(node):  # a free-form dict such as model.kwargs
            return f"{key}: not in the config; add a new key with +{key}=VALUE"
        allowed = ", ".join(f.name for f in dataclasses.fields(node))
        return f"{key}: unknown key; allowed keys{' in ' + parent if parent else ''}: {allowed}"
    parse = re.search(
        r"Error parsing override '([^']*)'|LexerNoViableAltException: ([^;\n]*)", text
    )
    if parse:
        bad = (parse.group(1) or parse.group(2) or "").strip()
        return f"cannot parse {bad!r}: arguments are key=value or group=option (see --help)"
    cause = err.__cause__
    merging = re.search(r"Error merging override (\S+)", text)
    if merging and cause is not None:
        return f"{merging.group(1)}: {str(cause).splitlines()[0]}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("object_type=", "reference_type="))]
    return "; ".join(lines)


def fail(err: BaseException) -> None:
    print(f"sparsekit: error: {one_line(err)}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def _variants(overrides: Sequence[str]) -> list[list[str]]:
    """Override lists covering every value of every sweep (``a=1,2``) at least once."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    base = []
    sweeps: list[tuple[int, list[str]]] = []
    for i, o in enumerate(parsed):
        if o.is_sweep_override():
            values = [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
            base.append(values[0])
            sweeps.append((i, values))
        else:
            base.append(overrides[i])
    out = [base]
    for i, values in sweeps:
        for v in values[1:]:
            out.append([*base[:i], v, *base[i + 1 :]])
    return out


def check_overrides(overrides: Sequence[str]) -> None:
    """Compose and validate the config for ``overrides`` (each sweep value too); on bad input
    print one line and exit with code 2."""
    overrides = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    try:
        variants = _variants(overrides)
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            for variant in variants:
                to_config(compose("config", overrides=variant))
    except (HydraException, OmegaConfBaseException, ValueError, TypeError) as e:
        fail(e)


def latest_run(root: Path = RUNS) -> Path | None:
    """The most recently written unfinished run directory under ``root`` (no summary.json):
    one with a resume checkpoint, or one killed before its first (during dense training)."""
    from sparsekit.pipeline import CHECKPOINT

    def written(run_dir: Path) -> float | None:
        if (run_dir / "summary.json").exists():
            return None  # finished: resume=DIR still re-runs its last stages
        for f in (run_dir / CHECKPOINT, run_dir / "config.yaml"):
            if f.exists():
                return f.stat().st_mtime
        return None

    found = [(t, d) for d in root.glob("*/") if (t := written(d)) is not None
             and (d / ".hydra" / "overrides.yaml").exists()]
    return max(found)[1] if found else None


def resume_argv(argv: list[str]) -> list[str]:
    """``resume=true`` / ``resume=DIR``: rerun with the original overrides of that run (from
    its .hydra/overrides.yaml) inside its directory; other arguments are kept after them."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith("resume=")]
    if not values or values[-1].lower() in ("false", "no", "0", "null", ""):
        return argv
    value = values[-1]
    run_dir = latest_run() if value.lower() in ("true", "yes", "1") else Path(value)
    if run_dir is None:
        fail(ValueError(
            f"resume={value}: no unfinished run under {RUNS.resolve()}"))
    if not (run_dir / ".hydra" / "overrides.yaml").exists():
        fail(ValueError(f"resume={value}: {run_dir} is not a sparsekit run directory"))
    original = [
        str(o) for o in OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")
        if not str(o).startswith("resume=")
    ]
    rest = [a for a in argv if not a.startswith("resume=")]
    run_dir = run_dir.resolve()
    return [*original, *rest, f"hydra.run.dir='{run_dir}'", "resume=true"]


def _app(cfg: DictConfig) -> None:
    from sparsekit.pipeline import run

    try:
        config = to_config(cfg)
    except (ValueError, TypeError, OmegaConfBaseException) as e:
        fail(e)
    resume = str(config.resume).lower() not in ("false", "none", "no", "0")
    try:
        summary = run(config, HydraConfig.get().runtime.output_dir, resume=resume)
    except (ValueError, TypeError) as e:
        if os.environ.get("SPARSEKIT_DEBUG"):
            raise
        print(f"sparsekit: error: {one_line(e)} (SPARSEKIT_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    if is_main():
        print(summary["table"])


class SweepFigures(Callback):
    """Registered in conf/config.yaml: when a sweep (``-m``) ends, its Pareto figure
    (``<sweep dir>/pareto.png`` and a TensorBoard image in ``<sweep dir>/tb/sweep``)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: object) -> None:
        from sparsekit.tracking import sweep_figures

        png = sweep_figures(config.hydra.sweep.dir)
        if png is not None:
            print(f"sweep figure: {png}")


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``sparsekit`` console script and ``python -m sparsekit``."""
    import hydra

    argv = list(sys.argv[1:] if argv is None else argv)
    register_configs()
    argv = resume_argv(argv)
    argv = share_run_dir(argv)  # torchrun: every rank writes into rank 0's run directory
    if not any(a in _FLAGS_WITHOUT_CHECK for a in argv):
        check_overrides([a for a in argv if not a.startswith("-")])
    app = hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_app)
    saved, sys.argv = sys.argv, [sys.argv[0] or "sparsekit", *argv]
    try:
        app()
    finally:
        sys.argv = saved
