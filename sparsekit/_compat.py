"""Every private torch, torch-pruning and TensorBoard interface sparsekit relies on, in one place.

These are not public APIs: a new release may rename or change them. Each one is reached only
through a function here, which looks the name up when called (so it follows a patched torch)
and, when the name is gone, raises a RuntimeError naming the interface, the installed version
and the versions sparsekit is tested with (the GEMM kernels are plain calls, for
torch.compile; :func:`missing` lists the absent ones). A version outside the tested range warns
once. Upgrading a dependency means reading this file, not grepping the package.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import inspect
import re
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

# the ranges pyproject.toml pins: [lowest, first untested)
TESTED = {
    "torch": ((2, 11), (2, 15)),
    "torch-pruning": ((1, 5), (2, 0)),
    "tensorboard": ((2, 14), (3, 0)),
}


def version_tuple(version: str) -> tuple[int, ...]:
    """``"2.14.1+cu130"`` -> ``(2, 14, 1)``.

    >>> version_tuple("2.14.1+cu130"), version_tuple("1.6.0rc1")
    ((2, 14, 1), (1, 6, 0))
    """
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def _installed(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _tested(package: str) -> str:
    low, high = TESTED[package]
    return f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"


@functools.cache
def check_version(package: str) -> bool:
    """Whether the installed ``package`` is in the tested range; warns once when it is not."""
    low, high = TESTED[package]
    installed = _installed(package)
    ok = installed == "unknown" or low <= version_tuple(installed) < high
    if not ok:
        warnings.warn(
            f"sparsekit uses private interfaces of {package}, tested with {package}"
            f"{_tested(package)}; {installed} is installed (see sparsekit/_compat.py)",
            stacklevel=3,
        )
    return ok


def _private(owner: Any, name: str, package: str) -> Any:
    check_version(package)
    try:
        return getattr(owner, name)
    except AttributeError:
        raise RuntimeError(
            f"{getattr(owner, '__name__', type(owner).__name__)}.{name} is missing in "
            f"{package} {_installed(package)}: sparsekit needs it and is tested with "
            f"{package}{_tested(package)}"
        ) from None


# --- torch: GEMM kernels without a public API yet ------------------------------------------
# Plain calls, looked up at each call (so a patched torch is followed) and simple enough for
# torch.compile to trace through; their presence is checked by :func:`missing`.
TORCH_PRIVATE = ("_int_mm", "_scaled_mm", "_cslt_compress", "_cslt_sparse_mm")


def missing() -> list[str]:
    """The private torch functions above that this torch lacks (none on a tested version)."""
    return [f"torch.{name}" for name in TORCH_PRIVATE if not hasattr(torch, name)]


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch._int_mm``: int8 x int8 -> int32 matrix product."""
    return torch._int_mm(a, b)


