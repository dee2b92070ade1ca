"""The Pruner: owns the masks of the selected layers and moves them along a schedule.

Typical use inside a training loop (docs/api.md, "Pruning in your own training loop"):

    pruner = Pruner(model, sparsity=0.9, schedule=Cubic(start=0, end=2000, every=100))
    for step, batch in enumerate(loader):
        ...; optimizer.step()
        pruner.step(step)
    pruner.finalize()
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from sparsekit.nn import shards as D
from sparsekit.prune import masks as M
from sparsekit.nn.calibration import CalibrationFn, check_calibration
from sparsekit.prune.criteria import (
    CRITERIA,
    Layers,
    configure_criterion,
    is_solver,
    needs_calibration,
)
from sparsekit.checks import check_fraction
from sparsekit.errors import ConfigTypeError, UsageError
from sparsekit.nn.select import check_finite_weight
from sparsekit.prune.patterns import (
    lowest_k_masks,
    nm_group_cost,
    nm_incompatibility,
    nm_partial_mask,
    parse_pattern,
    prune_count,
    row_mask,
)
from sparsekit.prune.report import NEAR_EMPTY, LayerSparsity, SparsityReport
from sparsekit.prune.schedules import OneShot, Schedule
from sparsekit.nn.select import name_matches, select_modules
from sparsekit.prune.stores import pick_store
from sparsekit.names import SCOPES

STATE_VERSION = 1
_LEVEL = "the fraction of weights set to zero"
# a global threshold pruning the model's first selected layer to this level or more, when that
# layer holds under FIRST_LAYER_SHARE of the selected weights, is named in a warning: a first
# layer is the model's only view of its input and pruning it saves little (Gale et al. 2019)
FIRST_LAYER_LEVEL = 0.5
FIRST_LAYER_SHARE = 0.05


class Pruner:
    """Masks on the weights of the selected layers, updated on a schedule.

    Args:
        model: the module to prune (masks are attached at construction, all ones).
        sparsity: unstructured target, the fraction of weights set to zero, in [0, 1); or a
            mapping from layer name patterns (globs or ``re:``) to levels, first match wins.
            For N:M patterns it is implied (1 - N/M) and may be left None.
        pattern: ``"unstructured"`` or ``"N:M"`` (N kept of every M consecutive inputs).
        criterion: a registered criterion (:func:`~sparsekit.register_criterion`):
            ``"magnitude"``, ``"wanda"`` (needs ``calibration``), ``"sparsegpt"`` or
            ``"alps"`` (solvers: one shot; need ``calibration``; update the kept weights too).
        criterion_options: the criterion's options by name (``{"blocksize": 64,
            "percdamp": 0.01, "sequential": True}`` for sparsegpt; see
            :func:`sparsekit.prune.criteria.configure_criterion`).
        scope: ``"layer"`` (each layer reaches its target) or ``"global"`` (one threshold over
            all selected layers; for N:M, the ramp enforces the cheapest groups model-wide).
            A global threshold that leaves a layer at 99% sparsity or more, or prunes a
            small first layer to 50% or more, names it in a ``UserWarning`` (and the first
            case in :meth:`report`).
        max_layer_sparsity: with ``scope="global"`` and an unstructured pattern, the most any
            one layer is pruned (a fraction in [sparsity, 1)): a layer the threshold would
            prune beyond it is pruned to it (its lowest scores), and the threshold over the
            others prunes the rest. None (default): no cap.
        schedule: ``OneShot``, ``Linear`` or ``Cubic``; default ``OneShot(step=0)``.
        include, exclude: globs or ``re:<regex>`` over qualified module names.
        calibration: iterable of model inputs (re-iterable for gradual Wanda: it is run at
            every mask update). ``calibration_fn(model, batch)`` feeds unusual batches.
        strict: raise instead of skipping layers that cannot take the pattern.
        process_group: the ranks that prune together under torchrun (default: the world when
            torch.distributed is initialized). Replicated weights (DDP; pass the wrapper or
            ``model.module``) get masks computed on every rank and checked by an all-reduced
            checksum at each update; sharded FSDP2 weights (create the Pruner after
            ``fully_shard``) get masks sharded like them, from thresholds searched over all
            shards. Every rank must call :meth:`step` with the same steps. See
            docs/distributed.md.

    The Pruner computes masks; where they live is one mask store picked at construction
    (``sparsekit.prune.stores``: parametrizations, held for a DDP wrapper, or sharded for
    FSDP2). With :class:`~sparsekit.ChannelPruner` it shares the protocol a run loop drives
    (``sparsekit.prune.scheduled.ScheduledPruner``: step, done, report, state_dict,
    load_state_dict, finalize).

    Wanda compares scores within each output row (Sun et al. 2023): each row of a layer gets
    ``round(level * in_features)`` zeros. N:M under a gradual schedule enforces a growing
    fraction of M-groups, those losing the least score first, and the full pattern at ``end``.
    """

    def __init__(
        self,
        model: nn.Module,
        sparsity: float | Mapping[str, float] | None = None,
        *,
        pattern: str = "unstructured",
        criterion: str = "magnitude",
        scope: str = "layer",
        schedule: Schedule | None = None,
        include: str | Sequence[str] | None = ("*",),
        exclude: str | Sequence[str] | None = (),
        calibration: Iterable[Any] | None = None,
        calibration_fn: CalibrationFn | None = None,
        strict: bool = False,
        process_group: Any = None,
        criterion_options: Mapping[str, Any] | None = None,
        max_layer_sparsity: float | None = None,
    ):
        # the DDP wrapper, or its .module once wrapped: masks held here, not parametrizations
        wrapped = D.unwrap(model) is not model or D.ddp_wrapped(model)
        model = D.unwrap(model)
        self.model = model
        self.pattern = pattern
        self.nm = parse_pattern(pattern)
        self._criterion = configure_criterion(criterion, criterion_options)
        solver = is_solver(self._criterion)
        self._check_options(criterion, scope, schedule, calibration, solver)
        self.calibration, self.calibration_fn = calibration, calibration_fn

        selected = select_modules(model, include, exclude)
        meta = [n for n, m in selected.items() if M.original_weight(m, n).device.type == "meta"]
        if meta:
            raise UsageError(
                f"layer {meta[0]!r} has its weight on the meta device (no values to score): "
                "materialize the model first (model.to_empty(device=...) and load its weights), "
                "or exclude the layer"
            )
        self.levels = self._resolve_levels(sparsity, selected)
        self.max_layer_sparsity = self._check_cap(max_layer_sparsity, sparsity)
        self.warned: dict[str, str] = {}
        self._take(selected, strict)
        self._selected = list(selected)
        self._comm = D.comm(process_group)
        self._store = pick_store(self, self.modules, wrapped, self._comm)
        if solver and not self._store.whole_weights:
            self._store.remove()
            raise UsageError(
                f"criterion {criterion!r} needs whole weights: prune before fully_shard"
            )
        self.progress = 0.0
        self.last_step: int | None = None
        self.finalized = False

    def _check_options(self, criterion: str, scope: str, schedule: Schedule | None,
                       calibration: Iterable[Any] | None, solver: bool) -> None:
        """Validate the options; sets ``criterion``, ``scope`` and ``schedule``."""
        if scope not in SCOPES:
            raise UsageError(f"unknown scope {scope!r}: allowed are {list(SCOPES)}")
        # plain strings (a config's enum member would pickle as a class into state_dict)
        self.criterion, self.scope = str(criterion), str(scope)
        self.schedule = OneShot() if schedule is None else schedule
        if not isinstance(self.schedule, Schedule):
            raise ConfigTypeError(f"schedule must be OneShot, Linear or Cubic, got {schedule!r}")
        if solver and not isinstance(self.schedule, OneShot):
            raise UsageError(f"criterion {criterion!r} is one shot: use schedule=OneShot(...)")
        if needs_calibration(self._criterion) and calibration is None:
            raise UsageError(f"criterion {criterion!r} needs calibration= (an iterable of batches)")
        if self._per_row and self.nm is None and scope == "global":
            raise UsageError(
                f"criterion {criterion!r} compares scores within each output row; use "
                "scope='layer'"
            )
        check_calibration(calibration)

    def _check_cap(self, cap: Any, sparsity: Any) -> float | None:
        if cap is None:
            return None
        if self.scope != "global" or self.nm is not None:
            raise UsageError("max_layer_sparsity caps a global unstructured threshold: use it "
                             "with scope='global' and pattern='unstructured'")
        cap = check_fraction("max_layer_sparsity", cap, "the most one layer is pruned")
        if cap < float(sparsity):
            raise UsageError(f"max_layer_sparsity={cap:g} is below sparsity={sparsity:g}: the "
                             "global target could not be reached; allowed: [sparsity, 1)")
        return cap

    def _take(self, selected: dict[str, nn.Module], strict: bool) -> None:
        """``modules``: the selected layers this pattern can prune; ``skipped``: the others,
        with the reason (an error with ``strict``)."""
        self.skipped: dict[str, str] = {}
        self.modules: dict[str, nn.Module] = {}
        for name, module in selected.items():
            reason = self._skip_reason(module)
            if reason is None and self.levels.get(name, 0.0) is None and self.nm is None:
                reason = "no sparsity level in the mapping matches this layer"
            if reason is not None:
                if strict:
                    raise UsageError(f"layer {name!r} cannot be pruned with "
                                     f"{self.pattern!r}: {reason}")
                self.skipped[name] = reason
            else:
                self.modules[name] = module

    def _remove_masks(self) -> None:
        """Take this Pruner's masks off again without applying them (the weights keep their
        values, the state_dict its keys): the rollback of a failed construction or prune_."""
        self._store.remove()
        self.modules = {}

    def _resolve_levels(
        self, sparsity: float | Mapping[str, float] | None, selected: Mapping[str, nn.Module]
    ) -> dict[str, float | None]:
        if self.nm is not None:
            implied = 1 - self.nm[0] / self.nm[1]
            if sparsity is not None and (
                not isinstance(sparsity, (int, float)) or abs(float(sparsity) - implied) > 1e-9
            ):
                raise UsageError(
                    f"sparsity is implied by pattern {self.pattern!r} ({implied:g}); "
                    "leave sparsity=None"
                )
            return {name: None for name in selected}
        if sparsity is None:
            raise UsageError("sparsity is required for pattern 'unstructured' (a level in [0, 1))")
        if isinstance(sparsity, Mapping):
            if self.scope == "global":
                raise UsageError("a per-layer sparsity mapping needs scope='layer'")
            levels = {p: check_fraction(f"sparsity[{p!r}]", v, _LEVEL) for p, v in sparsity.items()}
            for p in levels:
                if not any(name_matches(n, p) for n in selected):
                    raise UsageError(f"sparsity pattern {p!r} matches no selected layer")
            return {
                name: next((v for p, v in levels.items() if name_matches(name, p)), None)
                for name in selected
            }
        level = check_fraction("sparsity", sparsity, _LEVEL)
        return {name: level for name in selected}

    def _skip_reason(self, module: nn.Module) -> str | None:
        weight = M.original_weight(module)
        if weight.numel() == 0:
            return f"zero-size weight {tuple(weight.shape)}: nothing to prune"
        if not weight.is_floating_point():
            return f"weight dtype {weight.dtype} is not floating point"
        if self.nm is not None:
            return nm_incompatibility(weight.shape, self.nm[1])
        return None

    @property
    def masks(self) -> dict[str, torch.Tensor]:
        """Current keep-masks (True = kept) by qualified layer name; live tensors, not copies.
        For sharded (FSDP2) weights, DTensors sharded like the weights."""
        return self._store.masks()

    @property
    def sparsity(self) -> float:
        """Target fraction of zeros over the pruned layers at the end of the schedule."""
        if self.nm is not None:
            return 1 - self.nm[0] / self.nm[1]
        total = sum(m.weight.numel() for m in self.modules.values())
        return sum(self.levels[n] * m.weight.numel() for n, m in self.modules.items()) / total

    @property
    def done(self) -> bool:
        """Whether the schedule's full target is reached: later steps change no mask."""
        return self.progress >= 1.0

    def step(self, step: int) -> bool:
        """Move the masks to the schedule's position at ``step`` (call after optimizer.step()).
        Returns True when the masks changed."""
        if self.finalized:
            raise UsageError(
                "Pruner.step() after finalize(): the masks are folded into the weights and this "
                "Pruner holds none any more; create a new Pruner to prune again"
            )
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise ConfigTypeError(f"Pruner.step(step): step must be an int, got {step!r}")
        if not self.modules:
            return False
        self._store.enforce()  # undo what the optimizer step did to pruned weights
        target = self.schedule.progress(step)
        self.last_step = step
        if target <= self.progress:
            return False
        self._update(target)
        self.progress = target
        return True

    @torch.no_grad()
    def _update(self, progress: float) -> None:
        if is_solver(self._criterion):
            self._update_solver(progress)
            return
        scores = self._scores()
        keeps = {n: self._store.keep(n) for n in self.modules}
        new = self._nm_masks(scores, keeps, progress) if self.nm else None
        if new is None:
            new = self._unstructured_masks(scores, keeps, progress)
        for name in self.modules:
            self._store.set(name, new[name])
        self._store.verify()
        if self.scope == "global":
            self._warn_global(new, progress)

    def _warn_global(self, keeps: Mapping[str, torch.Tensor], progress: float) -> None:
        """Name the layers a global threshold left (nearly) empty (:data:`NEAR_EMPTY`), and
        a small first layer it pruned hard (:data:`FIRST_LAYER_LEVEL`), once each."""
        import warnings

        names = list(self.modules)
        numel = {k: self.modules[k].weight.numel() for k in names}
        zeros = dict(zip(names, self._store.allsum([int((~keeps[k]).sum()) for k in names])))
        total = sum(numel.values())
        for k in names:
            level = zeros[k] / numel[k]
            first = (k == names[0] and progress >= 1.0 and len(names) > 1
                     and level >= FIRST_LAYER_LEVEL and numel[k] < FIRST_LAYER_SHARE * total)
            if k in self.warned or not (level >= NEAR_EMPTY or first):
                continue
            if level >= NEAR_EMPTY:
                self.warned[k] = (f"the global threshold pruned layer {k!r} to {level:.1%} "
                                  "(its output is nearly constant)")
                fix = "cap it with max_layer_sparsity=, exclude it, or use scope='layer'"
            else:
                self.warned[k] = (f"the global threshold pruned layer {k!r}, the first layer "
                                  f"({numel[k]} weights, {numel[k] / total:.1%} of the pruned "
                                  f"ones), to {level:.1%}")
                fix = ("a first layer is the model's only view of its input and saves little: "
                       f"keep it dense with exclude=[{k!r}] (CLI: prune.exclude=[{k}]) or use "
                       "scope='layer'")
            warnings.warn(f"{self.warned[k]}; {fix}", UserWarning, stacklevel=4)

    def _scores(self) -> dict[str, torch.Tensor]:
        for n, m in self.modules.items():
            check_finite_weight(n, D.local(m.weight))
        scores = self._criterion.score(self._layers())
        for n, m in self.modules.items():
            got = scores.get(n) if isinstance(scores, Mapping) else None
            if not isinstance(got, torch.Tensor) or got.shape != D.local(m.weight).shape:
                raise ConfigTypeError(
                    f"criterion {self.criterion!r} gave layer {n!r} a score of "
                    f"{getattr(got, 'shape', type(got).__name__)}; expected a tensor of the "
                    f"weight's shape {tuple(D.local(m.weight).shape)}"
                )
            if bool((got < 0).any()) or bool(got.isnan().any()):
                raise UsageError(
                    f"criterion {self.criterion!r} gave layer {n!r} negative or NaN scores; "
                    "scores are >= 0, higher = keep"
                )
        return scores

    def _layers(self) -> Layers:
        return Layers(self.model, self.modules, self.calibration, self.calibration_fn, self._comm)

    @property
    def _per_row(self) -> bool:
        return bool(getattr(self._criterion, "per_row", False))

    def _nm_masks(self, scores, keeps, progress: float) -> dict[str, torch.Tensor]:
        n, m = self.nm
        names = list(self.modules)
        costs = [nm_group_cost(scores[k], m, n, keeps[k]) for k in names]
        done = [
            (~keeps[k]).reshape(c.shape[0], -1, m).sum(-1) >= m - n for k, c in zip(names, costs)
        ]
        comm = self._store.search_comm
        numels = self._store.allsum([c.numel() for c in costs])
        dones = self._store.allsum([int(d.sum()) for d in done])
        if self.scope == "global":
            k_all = max(round(progress * sum(numels)), sum(dones))
            picked = lowest_k_masks(costs, k_all, [~d for d in done], comm)
        else:
            picked = [
                lowest_k_masks([c], max(round(progress * t), dn), [~d], comm)[0]
                for c, d, t, dn in zip(costs, done, numels, dones)
            ]
        # lowest_k_masks returns keep-masks: False marks a selected (enforced) group
        return {k: nm_partial_mask(scores[k], n, m, keeps[k], ~p) for k, p in zip(names, picked)}

    def _unstructured_masks(self, scores, keeps, progress: float) -> dict[str, torch.Tensor]:
        names = list(self.modules)
        if self._per_row:
            return {k: row_mask(scores[k], self.levels[k] * progress, keeps[k]) for k in names}
        comm = self._store.search_comm
        numel = {k: self.modules[k].weight.numel() for k in names}  # DTensors: global numel
        if self.scope == "global":
            count = prune_count(sum(numel.values()), self.sparsity * progress)
            return self._global_masks(names, scores, keeps, count, numel)
        return {
            k: lowest_k_masks(
                [scores[k]], prune_count(numel[k], self.levels[k] * progress), [keeps[k]], comm
            )[0]
            for k in names
        }

    def _global_masks(self, names, scores, keeps, count: int, numel) -> dict[str, torch.Tensor]:
        """One threshold over ``names`` pruning ``count`` weights. With
        ``max_layer_sparsity``, a layer it would prune beyond the cap is pruned to the cap
        alone (its lowest scores) and the threshold is searched again over the others for the
        rest of ``count`` (at most one search per layer)."""
        comm, fixed = self._store.search_comm, {}
        while True:
            free = [k for k in names if k not in fixed]
            rest = count - sum(prune_count(numel[k], self.max_layer_sparsity) for k in fixed)
            picked = dict(zip(free, lowest_k_masks(
                [scores[k] for k in free], max(rest, 0), [keeps[k] for k in free], comm)))
            if self.max_layer_sparsity is None:
                return picked
            zeros = self._store.allsum([int((~picked[k]).sum()) for k in free])
            caps = {k: prune_count(numel[k], self.max_layer_sparsity) for k in free}
            over = [k for k, z in zip(free, zeros) if z > caps[k]]
            if not over:
                return {k: fixed.get(k, picked.get(k)) for k in names}
            for k in over:
                fixed[k] = lowest_k_masks([scores[k]], caps[k], [keeps[k]], comm)[0]

    def _update_solver(self, progress: float) -> None:
        # the solver updates weights layer by layer: keep a host copy to undo a failed solve
        saved = {n: D.local(M.original_weight(m)).detach().to("cpu", copy=True)
                 for n, m in self.modules.items()}
        keeps = {n: self._store.keep(n).clone() for n in self.modules}
        self._store.release()  # all-ones masks: plain weights for the solver to update
        levels = {n: None if self.nm else self.levels[n] * progress for n in self.modules}
        try:
            new = self._criterion.solve(self._layers(), levels, self.nm)
        except BaseException:
            for name, module in self.modules.items():
                D.local(M.original_weight(module)).detach().copy_(saved[name])
            self._store.reattach(keeps)
            raise
        for name in self.modules:
            self._store.set(name, new[name])
        self._store.verify()

    def report(self) -> SparsityReport:
        """Sparsity of every selected layer, with skip reasons and N:M validity."""
        selected = dict(self.model.named_modules())
        modules = {n: selected[n] for n in self._selected}
        pattern = None if self.nm is None else self.pattern
        report = self._store.report(modules, pattern, self.skipped)
        for name, why in self.warned.items():
            if name in report.layers:
                report.layers[name].warning = why
        return report

    def state_dict(self) -> dict[str, Any]:
        """Plain data (tensors, numbers, strings), loadable with torch.load(weights_only=True)."""
        return {
            "version": STATE_VERSION,
            "pattern": self.pattern,
            "criterion": self.criterion,
            "scope": self.scope,
            "progress": self.progress,
            "last_step": -1 if self.last_step is None else self.last_step,
            "masks": self._store.saved(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore masks and schedule position saved by :meth:`state_dict`. Every field is
        checked (UsageError / ConfigTypeError naming it) before anything changes."""
        if not isinstance(state, Mapping):
            raise ConfigTypeError(f"pruner state must be a dict, got {type(state).__name__}")
        version = state.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version != STATE_VERSION:
            raise UsageError(
                f"pruner state['version'] is {version!r}; this sparsekit reads "
                f"version {STATE_VERSION}"
            )
        missing = [k for k in self.state_dict_keys() if k not in state]
        if missing:
            raise UsageError(
                f"pruner state lacks field(s) {missing}; a state has {list(self.state_dict_keys())}"
            )
        for key in ("pattern", "criterion", "scope"):
            if not isinstance(state[key], str):
                raise ConfigTypeError(
                    f"pruner state[{key!r}] must be a string, got {type(state[key]).__name__}"
                )
        if state["pattern"] != self.pattern:
            raise UsageError(
                f"pruner state['pattern'] is {state['pattern']!r}, this pruner's {self.pattern!r}"
            )
        # a name read back from a file: built in, or this Pruner's own (passed in code)
        known = CRITERIA.in_code(state["criterion"]) or state["criterion"] == self.criterion
        if not known or state["scope"] not in SCOPES:
            raise UsageError(
                f"pruner state criterion={state['criterion']!r} scope={state['scope']!r}: "
                f"allowed criteria {list(CRITERIA.code_names())}, scopes {list(SCOPES)}"
            )
        progress, last_step = state["progress"], state["last_step"]
        if isinstance(progress, bool) or not isinstance(progress, (int, float)) or not (
            0.0 <= float(progress) <= 1.0
        ):
            raise UsageError(
                f"pruner state['progress'] must be a number in [0, 1] (fraction of the "
                f"schedule done), got {progress!r}"
            )
        if isinstance(last_step, bool) or not isinstance(last_step, int) or last_step < -1:
            raise UsageError(
                f"pruner state['last_step'] must be an int >= -1 (-1: never stepped), got "
                f"{last_step!r}"
            )
        saved = state["masks"]
        if not isinstance(saved, Mapping) or set(saved) != set(self.modules):
            names = sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__
            raise UsageError(
                f"pruner state['masks'] covers layers {names}, this pruner {sorted(self.modules)}"
            )
        for name, module in self.modules.items():
            self._check_saved_mask(name, saved[name], tuple(module.weight.shape))
        for name in self.modules:
            self._store.load(name, saved[name])
        self.progress = float(progress)
        self.last_step = None if last_step < 0 else int(last_step)

    @staticmethod
    def state_dict_keys() -> tuple[str, ...]:
        return ("version", "pattern", "criterion", "scope", "progress", "last_step", "masks")

    def _check_saved_mask(self, name: str, mask: Any, shape: tuple[int, ...]) -> None:
        what = f"pruner state['masks'][{name!r}]"
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ConfigTypeError(f"{what} must be a bool tensor, got {got}")
        if tuple(mask.shape) != shape:
            raise UsageError(f"{what} has shape {tuple(mask.shape)}, the weight {shape}")
        if self.nm is not None:
            n, m = self.nm
            kept = mask.reshape(shape[0], -1, m).sum(-1)
            if bool((kept < n).any()):
                raise UsageError(
                    f"{what} keeps fewer than {n} of some group of {m}: not a {self.pattern} mask"
                )

    def finalize(self) -> nn.Module:
        """Fold masks into the weights: a plain module with the state_dict keys it had before
        pruning and zeros where pruned. The pruner is done afterwards. Returns the model.

        UsageError before any :meth:`step` (the masks are still all ones: the model would stay
        dense) and when called twice."""
        if self.finalized:
            raise UsageError("Pruner.finalize() was called already; create a new Pruner to "
                             "prune again")
        if self.last_step is None and self.modules:
            raise UsageError(
                "Pruner.finalize() before any step(): the masks are still all ones, so the "
                "model would come back dense; call pruner.step(step) first (sk.prune_ prunes "
                "in one shot)"
            )
        self._store.finalize()
        self.modules = {}
        self.finalized = True
        return self.model


DENSE = "dense"


def pattern_plan(model: nn.Module, pattern: Mapping[str, str],
                 include: str | Sequence[str] | None = ("*",),
                 exclude: str | Sequence[str] | None = ()) -> dict[str, str]:
    """Each selected layer's pattern from a mapping of layer name patterns (globs or ``re:``)
    to ``"N:M"``, ``"unstructured"`` or ``"dense"`` (left as it is), first match wins; a layer
    no pattern matches stays dense. UsageError for a mapping key that matches no selected layer
    or a value that is not a pattern.

    >>> net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    >>> pattern_plan(net, {"2": "dense", "*": "2:4"})
    {'0': '2:4', '2': 'dense'}
    """
    if not isinstance(pattern, Mapping):
        raise ConfigTypeError(f"a per-layer pattern is a dict of layer pattern -> pattern, got "
                              f"{type(pattern).__name__}")
    for key, value in pattern.items():
        if value != DENSE:
            try:
                parse_pattern(value)
            except (ValueError, TypeError) as e:
                raise UsageError(f"pattern[{key!r}]: {e} (or 'dense')") from None
    selected = select_modules(model, include, exclude)
    for key in pattern:
        if not any(name_matches(n, key) for n in selected):
            raise UsageError(f"pattern key {key!r} matches no selected layer")
    return {name: next((v for k, v in pattern.items() if name_matches(name, k)), DENSE)
            for name in selected}


def prune_(
    model: nn.Module,
    sparsity: float | Mapping[str, float] | None = None,
    *,
    pattern: str = "unstructured",
    criterion: str = "magnitude",
    scope: str = "layer",
    include: str | Sequence[str] | None = ("*",),
    exclude: str | Sequence[str] | None = (),
    calibration: Iterable[Any] | None = None,
    calibration_fn: CalibrationFn | None = None,
    strict: bool = False,
    criterion_options: Mapping[str, Any] | None = None,
    max_layer_sparsity: float | None = None,
) -> SparsityReport:
    """Prune in one shot and fold the masks (a Pruner with ``OneShot`` then ``finalize``).
    Modifies ``model`` in place and returns its :class:`SparsityReport`.

    ``pattern`` may be a per-layer mapping (see :func:`pattern_plan`), e.g. what
    :func:`~sparsekit.allocate` returns for an N:M sensitivity table: ``{"encoder.layer.0.*":
    "dense", "*": "2:4"}``. Layers of each pattern are pruned together (one Pruner per pattern,
    in the order the patterns first appear; ``"unstructured"`` layers take ``sparsity``);
    ``"dense"`` layers are left as they are and reported as skipped.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> report = prune_(model, pattern="2:4")
    >>> report.global_sparsity
    0.5
    >>> int((model[0].weight == 0).sum())
    64
    """
    if isinstance(pattern, Mapping):
        return _prune_mixed(model, sparsity, pattern, criterion, scope, include, exclude,
                            calibration, calibration_fn, strict, criterion_options)
    pruner = Pruner(
        model, sparsity, pattern=pattern, criterion=criterion, scope=scope, schedule=OneShot(0),
        include=include, exclude=exclude, calibration=calibration, calibration_fn=calibration_fn,
        strict=strict, criterion_options=criterion_options, max_layer_sparsity=max_layer_sparsity,
    )
    try:
        pruner.step(0)
    except BaseException:
        pruner._remove_masks()  # leave the model as it was: no masks, the same state_dict keys
        raise
    report = pruner.report()
    pruner.finalize()
    return report


def _prune_mixed(model, sparsity, pattern, criterion, scope, include, exclude, calibration,
                 calibration_fn, strict, criterion_options) -> SparsityReport:
    """:func:`prune_` with a per-layer pattern mapping: one ``prune_`` per pattern."""
    import re

    plan = pattern_plan(model, pattern, include, exclude)
    if calibration is not None and iter(calibration) is calibration:
        calibration = list(calibration)  # read once per pattern
    layers = {}
    for kind in dict.fromkeys(plan.values()):
        if kind == DENSE:
            continue
        names = [n for n, k in plan.items() if k == kind]
        report = prune_(model, sparsity if kind == "unstructured" else None, pattern=kind,
                        criterion=criterion, scope=scope,
                        include=["re:" + "|".join(re.escape(n) for n in names)],
                        calibration=calibration, calibration_fn=calibration_fn, strict=strict,
                        criterion_options=criterion_options)
        layers.update({n: s for n, s in report.layers.items() if n in names})
    full = SparsityReport()
    for name in plan:
        module = model.get_submodule(name)
        layers.setdefault(name, LayerSparsity(
            module.weight.numel(), int((module.weight == 0).sum()),
            skipped="dense in the per-layer pattern"))
        full.layers[name] = layers[name]
    return full
