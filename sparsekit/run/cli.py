"""The ``sparsekit`` command: a Hydra app over conf/ (the only module that imports Hydra).

Recipes (recipes/*.yaml, ``# @package _global_`` overlays) are registered as the ``recipe``
config group, so ``sparsekit recipe=NAME`` works from a checkout and from an installed wheel.
Bad input (an unknown option, a value outside its allowed set) is reported as one line naming
the option and the allowed values, with exit code 2.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)

from sparsekit.run.config import (
    Config,
    checks_registries,
    choices,
    enum_fields,
    plugin_keys,
    without_registries,
)
from sparsekit.errors import RunPaused, SparsekitError, StorageError, UsageError
from sparsekit.run.resources import conf_dir, recipes_dir

# torch (and what imports it: the registries, models, data, run/distributed) is imported only
# after the command line passed its first check (:func:`main`): a mistake is answered in about
# a second, not after torch's import

EXIT_USAGE = 2
EXIT_RUNTIME = 1
ISSUES = "the sparsekit issue tracker (where you got sparsekit)"
RUNS = Path("runs")
_FLAGS_WITHOUT_CHECK = ("--help", "-h", "--hydra-help", "--info", "--version", "--shell-completion",
                        "-sc", "--cfg", "-c", "--resolve", "--package", "-p")


def recipe_names() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def group_options(group: str) -> list[str]:
    """The options of config group ``group`` (``recipe``: the recipes)."""
    if group == "recipe":
        return recipe_names()
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def choices_help() -> str:
    """``--help``'s list of the options with a fixed or registered set of values: taken from
    the schema's enums and the registries (criteria, quantization schemes, accel variants)."""
    return "\n".join(f"{key}: {', '.join(values)}" for key, values in choices().items())


def register_configs() -> None:
    """The schema as ``sparsekit_schema``, every recipe file as option ``recipe/<name>``, and
    the ``sparsekit_choices`` resolver that ``--help`` prints the allowed values with."""
    OmegaConf.register_new_resolver("sparsekit_choices", choices_help, replace=True,
                                    use_cache=False)
    cs = ConfigStore.instance()
    with without_registries():  # the defaults (checked in full by every run): no torch here
        cs.store(name="sparsekit_schema", node=Config)
    cs.repo.pop("recipe", None)  # a recipe=file: of an earlier main() in this process
    for name in recipe_names():
        node = OmegaConf.load(recipes_dir() / f"{name}.yaml")
        cs.store(group="recipe", name=name, node=node, package="_global_")


_SPECIAL = re.compile(r"_(target|args|partial|recursive|convert)_")
_TARGETS = ("model._target_", "data._target_")  # the schema's two documented factories


def check_keys(cfg: DictConfig, schema: type = Config, prefix: str = "") -> None:
    """Refuse keys the schema does not have: a ``+key=VALUE`` added to a section of the schema
    (``+prune.foo=1``) is an unknown key, as is a Hydra special key (``_target_``, ``_args_``,
    ...) anywhere but ``model._target_`` and ``data._target_``, free-form dicts included;
    nothing added is silently ignored."""
    fields = {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) \
        else None
    for key in cfg:
        full = f"{prefix}{key}"
        if str(key) == "hydra" and not prefix:
            continue
        if (fields is not None and key not in fields) or (
                _SPECIAL.fullmatch(str(key)) and full not in _TARGETS):
            parent = prefix.rstrip(".")
            if fields is None:
                raise UsageError(f"{full}: unknown key; Hydra's special keys (_target_, _args_, "
                                 f"...) are allowed only as {' and '.join(_TARGETS)}")
            raise UsageError(f"{full}: unknown key; allowed keys"
                             f"{' in ' + parent if parent else ''}: {', '.join(fields)}")
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_none():
            sub = OmegaConf.get_type(node)
            check_keys(node, sub if dataclasses.is_dataclass(sub) else dict, f"{full}.")


