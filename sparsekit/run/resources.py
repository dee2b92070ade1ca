"""Where the Hydra configs (conf/) and recipes (recipes/) are, from a checkout or a wheel.

In a checkout they sit at the repository top level, beside the package. A built wheel carries
copies inside the package (setup.py copies them at build time), so an installed sparsekit finds
them without the source tree.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # the sparsekit package


def _find(name: str) -> Path:
    for candidate in (_PACKAGE / "_data" / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"sparsekit's {name}/ directory is missing: looked in {_PACKAGE / '_data'} and "
        f"{_PACKAGE.parent}; reinstall sparsekit"
    )


def conf_dir() -> Path:
    """Absolute path of the Hydra config directory (config groups model/, data/, prune/, ...)."""
    return _find("conf")


def recipes_dir() -> Path:
    """Absolute path of the recipes directory (one YAML overlay per recipe)."""
    return _find("recipes")
