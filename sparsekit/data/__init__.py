"""Built-in datasets and the ``_target_`` hook for user data.

Every dataset yields ``(input, target)`` pairs. :func:`build_data` returns a :class:`DataBundle`.
"""

from __future__ import annotations

import os
from typing import Any

from sparsekit.data.bundle import DataBundle
from sparsekit.data.mnist1d import mnist1d
from sparsekit.errors import ConfigTypeError
from sparsekit.imports import import_object
from sparsekit.io.cache import cache_root
from sparsekit.data.text import stdlib_text

__all__ = ["DataBundle", "build_data", "cache_root", "check_data_name", "import_object"]

BUILTIN_DATA = {"mnist1d": mnist1d, "stdlib_text": stdlib_text}
# built by the pipeline with the model's tokenizer (sparsekit.data.hf_text)
TOKENIZED_DATA = ("text",)




def check_data_name(name: str, target: str | None = None) -> None:
    """Raise ValueError naming ``data.name`` and the built-in choices for an unknown name."""
    if target is None and name not in BUILTIN_DATA and name not in TOKENIZED_DATA:
        choices = [*BUILTIN_DATA, *TOKENIZED_DATA]
        raise ValueError(
            f"data.name={name!r} is not allowed; choose one of: {', '.join(choices)} "
            "(or set data._target_ to a function returning (train, eval) datasets)"
        )


def build_data(
    name: str,
    target: str | None = None,
    kwargs: dict[str, Any] | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> DataBundle:
    """Build built-in data ``name`` (cached under :func:`cache_root`) or call ``target``, an
    importable function returning ``(train_dataset, eval_dataset)``."""
    kwargs = dict(kwargs or {})
    if target is not None:
        fn = import_object(target, "data._target_")
        out = fn(**kwargs)
        if isinstance(out, DataBundle):
            return out
        if not isinstance(out, (tuple, list)) or len(out) != 2 or any(
                isinstance(d, (str, bytes)) or not hasattr(d, "__len__") for d in out):
            raise ConfigTypeError(
                f"data._target_={target!r} returned {type(out).__name__} {str(out)[:60]!r}; it "
                "must return (train_dataset, eval_dataset) (two datasets of (input, target) "
                "pairs) or a DataBundle"
            )
        train, eval_ = out
        return DataBundle(train, eval_)
    check_data_name(name)
    return BUILTIN_DATA[name](cache_dir=cache_root(cache_dir) / "data", **kwargs)