def to_config(cfg: DictConfig) -> Config:
    """The composed Hydra config as the :class:`~sparsekit.run.config.Config` dataclass,
    validated (within :func:`~sparsekit.run.config.without_registries`: all but the names
    registries hold and the input paths, importing no torch); no key beyond the schema's
    (:func:`check_keys`)."""
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg
    check_keys(cfg)
    config = OmegaConf.to_object(cfg)  # each dataclass checks its values (__post_init__)
    assert isinstance(config, Config)
    if not checks_registries():
        return config
    from sparsekit.data import check_data_name
    from sparsekit.models import check_model_name

    check_model_name(config.model.name, config.model._target_)
    check_data_name(config.data.name, config.data._target_)
    from sparsekit.run.loading import check_input_paths

    check_input_paths(config, complete=False)  # a missing file: reported before any work
    return config


def with_value(composed: DictConfig, key: str, value: object) -> Config:
    """A copy of the composed config with ``key`` set to ``value`` (a plain ``key=value``
    override, as Hydra applies it), validated: what each value of a swept key is checked as."""
    cfg = copy.deepcopy(composed)
    OmegaConf.update(cfg, key, value, merge=True)
    return to_config(cfg)


def override_error(composed: DictConfig, override: str) -> str | None:
    """The one-line error (what ``sparsekit`` prints after ``sparsekit: error:``) of one
    ``key=value`` override of a config key, applied to the composed config ``composed`` as
    Hydra applies it; None when the config it makes is valid. The in-process check the CLI
    fuzz tests run on every key (composing anew per value takes ~0.3 s)."""
    try:
        o = OverridesParser.create().parse_override(override)
        with_value(composed, o.key_or_group, o.value())
    except (HydraException, OmegaConfBaseException, ValueError, TypeError) as e:
        return one_line(e)
    return None


def _reason(err: OverrideParseException) -> str:
    """The parser's own reason for a bad override (its first line), when it says more than
    "Error parsing override"."""
    first = (err.message.strip().splitlines() or [""])[0]
    return "" if first.startswith("Error parsing override") else f"{first}; "


def _omegaconf_line(err: OmegaConfBaseException) -> str:
    """One line from an OmegaConf error's fields: the option (``full_key``), the value, and
    for an unknown key the keys allowed there, for an enum the values allowed."""
    key, owner = err.full_key, err.object_type
    msg = (str(err.msg or "").strip().splitlines() or [""])[0]
    if isinstance(err, (ConfigAttributeError, ConfigKeyError)) and err.value is None:
        parent = key.rpartition(".")[0]
        if not dataclasses.is_dataclass(owner):  # a free-form dict such as model.kwargs
            return f"{key}: not in the config; add a new key with +{key}=VALUE"
        allowed = ", ".join(f.name for f in dataclasses.fields(owner))
        return f"{key}: unknown key; allowed keys{' in ' + parent if parent else ''}: {allowed}"
    enum = (enum_fields(owner).get(str(err.key))
            if dataclasses.is_dataclass(owner) and err.key is not None else None)
    if isinstance(err, ValidationError) and enum is not None:
        allowed = ", ".join(str(v.value) for v in enum)
        return f"{key}={err.value!r} is not allowed; choose one of: {allowed}"
    return f"{key}={err.value}: {msg}" if err.value is not None else f"{key}: {msg}"


def one_line(err: BaseException) -> str:
    """A Hydra/OmegaConf/sparsekit error as one line naming the option and allowed values,
    built from the exceptions' fields (Hydra's ``override``/``options``, OmegaConf's
    ``full_key``/``value``/``object_type``, anywhere in the chain of causes)."""
    if isinstance(err, OverrideParseException):
        return f"cannot parse {err.override!r}: {_reason(err)}arguments are key=value or " \
            "group=option (see --help)"
    if isinstance(err, MissingConfigException) and err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.rpartition("/")
        allowed = err.options if err.options is not None else group_options(group)
        return f"{group}={option}: unknown option; allowed: {', '.join(allowed)}"
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, OmegaConfBaseException) and cause.full_key:
            return _omegaconf_line(cause)
        cause = cause.__cause__
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return "; ".join(ln for ln in lines if not ln.startswith(("object_type=", "reference_type=")))


