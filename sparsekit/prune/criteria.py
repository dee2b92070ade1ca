"""Pruning criteria by name: what decides which weights a mask keeps.

A criterion either *scores* weights (higher = keep; the Pruner turns scores into masks of any
pattern, scope and schedule) or *solves* for masks and weights together, one shot (SparseGPT).
Both are plain objects registered by name; the Pruner, the config schema and
``sparsekit --help`` take the list of names from this registry, never from a list of their own.

- magnitude: ``|W|``.
- wanda (Sun et al. 2023): ``|W_ij| * ||X_j||_2``, where ``X_j`` is input feature ``j`` over all
  calibration tokens. For a conv, features are the unfolded ``(in, kh, kw)`` patch positions.
- sparsegpt (Frantar & Alistarh 2023): the OBS solver of :mod:`sparsekit.prune.sparsegpt`.
- alps (Meng et al. 2024): ADMM with a penalty schedule on the same layer-wise reconstruction
  problem, then a conjugate-gradient refit of the kept weights (:mod:`sparsekit.prune.alps`);
  better masks than SparseGPT's greedy column sweep, several times slower.

Adding a criterion is one file and one registration. In code::

    class Smallest:  # keeps the smallest weights (a toy)
        def score(self, layers):
            return {n: 1 / (1 + layers.weight(n).abs().float()) for n in layers.modules}

    sk.register_criterion("smallest", Smallest())
    sk.Pruner(model, sparsity=0.5, criterion="smallest")

Or from an installed package, without code at the call site (so that the command line can use
it: ``sparsekit prune.criterion=smallest``), declare an entry point in the group
``sparsekit.criteria`` of its pyproject.toml::

    [project.entry-points."sparsekit.criteria"]
    smallest = "my_package.smallest:Smallest"   # an object, or a class called with no arguments

Only installed distributions declare entry points: a run directory or a checkpoint names a
criterion, never code to import.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from sparsekit.nn.calibration import CalibrationFn, gemm_inputs, run_calibration
from sparsekit.nn.shards import ShardComm, all_reduce_dict, local, reshard
from sparsekit.errors import ConfigTypeError, ModelCallError, NumericsError, UsageError
from sparsekit.registry import Registry
from sparsekit.prune.sparsegpt import SparseGPT
from sparsekit.prune.alps import ALPS


@dataclass(frozen=True)
class Layers:
    """What a criterion sees: the model, the selected layers by qualified name, and the
    calibration batches (``calibration_fn(model, batch)`` feeds unusual ones). ``comm``: the
    ranks pruning together (None: one process); statistics summed over it make every rank
    compute the same scores."""

    model: nn.Module
    modules: Mapping[str, nn.Module]
    calibration: Iterable[Any] | None = None
    calibration_fn: CalibrationFn | None = None
    comm: ShardComm | None = None

    def weight(self, name: str) -> torch.Tensor:
        """Layer ``name``'s current (masked) weight; this rank's shard of a sharded one."""
        return local(self.modules[name].weight)


@runtime_checkable
class Criterion(Protocol):
    """Scores weights: ``score(layers)`` returns one float tensor of scores >= 0 per layer
    name, the shape of this rank's weight (:meth:`Layers.weight`), higher = keep.

    Optional attributes (absent = False): ``needs_calibration`` (the Pruner requires
    ``calibration=``); ``per_row`` (scores compare only within an output row, as Wanda's: an
    unstructured level is met by every row, and ``scope='global'`` is refused)."""

    def score(self, layers: Layers) -> dict[str, torch.Tensor]: ...


@runtime_checkable
class Solver(Protocol):
    """Prunes in one shot and may update the kept weights: ``solve(layers, levels, nm)`` writes
    the new weights in place (zeros where pruned) and returns bool keep-masks by layer name.
    ``levels[name]`` is the layer's unstructured target in [0, 1) (None under N:M); ``nm`` is
    ``(N, M)`` or None. A solver needs whole (unsharded) weights and a one-shot schedule;
    ``needs_calibration`` as for :class:`Criterion`."""

    def solve(
        self, layers: Layers, levels: Mapping[str, float | None], nm: tuple[int, int] | None
    ) -> dict[str, torch.Tensor]: ...


def _not_a_criterion(obj: object) -> str | None:
    """What is wrong with ``obj`` as a criterion (None: it has ``score`` or ``solve``)."""
    if callable(getattr(obj, "score", None)) or callable(getattr(obj, "solve", None)):
        return None
    return (f"a criterion has a score(layers) or a solve(layers, levels, nm) method, got "
            f"{type(obj).__name__} {obj!r:.60}")


CRITERIA: Registry[Criterion | Solver] = Registry("criterion", group="sparsekit.criteria",
                                                  check=_not_a_criterion)


def register_criterion(name: str, criterion: Criterion | Solver) -> None:
    """Make ``criterion`` (an object with ``score`` or ``solve``, see :class:`Criterion` and
    :class:`Solver`) available as ``criterion=name`` in :class:`~sparsekit.Pruner`,
    :func:`~sparsekit.prune_`, :func:`~sparsekit.sensitivity` and ``prune.criterion``."""
    wrong = _not_a_criterion(criterion)
    if wrong is not None:
        raise ConfigTypeError(f"register_criterion({name!r}): {wrong}")
    CRITERIA.register(name, criterion)


def get_criterion(name: str) -> Criterion | Solver:
    """The criterion registered as ``name``; UsageError naming the registered ones otherwise."""
    if not isinstance(name, str):
        raise ConfigTypeError(f"criterion must be a registered name (a string), got {name!r}")
    return CRITERIA[name]


def configure_criterion(name: str, options: Mapping[str, Any] | None = None) -> Criterion | Solver:
    """The criterion registered as ``name`` with ``options`` set: a copy of it whose attributes
    named in ``options`` take the given values (the registered object is never changed). A
    criterion lists the options it takes in its ``options`` attribute (SparseGPT: blocksize,
    percdamp, sequential; ALPS: percdamp, rho, iters, cg_iters, sequential); an option it does
    not take is a UsageError naming the allowed ones, a value of another type than the
    default's a ConfigTypeError.

    >>> configure_criterion("sparsegpt", {"blocksize": 64}).blocksize
    64
    """
    criterion = get_criterion(name)
    if not options:
        return criterion
    if not isinstance(options, Mapping):
        raise ConfigTypeError(f"criterion_options must be a dict of option -> value, got "
                              f"{type(options).__name__}")
    allowed = tuple(getattr(criterion, "options", ()))
    unknown = [k for k in options if k not in allowed]
    if unknown:
        raise UsageError(f"criterion {name!r} takes no option(s) {unknown}; its options are "
                         f"{list(allowed) or 'none'}")
    configured = copy.copy(criterion)
    for key, value in options.items():
        default = getattr(criterion, key)
        kinds = (bool,) if isinstance(default, bool) else (int,) if isinstance(default, int) \
            else (int, float) if isinstance(default, float) else (type(default),)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise ConfigTypeError(f"criterion {name!r} option {key}={value!r}: expected a "
                                  f"{kinds[-1].__name__} like the default {default!r}")
        setattr(configured, key, float(value) if isinstance(default, float) else value)
    check = getattr(configured, "check", None)
    if callable(check):
        check()
    return configured


def is_solver(criterion: Criterion | Solver | str) -> bool:
    """Whether ``criterion`` (an object, or a registered name) is a :class:`Solver`."""
    criterion = get_criterion(criterion) if isinstance(criterion, str) else criterion
    return callable(getattr(criterion, "solve", None))


def needs_calibration(criterion: Criterion | Solver | str) -> bool:
    """Whether ``criterion`` (an object, or a registered name) reads calibration batches."""
    criterion = get_criterion(criterion) if isinstance(criterion, str) else criterion
    return bool(getattr(criterion, "needs_calibration", False))


def magnitude(weight: torch.Tensor) -> torch.Tensor:
    """``|W|`` in float32, the weight's shape."""
    return weight.detach().abs().float()


