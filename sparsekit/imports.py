"""Every import by name in sparsekit, behind two allow-lists.

- :data:`INTERNAL`: sparsekit modules loaded on first use because their dependencies are
  optional (transformers, torch-pruning); keys are fixed here, never read from a file.
- :data:`TYPED_OPTIONS`: the options whose value the *user typed* (on the command line, or in a
  ``Config`` built in code) may name any importable object: ``model._target_`` and
  ``data._target_``. Values read from files (checkpoint headers, run state) name registered
  builders instead and never reach an import.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from sparsekit.errors import UsageError

INTERNAL = {
    "hf": "sparsekit.models.hf",
    "channels": "sparsekit.prune.channels",
    "quant": "sparsekit.quant",
}
TYPED_OPTIONS = ("model._target_", "data._target_")


def load_internal(key: str) -> ModuleType:
    """The sparsekit module :data:`INTERNAL` names ``key``; ImportError when its optional
    dependency is missing."""
    return importlib.import_module(INTERNAL[key])


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """``hydra.utils.get_object`` logs every failure before raising it; the caller reports it
    as one line instead."""
    log = logging.getLogger(logger)
    disabled, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = disabled


def import_object(path: str, option: str) -> Any:
    """The object ``"package.module.attr"`` names (``hydra.utils.get_object``), for an option
    in :data:`TYPED_OPTIONS`; a ValueError names ``option`` when it cannot be imported.

    >>> import_object("math.sqrt", "model._target_")(4.0)
    2.0
    """
    if option not in TYPED_OPTIONS:
        raise UsageError(f"{option}={path!r}: only {', '.join(TYPED_OPTIONS)} may name code to "
                         "import")
    from hydra.utils import get_object

    try:
        with _quiet("hydra.utils"):
            return get_object(path)
    except (ImportError, AttributeError, ValueError) as e:
        cause = e.__cause__ or e
        reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        lines = str(e).strip().splitlines()
        if len(lines) > 2:  # hydra adds which part could not be found
            reason += f"; {lines[-1]}"
        hint = " (is its directory on PYTHONPATH?)" if isinstance(cause, ImportError) else ""
        raise UsageError(f"{option}={path!r} cannot be imported: {reason}{hint}") from None