def fail(err: BaseException, code: int = EXIT_USAGE) -> None:
    """Print ``err`` as one line ``sparsekit: error: ...`` and exit with ``code``."""
    print(f"sparsekit: error: {one_line(err)}", file=sys.stderr)
    raise SystemExit(code)


def exit_code(err: BaseException) -> int:
    """2 for a usage error (a bad option or value), 1 for any other error found while running."""
    return EXIT_USAGE if isinstance(err, UsageError) else EXIT_RUNTIME


def _raised_by_sparsekit(err: BaseException) -> bool:
    """Whether ``err`` was raised in sparsekit's own code (a deliberate message about the
    input), not inside torch or another library (then it is unexpected: a bug)."""
    tb = err.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    package = Path(__file__).parents[1].resolve()
    return last is not None and Path(last).resolve().is_relative_to(package)


def report_runtime_error(err: BaseException) -> None:
    """An error while running: one line and exit 1 (exit 2 for a usage error) when it is one
    sparsekit raised about the input, a file or the storage; otherwise the traceback and a line
    saying it is a bug. ``SPARSEKIT_DEBUG=1`` shows the traceback of every error."""
    if isinstance(err, OSError) and not isinstance(err, SparsekitError):
        where = "" if err.filename is None else f"cannot write or read {err.filename}: "
        err = StorageError(f"{where}{err.strerror or err}")
    deliberate = isinstance(err, SparsekitError) or (
        isinstance(err, (ValueError, TypeError)) and _raised_by_sparsekit(err)
    )
    if deliberate and not os.environ.get("SPARSEKIT_DEBUG"):
        fail(err, exit_code(err))
    traceback.print_exception(err)
    if not deliberate:
        print(
            f"sparsekit: internal error: an unexpected {type(err).__name__} is a bug (sparsekit "
            "should have said what is wrong); please report it with the command line and the "
            f"traceback above at {ISSUES}",
            file=sys.stderr,
        )
    raise SystemExit(exit_code(err))


FILE_RECIPE = "file:"
_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _option_values(override: Override) -> list[object]:
    """The options a group override picks (each value of a sweep; none for ``~group``)."""
    if override.is_sweep_override():
        return list(override.sweep_string_iterator())
    value = override.value()
    return list(value) if isinstance(value, list) else [value]