def scaled_mm(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch._scaled_mm``: float8 / int8 matrix product with scales."""
    return torch._scaled_mm(*args, **kwargs)


def cslt_compress(weight: torch.Tensor) -> torch.Tensor:
    """``torch._cslt_compress``: a 2:4 weight packed for cuSPARSELt."""
    return torch._cslt_compress(weight)


def cslt_sparse_mm(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch._cslt_sparse_mm``: the cuSPARSELt 2:4 matrix product."""
    return torch._cslt_sparse_mm(*args, **kwargs)


def compiled_graph_count() -> int:
    """How many graphs ``torch.compile`` has built in this process (dynamo's counters)."""
    import torch._dynamo.utils

    check_version("torch")
    counters = _private(torch._dynamo.utils, "counters", "torch")
    return int(counters["stats"]["unique_graphs"])


def compile_module(module: Any, *, mode: str | None = None, dynamic: bool | None = None,
                   backend: str = "inductor", options: dict | None = None) -> Any:
    """``torch.compile`` with a ``mode`` and extra inductor ``options`` together (torch.compile
    takes one or the other: the mode's options, ``torch._inductor.list_mode_options``, are
    merged under ``options``). Unknown option names raise ValueError naming them."""
    if not options:
        return torch.compile(module, mode=mode, dynamic=dynamic, backend=backend)
    if backend != "inductor":
        raise ValueError(f"inductor options {sorted(options)} need backend='inductor', "
                         f"not {backend!r}")
    modes = _private(importlib.import_module("torch._inductor"), "list_mode_options", "torch")
    merged = {**(modes(mode, dynamic) if mode not in (None, "default") else {}), **options}
    try:
        return torch.compile(module, dynamic=dynamic, backend=backend, options=merged)
    except RuntimeError as e:  # inductor checks option names when the wrapper is built
        raise ValueError(str(e).split(", known options")[0]) from None


# graphs one compiled frame may hold across every accelerated model of a process: dynamo keys
# its cache by code object, so all models of one class (and HF's shared forward wrappers)
# share its default of 8, past which a frame silently runs uncompiled
FRAME_COMPILES = 64


@functools.cache
def _dynamo_config() -> Any:
    """``torch._dynamo.config`` (looked up once: ``torch._dynamo`` is a lazy attribute of torch
    whose every access costs about 0.2 ms)."""
    import torch._dynamo

    return torch._dynamo.config


@contextlib.contextmanager
def recompile_limit(limit: int = FRAME_COMPILES) -> Iterator[None]:
    """Within the block, dynamo's recompile limit per frame is at least ``limit`` (a higher
    one already set is kept). Sets and restores the one setting (a few microseconds; dynamo's
    ``config.patch`` takes about a millisecond, too much for every forward call)."""
    config = _dynamo_config()
    before = config.recompile_limit
    config.recompile_limit = max(limit, int(before))
    try:
        yield
    finally:
        config.recompile_limit = before


def reset_compiled() -> None:
    """Drop what torch.compile holds: dynamo's code caches and inductor's CUDA-graph trees
    (when this torch has them)."""
    torch._dynamo.reset()
    try:
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()
    except Exception:  # a torch without it: dynamo's reset is enough  # noqa: BLE001
        pass


def clear_cublas_workspaces() -> None:
    """Drop torch's cached cuBLAS/cuBLASLt workspaces (each stream's, kept across calls): the
    next matmul allocates its own, inside a CUDA graph's pool when it runs under capture
    (inductor's CUDA-graph trees do the same around their captures, and clear them again)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def check_module_apply() -> None:
    """``nn.Module._apply(fn, recurse)``, which sparsekit's quantized layers override so that
    ``.to(dtype)`` moves their 8-bit weights without converting them: the signature must hold."""
    check_version("torch")
    params = list(inspect.signature(_private(nn.Module, "_apply", "torch")).parameters)
    if params[:3] != ["self", "fn", "recurse"]:
        raise RuntimeError(
            f"torch.nn.Module._apply{tuple(params)} in torch {_installed('torch')}: sparsekit's "
            f"quantized layers override _apply(fn, recurse) (tested with torch{_tested('torch')})"
        )


def custom_graph_pass() -> type:
    """``torch._inductor.custom_graph_pass.CustomGraphPass``: the base of an inductor FX pass
    that inductor's graph cache can key (by its ``uuid()``)."""
    module = importlib.import_module("torch._inductor.custom_graph_pass")
    return _private(module, "CustomGraphPass", "torch")


def pure_op(target: Any) -> bool:
    """Whether an FX node's ``target`` is an op overload (ATen or custom) whose result depends
    on its arguments only: it mutates nothing and draws no random numbers."""
    overload = _private(torch._ops, "OpOverload", "torch")
    return isinstance(target, overload) and not target._schema.is_mutable and \
        torch.Tag.nondeterministic_seeded not in target.tags


# --- TensorBoard ----------------------------------------------------------------------------


def summary_file_writer(writer: Any) -> Any:
    """The file writer behind a ``SummaryWriter`` (``_get_file_writer``): the hparams plugin's
    summaries are written through it, as ``SummaryWriter.add_hparams`` does itself."""
    return _private(writer, "_get_file_writer", "tensorboard")()


# --- torch-pruning: a BasePruner driven one target at a time -------------------------------


def tp_graph(pruner: Any) -> Any:
    """The pruner's dependency graph (``BasePruner.DG``)."""
    return _private(pruner, "DG", "torch-pruning")


def tp_ignored(pruner: Any) -> list:
    """The modules the pruner leaves whole (``BasePruner.ignored_layers``, a live list)."""
    return _private(pruner, "ignored_layers", "torch-pruning")


def tp_ignore(pruner: Any, modules: Iterable[Any]) -> None:
    """Leave ``modules`` whole from now on."""
    tp_ignored(pruner).extend(modules)


def tp_groups(pruner: Any) -> Iterable[Any]:
    """The pruner's prunable groups (its ignored layers and root module types applied)."""
    root_types = _private(pruner, "root_module_types", "torch-pruning")
    return tp_graph(pruner).get_all_groups(ignored_layers=tp_ignored(pruner),
                                           root_module_types=root_types)


def tp_is_output(dep: Any) -> bool:
    """Whether a group's dependency ``dep`` targets a model output node."""
    import torch_pruning as tp

    optype = _private(tp.ops, "OPTYPE", "torch-pruning")
    return dep.target.type == optype.OUTPUT


def tp_set_target(pruner: Any, target: float) -> None:
    """Make the pruner's next ``step`` prune to ``target`` (fraction of the widths it noted at
    its first step), channels and heads alike: torch-pruning ranks against those starting
    widths, so a one-step schedule ``[0, target]`` from step 0 reproduces its iterative
    schedule with ours."""
    for name in ("current_step", "per_step_pruning_ratio", "per_step_head_pruning_ratio"):
        _private(pruner, name, "torch-pruning")
    pruner.current_step = 0
    pruner.per_step_pruning_ratio = [0.0, target]
    pruner.per_step_head_pruning_ratio = [0.0, target]


def tp_heads(pruner: Any, query: Any) -> tuple[int, int]:
    """(heads now, heads at the start) of the attention whose query projection is ``query``."""
    now = _private(pruner, "num_heads", "torch-pruning")[query]
    return now, _private(pruner, "init_num_heads", "torch-pruning")[query]


def tp_set_head_ratio(pruner: Any, linear: Any, ratio: float) -> None:
    """Prune ``ratio`` of the heads left in ``linear``'s attention at the next step."""
    _private(pruner, "head_pruning_ratio_dict", "torch-pruning")[linear] = [0.0, ratio]


check_version("torch")
