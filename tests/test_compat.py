"""sparsekit/_compat.py is the one door to private torch / torch-pruning / TensorBoard APIs."""

import ast
import warnings
from pathlib import Path

import pytest

from sparsekit import _compat

PACKAGE = Path(__file__).resolve().parents[1] / "sparsekit"
# attribute names that are private interfaces of a dependency
PRIVATE = {"_get_file_writer", "_dynamo", "DG", "ignored_layers", "root_module_types",
           "current_step", "per_step_pruning_ratio", "per_step_head_pruning_ratio",
           "init_num_heads", "head_pruning_ratio_dict", "OPTYPE",
           *_compat.TORCH_PRIVATE}


def _private_uses(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            base = ast.unparse(node.value)
            dunder = node.attr.startswith("__")
            private_torch = base == "torch" and node.attr.startswith("_") and not dunder
            if private_torch or node.attr in PRIVATE:
                out.append(f"{path.name}:{node.lineno} {base}.{node.attr}")
        elif isinstance(node, ast.FunctionDef) and node.name == "_apply":
            out.append(f"{path.name}:{node.lineno} def _apply (checked by check_module_apply)")
    return out


def test_private_interfaces_only_in_the_adapter():
    uses = {p.relative_to(PACKAGE).as_posix(): _private_uses(p) for p in PACKAGE.rglob("*.py")
            if p.name != "_compat.py"}
    uses = {k: v for k, v in uses.items() if v}
    # the one allowed exception: the quantized layers override nn.Module._apply, whose
    # signature _compat.check_module_apply verifies when sparsekit.quant.modules is imported
    assert list(uses) == ["quant/modules.py"]
    assert all("def _apply" in u for u in uses["quant/modules.py"])


def test_this_torch_has_every_private_function():
    assert _compat.missing() == []
    _compat.check_module_apply()


def test_an_untested_version_warns_once(monkeypatch):
    monkeypatch.setitem(_compat.TESTED, "torch", ((0, 1), (0, 2)))
    _compat.check_version.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"tested with torch>=0\.1,<0\.2; 2\.\d+"):
            assert _compat.check_version("torch") is False
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _compat.check_version("torch") is False  # cached: no second warning
    finally:
        _compat.check_version.cache_clear()


def test_a_missing_private_interface_names_itself_and_the_versions():
    with pytest.raises(RuntimeError, match=r"object\._get_file_writer is missing in tensorboard "
                                           r"[\d.]+: .* tested with tensorboard>=2\.14,<3\.0"):
        _compat.summary_file_writer(object())


def test_int_mm_follows_a_patched_torch(monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape) or a)
    a = torch.zeros(32, 8, dtype=torch.int8)
    assert _compat.int_mm(a, a.t()) is a and calls == [(32, 8)]


def test_compile_module_merges_the_mode_under_extra_inductor_options(monkeypatch):
    import torch

    seen = []
    monkeypatch.setattr(torch, "compile", lambda module, **kw: seen.append(kw) or module)
    m = torch.nn.Identity()
    assert _compat.compile_module(m, mode="reduce-overhead") is m
    assert seen[-1] == {"mode": "reduce-overhead", "dynamic": None, "backend": "inductor"}
    _compat.compile_module(m, mode="reduce-overhead", options={"triton.multi_kernel": 1})
    # torch.compile takes a mode or options, not both: the mode's options come first
    assert seen[-1]["options"] == {"triton.cudagraphs": True, "triton.multi_kernel": 1}
    assert "mode" not in seen[-1]
    _compat.compile_module(m, mode="reduce-overhead", options={"triton.cudagraphs": False})
    assert seen[-1]["options"] == {"triton.cudagraphs": False}  # explicit options win


def test_compile_module_names_an_unknown_inductor_option():
    import torch

    with pytest.raises(ValueError, match=r"Unexpected optimization option triton\.bogus$"):
        _compat.compile_module(torch.nn.Identity(), options={"triton.bogus": 1})
    with pytest.raises(ValueError, match=r"need backend='inductor', not 'aot_eager'"):
        _compat.compile_module(torch.nn.Identity(), backend="aot_eager",
                               options={"triton.multi_kernel": 1})