def check_group_options(overrides: Sequence[str]) -> None:
    """Every config group option on the command line is a packaged one: an option of conf/'s
    groups or recipes/, never a path to another YAML file (``recipe=../../tmp/x``,
    ``model=/tmp/x``: Hydra would load it, and a ``_target_`` in it would be imported).
    ``recipe=file:PATH`` names a recipe file explicitly: it is checked and registered
    (:func:`register_file_recipe`). Hydra's own groups (``hydra/launcher=...``) take plain
    names only."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    for o in parsed:
        group = o.key_or_group
        if "/" in group:
            if not group.startswith("hydra/") or not all(
                    _PLAIN.fullmatch(part) for part in group.split("/")):
                raise UsageError(f"{o.input_line}: unknown config group {group!r}; groups: "
                                 f"{', '.join(['recipe', *_groups()])}")
        elif not _is_group(o):
            continue
        for value in _option_values(o):
            if value is None:
                continue
            if group == "recipe" and isinstance(value, str) and value.startswith(FILE_RECIPE):
                register_file_recipe(value)
                continue
            if "/" in group:
                ok = isinstance(value, str) and _PLAIN.fullmatch(value) and ".." not in value
                if not ok:
                    raise UsageError(f"{group}={value}: not an option name (a plain name, "
                                     "not a path)")
                continue
            allowed = group_options(group)
            if value not in allowed:
                file_form = "; a recipe of your own: recipe=file:PATH" if group == "recipe" else ""
                raise UsageError(f"{group}={value}: unknown option; allowed: "
                                 f"{', '.join(allowed)}{file_form}")


def _groups() -> list[str]:
    return sorted(p.name for p in conf_dir().iterdir() if p.is_dir())


def _recipe_file_error(value: str, why: str) -> UsageError:
    return UsageError(f"recipe={value}: {why} (recipe=file:PATH names a YAML overlay of config "
                      "keys and 'override /GROUP: OPTION' defaults; docs/cli.md#your-own-recipe)")


def check_recipe_file(node: object, value: str) -> None:
    """A recipe file holds config keys of the schema and a defaults list of packaged group
    options only: no ``hydra`` key, no ``_target_`` (or other Hydra special key) anywhere,
    no defaults entry that is a path: nothing read from a file picks code."""
    if not isinstance(node, DictConfig):
        raise _recipe_file_error(value, "not a YAML mapping")
    fields = {f.name for f in dataclasses.fields(Config)}
    for key in node:
        if key != "defaults" and key not in fields:
            raise _recipe_file_error(value, f"unknown key {key!r}; allowed: defaults, "
                                     f"{', '.join(sorted(fields))}")

    def walk(n: object, where: str) -> None:
        if isinstance(n, DictConfig):
            for k in n:
                if _SPECIAL.fullmatch(str(k)):
                    raise _recipe_file_error(value, f"{where}{k}: a file may not name code")
                walk(n._get_node(k), f"{where}{k}.")
        elif isinstance(n, ListConfig):
            for i, item in enumerate(n._iter_ex(resolve=False)):
                walk(item, f"{where}{i}.")

    walk(node, "")
    defaults = node.get("defaults", [])
    if not isinstance(defaults, ListConfig):
        raise _recipe_file_error(value, "defaults is not a list")
    for entry in defaults:
        if entry == "_self_":
            continue
        item = OmegaConf.to_container(entry) if isinstance(entry, DictConfig) else None
        key, option = next(iter(item.items())) if isinstance(item, dict) and len(item) == 1 \
            else (None, None)
        group = str(key).removeprefix("override /") if key is not None else ""
        if (not str(key).startswith("override /") or group not in _groups()
                or option not in group_options(group)):
            raise _recipe_file_error(value, f"defaults entry {entry!r} is not "
                                     "'override /GROUP: OPTION' with a packaged option")


def register_file_recipe(value: str) -> None:
    """Register ``recipe=file:PATH``'s file as that option of the ``recipe`` group, after
    :func:`check_recipe_file`; the path is the user's, typed as a file."""
    path = Path(value[len(FILE_RECIPE):]).expanduser()
    if not path.is_file():
        raise _recipe_file_error(value, "no such file")
    if path.suffix not in (".yaml", ".yml"):
        raise _recipe_file_error(value, "not a .yaml file")
    try:
        node = OmegaConf.load(path)
    except Exception as e:  # noqa: BLE001 - any unreadable or invalid YAML is one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise _recipe_file_error(value, f"cannot read it: {first}") from None
    check_recipe_file(node, value)
    group, _, name = f"recipe/{value}".rpartition("/")
    ConfigStore.instance().store(group=group, name=name, node=node, package="_global_")


def _is_group(override: Override) -> bool:
    """Whether ``override`` picks a config group option (``prune=nm24``, ``recipe=...``)."""
    group = override.key_or_group
    return group == "recipe" or (conf_dir() / group).is_dir()


