"""Every docstring example (>>>) in the sparsekit package runs and gives what it says."""

import doctest
import importlib
import pkgutil

import pytest

import sparsekit

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(sparsekit.__path__, "sparsekit.")
    if not m.name.startswith("sparsekit._data")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    try:
        module = importlib.import_module(name)
    except ImportError as exc:  # optional dependency (for example triton) missing on CPU CI
        pytest.skip(f"{name}: {exc}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