def wanda(weight: torch.Tensor, input_norm: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """Wanda score ``|W_ij| * ||X_j||_2`` with the weight's shape.

    ``input_norm`` holds the L2 norm of each GEMM input feature, length ``in * prod(kernel)``
    (for a grouped conv, of all groups: the feature block of group ``g`` serves output rows
    ``g * out/groups ... (g+1) * out/groups - 1``).
    """
    w = weight.detach().abs().float().reshape(weight.shape[0], -1)
    norm = input_norm.float().reshape(groups, -1)
    if norm.shape[1] != w.shape[1]:
        raise UsageError(
            f"input norm has {norm.shape[1]} features per group, weight has {w.shape[1]}"
        )
    rows = norm.repeat_interleave(w.shape[0] // groups, dim=0)
    return (w * rows).reshape(weight.shape)


class InputNormCollector:
    """Forward hooks that accumulate the squared L2 norm of every GEMM input feature.

    Use as a context manager; hooks are removed on exit, even on error.
    """

    def __init__(self, modules: Mapping[str, nn.Module]):
        self.modules = dict(modules)
        self.sq: dict[str, torch.Tensor] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> InputNormCollector:
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            cols = gemm_inputs(module, args[0].detach())
            sq = cols.double().pow(2).sum(0)
            self.sq[name] = self.sq[name] + sq if name in self.sq else sq

        return hook

    def check_reached(self) -> None:
        """ValueError naming the layers no calibration batch reached."""
        missing = [n for n in self.modules if n not in self.sq]
        if missing:
            raise ModelCallError(
                f"calibration never reached layer(s) {missing}: the model did not call them on "
                "any calibration batch; exclude them or pass batches that use them"
            )

    def norms(self) -> dict[str, torch.Tensor]:
        """L2 norm of each input feature, float32, per module name. NumericsError naming the
        layer when its calibration inputs held NaN or inf."""
        self.check_reached()
        for name, sq in self.sq.items():
            if not bool(torch.isfinite(sq).all()):
                raise NumericsError(
                    f"the calibration inputs of layer {name!r} contain NaN or inf (or overflow): "
                    "Wanda cannot score its weights; check the calibration batches and the layers "
                    "before it"
                )
        return {n: s.sqrt().float() for n, s in self.sq.items()}


def collect_input_norms(
    model: nn.Module,
    modules: Mapping[str, nn.Module],
    calibration: Iterable[Any],
    calibration_fn: CalibrationFn | None = None,
    comm: ShardComm | None = None,
) -> dict[str, torch.Tensor]:
    """Run the calibration batches and return each module's input feature L2 norms.

    With ``comm`` (several ranks, see :mod:`sparsekit.nn.shards`) each rank runs its own share
    of the calibration data and the squared norms are summed over ranks before the square root,
    so every rank gets the norms of all ranks' data together."""
    with InputNormCollector(modules) as collector:
        run_calibration(model, calibration, calibration_fn)
    if comm is not None:
        collector.check_reached()  # raise before entering the collective, not inside it
        collector.sq = all_reduce_dict(collector.sq, comm)
    return collector.norms()


class Magnitude:
    """``|W|``: keep the largest weights."""

    def score(self, layers: Layers) -> dict[str, torch.Tensor]:
        return {n: magnitude(layers.weight(n)) for n in layers.modules}


class Wanda:
    """``|W_ij| * ||X_j||_2`` (Sun et al. 2023), compared within each output row."""

    needs_calibration = True
    per_row = True

    def score(self, layers: Layers) -> dict[str, torch.Tensor]:
        norms = collect_input_norms(
            layers.model, layers.modules, layers.calibration, layers.calibration_fn, layers.comm
        )
        reshard(layers.model)  # a no-grad forward leaves FSDP2's root module unsharded
        return {
            n: wanda(layers.weight(n), norms[n], getattr(m, "groups", 1))
            for n, m in layers.modules.items()
        }


register_criterion("magnitude", Magnitude())
register_criterion("wanda", Wanda())
register_criterion("sparsegpt", SparseGPT())
register_criterion("alps", ALPS())