def check_overrides(overrides: Sequence[str]) -> None:
    """Compose and validate the config for ``overrides`` (each sweep value too); on bad input
    print one line and exit with code 2. The config is composed once, with the first value of
    each sweep; every other value of a swept key is set on a copy of it (as Hydra applies a
    ``key=value`` override), and only a swept group option is composed anew."""
    variant = list(overrides)
    try:
        check_group_options(overrides)
        overrides = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
        variant = list(overrides)
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        sweeps = [(i, o) for i, o in enumerate(parsed) if o.is_sweep_override()]
        base = list(overrides)
        for i, o in sweeps:
            base[i] = f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}"
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            variant = base
            composed = compose("config", overrides=base)
            config = to_config(composed)
            if checks_registries():
                from sparsekit.run.loading import check_input_paths

                check_input_paths(config)  # data=text's data.path too, before the run
            for i, o in sweeps:
                values = zip(list(o.sweep_string_iterator())[1:], list(o.sweep_iterator())[1:])
                for text, value in values:
                    variant = [*base[:i], f"{o.get_key_element()}={text}", *base[i + 1:]]
                    if _is_group(o) or o.is_add() or o.is_force_add() or o.is_delete():
                        to_config(compose("config", overrides=variant))
                        continue
                    with_value(composed, o.key_or_group, value)
    except (HydraException, OmegaConfBaseException, ValueError, TypeError) as e:
        line = one_line(e)
        keys = [o.split("=", 1)[0].lstrip("+~") for o in variant]
        if not any(k and k in line for k in keys):  # say which arguments it is about
            line = f"{' '.join(variant)}: {line}"
        print(f"sparsekit: error: {line}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None



def imports_code(overrides: Sequence[object]) -> list[str]:
    """The overrides of a recorded run that may import code beyond sparsekit's registered
    choices: any ``_target_``, a ``custom`` model or data, any ``hydra`` key or group
    (launchers, callbacks, search path), a flag, or anything that is not a plain
    ``key=value`` on the config. Empty when replaying the run imports nothing of the user's."""
    fields = {f.name for f in dataclasses.fields(Config)}
    options = {p.name: {f.stem for f in p.glob("*.yaml")} - {"custom"}
               for p in conf_dir().iterdir() if p.is_dir()}
    options["recipe"] = set(recipe_names())
    flagged = []
    for o in overrides:
        text = str(o)
        key, eq, value = text.partition("=")
        parts = re.split(r"[./@]", key.lstrip("+~"))
        if parts[0] in options and (len(parts) == 1 or "@" in key):  # a group: packaged option
            safe = value.strip() in options[parts[0]]
        else:
            safe = parts[0] in fields and not any(p.startswith("_") for p in parts)
        if not isinstance(o, str) or not eq or not safe or _SPECIAL.search(text):
            flagged.append(text)
    return flagged


def needs_plugin(overrides: Sequence[object]) -> list[str]:
    """The recorded overrides that name an installed plugin (an entry point) where a built-in
    is expected (:func:`~sparsekit.run.config.plugin_keys`): a run directory never chooses
    which plugin code runs (``sparsekit.registry.from_file``); ``none`` is no scheme."""
    flagged = []
    for o in overrides:
        key, eq, value = str(o).partition("=")
        registry = plugin_keys().get(key.lstrip("+~"))
        if registry is not None and eq and value != "none" and not registry.in_code(value):
            flagged.append(f"{o} (not a built-in {registry.kind}: a plugin?)")
    return flagged


def unsafe_overrides(overrides: Sequence[object]) -> list[str]:
    """What replaying these recorded overrides would run beyond sparsekit's built-ins:
    :func:`imports_code` and :func:`needs_plugin`."""
    return [*imports_code(overrides), *needs_plugin(overrides)]


def _recorded_overrides(run_dir: Path) -> list | None:
    """The overrides recorded in ``run_dir/.hydra/overrides.yaml`` (plain YAML data: a
    python-tagged object is refused), or None when there is no readable list of them."""
    try:
        overrides = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "overrides.yaml"))
    except Exception:  # noqa: BLE001 - any bad file (YAML errors, tags, ...) is no run to resume
        return None
    return overrides if isinstance(overrides, list) else None


def _skip_note(run_dir: Path, why: str) -> None:
    print(f"sparsekit: resume=true: skipped {run_dir}: {why}", file=sys.stderr)


def latest_run(root: Path = RUNS) -> Path | None:
    """The most recently written run under ``root`` that can continue: its ``run_state.json``
    says ``running`` and its process is gone (killed), or ``failed`` after writing a resume
    checkpoint; never a run whose process still runs on this host, a finished
    run, one that failed before its first checkpoint, or one whose recorded overrides import
    code (:func:`imports_code`: name such a run with ``resume=DIR``). Runs from before
    ``run_state.json`` count when they have no summary.json."""
    from sparsekit.run.pipeline import CHECKPOINT
    from sparsekit.io.runstate import previous_path, read_run_state, still_running

    def written(run_dir: Path) -> float | None:
        checkpoints = [f for f in (run_dir / CHECKPOINT, previous_path(run_dir / CHECKPOINT))
                       if f.exists()]
        info = read_run_state(run_dir)
        if info is None and (run_dir / "summary.json").exists():
            return None  # finished: resume=DIR still re-runs its last stages
        if info is not None and (info["state"] == "finished"
                                 or (info["state"] == "failed" and not checkpoints)
                                 or still_running(info)):
            return None
        for f in [*checkpoints, run_dir / "config.yaml"]:
            if f.exists():
                return f.stat().st_mtime
        return None

    found = []
    for d in sorted(root.glob("*/")):
        try:
            t = written(d)
        except Exception as e:  # noqa: BLE001 - one damaged directory never blocks the others
            _skip_note(d, f"unreadable run state ({type(e).__name__})")
            continue
        if t is None:
            continue
        overrides = _recorded_overrides(d)
        if overrides is None:
            _skip_note(d, ".hydra/overrides.yaml is missing or not a plain YAML list")
            continue
        risky = unsafe_overrides(overrides)
        if risky:
            _skip_note(d, f"it replays {' '.join(risky)}; name it with resume=DIR to replay that")
            continue
        found.append((t, d))
    return max(found)[1] if found else None


def resume_argv(argv: list[str]) -> list[str]:
    """``resume=true`` / ``resume=DIR``: rerun with the original overrides of that run (from
    its .hydra/overrides.yaml) inside its directory; other arguments are kept after them.
    ``resume=DIR`` of a run whose overrides import code prints them to stderr first."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith("resume=")]
    if not values or values[-1].lower() in ("false", "no", "0", "null", ""):
        return argv
    value = values[-1]
    run_dir = latest_run() if value.lower() in ("true", "yes", "1") else Path(value)
    if run_dir is None:
        fail(ValueError(
            f"resume={value}: no unfinished run that can continue under {RUNS.resolve()} "
            "(runs that finished, failed before their first checkpoint, or import code are "
            "skipped; name one with resume=DIR)"))
    recorded = _recorded_overrides(run_dir)
    if recorded is None:
        fail(ValueError(f"resume={value}: {run_dir} is not a sparsekit run directory"))
    from sparsekit.io.runstate import read_run_state, still_running

    pid = still_running(read_run_state(run_dir))
    if pid is not None:
        fail(ValueError(f"resume={value}: {run_dir} is still running (process {pid} on this "
                        "host); wait for it or stop it first"))
    original = [str(o) for o in recorded if not str(o).startswith("resume=")]
    risky = unsafe_overrides(original)
    if risky:
        print(f"sparsekit: resume={value}: {run_dir} replays overrides that import code or "
              f"plugins: {' '.join(risky)}", file=sys.stderr)
    rest = [a for a in argv if not a.startswith("resume=")]
    return [*original, *rest, _dir_override("hydra.run.dir", run_dir.resolve()), "resume=true"]


def shared_resume_argv(argv: list[str]) -> list[str]:
    """:func:`resume_argv`, resolved once per job: under torchrun rank 0 resolves ``resume=``
    and every rank takes its answer, or exits with its exit code (rank 0 printed the error;
    :func:`~sparsekit.run.distributed.from_rank0`). Each rank resolving on its own raced with
    rank 0's Hydra rewriting the run's ``.hydra`` files in place: another rank could read them
    half-written and find no run to continue (seen once in CI)."""
    from sparsekit.run.distributed import from_rank0, init, launched_by_torchrun

    if not launched_by_torchrun() or not any(a.startswith("resume=") for a in argv):
        return resume_argv(argv)
    init()
    return from_rank0(lambda: resume_argv(argv), EXIT_RUNTIME)


def _dir_override(key: str, path: Path | str) -> str:
    """The override that runs Hydra in directory ``path`` (``key``: ``hydra.run.dir``, or
    ``hydra.sweep.dir`` for a sweep's parent), quoted for Hydra's parser."""
    return f"{key}={hydra_quote(str(path))}"


def hydra_quote(text: str) -> str:
    """``text`` as a single-quoted value of Hydra's override grammar that parses back to
    ``text`` (a run directory may hold ``'``, ``\\``, ``${``, spaces, commas)."""
    text = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    text = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text)
    return "'" + text.replace("${", "\\${") + "'"


def run_dir_label(argv: Sequence[str]) -> str:
    """What a run's directory name starts with: its recipe (``recipe=NAME``, or the stem of
    ``recipe=file:PATH``), else ``default``; so TensorBoard's run names (paths under
    ``--logdir runs``) start with what differs between runs, not with the date."""
    recipes = [a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith("recipe=")]
    if not recipes or not recipes[-1]:
        return "default"
    name = Path(recipes[-1].removeprefix("file:")).stem
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80] or "default"


def unique_run_dir(argv: list[str]) -> list[str]:
    """Give this run (a sweep: its parent directory) a directory of its own, created now with
    ``os.mkdir`` (``runs/<recipe>_<date_time>``, :func:`run_dir_label`; then ``_1``, ``_2``,
    ... when taken), so two runs started in the same second never share one. Under torchrun rank 0
    makes it and every rank takes its name (each rank's clock would otherwise name its own;
    this initializes the process group). Unchanged when argv names the directory already (the
    user, or :func:`resume_argv` for the run it continues) or asks for help."""
    sweep = any(a in ("-m", "--multirun") for a in argv)
    key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    if (any(a.lstrip("+").startswith(key + "=") for a in argv)
            or any(a in _FLAGS_WITHOUT_CHECK for a in argv)):
        return argv
    from sparsekit.io.files import unique_dir
    from sparsekit.run.distributed import from_rank0, init, launched_by_torchrun

    parent = Path("multirun") if sweep else RUNS

    def make() -> str:
        stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
        return str(unique_dir(parent / f"{run_dir_label(argv)}_{stamp}"))

    if launched_by_torchrun() and not sweep:
        init()
        made = from_rank0(make, EXIT_RUNTIME)
    else:
        made = make()
    return [*argv, _dir_override(key, made)]


def first_check(argv: Sequence[str]) -> None:
    """:func:`check_overrides` without the registries and input paths
    (:func:`~sparsekit.run.config.without_registries`), importing no torch: a mistake in the
    syntax, a key, a group option, a fixed choice or a number is one line and exit 2 in about a
    second. ``resume=`` (the recorded overrides are read later) and flags that only print skip
    it; :func:`hydra_argv` checks everything after it."""
    if any(a in _FLAGS_WITHOUT_CHECK or a.startswith("resume=") for a in argv):
        return
    with without_registries():
        check_overrides([a for a in argv if not a.startswith("-")])


def hydra_argv(argv: Sequence[str]) -> list[str]:
    """The command line Hydra runs, from the one the user typed; the only place argv is
    rewritten. In order: ``resume=`` becomes the recorded overrides of the run it continues,
    in that run's directory (:func:`shared_resume_argv`: rank 0 decides under torchrun); the
    overrides are checked (:func:`check_overrides`: the config composed once, bad input is
    one line and exit 2, before any directory is made); a new run gets its own directory
    (:func:`unique_run_dir`: shared by every rank under torchrun). Flags that only print
    (``--help``, ``--cfg``, ...) skip the check and the directory."""
    argv = shared_resume_argv(list(argv))
    if not any(a in _FLAGS_WITHOUT_CHECK for a in argv):
        check_overrides([a for a in argv if not a.startswith("-")])
    else:  # --cfg, --help, ...: still no YAML file but the packaged ones (or recipe=file:)
        try:
            check_group_options([a for a in argv if "=" in a and not a.startswith("-")])
        except (HydraException, ValueError) as e:
            fail(e)
    return unique_run_dir(argv)


def _app(cfg: DictConfig) -> None:
    from sparsekit.run.pipeline import run

    try:
        config = to_config(cfg)
    except (ValueError, TypeError, OmegaConfBaseException) as e:
        fail(e)
    resume = str(config.resume).lower() not in ("false", "none", "no", "0")
    try:
        summary = run(config, HydraConfig.get().runtime.output_dir, resume=resume)
    except RunPaused as e:  # on purpose, checkpoint written: one line, exit 0
        print(f"paused: {e}", flush=True)
        return
    except Exception as e:  # reported here: Hydra would print its own lines first
        report_runtime_error(e)
    from sparsekit.progress import FILE_LOG
    from sparsekit.run.distributed import is_main

    if is_main():
        print(summary["table"])
        FILE_LOG.info(summary["table"])  # sparsekit.log only: stdout printed it


class SweepFigures(Callback):
    """Registered in conf/config.yaml: when a sweep (``-m``) ends, its Pareto figure
    (``<sweep dir>/pareto.png`` and a TensorBoard image in ``<sweep dir>/tb/sweep``)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: object) -> None:
        from sparsekit.run.tracking import sweep_figures

        png = sweep_figures(config.hydra.sweep.dir)
        if png is not None:
            print(f"sweep figure: {png}")


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``sparsekit`` console script and ``python -m sparsekit``."""
    register_configs()
    argv = sys.argv[1:] if argv is None else list(argv)
    first_check(argv)
    from sparsekit.run.distributed import set_launch_env

    set_launch_env()  # torchrun: NCCL multicast off unless the user exported otherwise
    args = hydra_argv(argv)
    try:
        _run_hydra(args)
    except OSError as e:  # Hydra creating the run directory, before the run starts
        report_runtime_error(_run_dir_error(e, args))
    except Exception as e:
        report_runtime_error(e)


def _run_hydra(args: list[str]) -> None:
    """Hydra's app (:func:`_app`) on the command line ``args``. Hydra re-raises what the run
    raises (instead of printing its own short traceback), so that :func:`main` reports it:
    one line, or a traceback and "this is a bug"."""
    import hydra

    app = hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_app)
    saved, sys.argv = sys.argv, [sys.argv[0] or "sparsekit", *args]
    full_error, os.environ["HYDRA_FULL_ERROR"] = os.environ.get("HYDRA_FULL_ERROR"), "1"
    try:
        app()
    finally:
        sys.argv = saved
        if full_error is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = full_error


def _run_dir_error(err: OSError, args: list[str]) -> BaseException:
    """An OSError from Hydra as a StorageError naming ``hydra.run.dir`` when ``args`` names the
    run directory and the error a file; else ``err`` itself."""
    run_dir = [a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")]
    if run_dir and err.filename is not None:
        return StorageError(f"cannot create the run directory hydra.run.dir={run_dir[-1]}: "
                            f"{err.filename}: {err.strerror or err}")
    return err
