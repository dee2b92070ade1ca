"""The Pruner: owns the masks of the selected layers and moves them along a schedule.

Typical use inside a training loop (README, "Pruning in your own training loop"):

    pruner = Pruner(model, sparsity=0.9, schedule=Cubic(start=0, end=2000, every=100))
    for step, batch in enumerate(loader):
        ...; optimizer.step()
        pruner.step(step)
    pruner.finalize()
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from sparsekit.prune import shards as D
from sparsekit.prune import masks as M
from sparsekit.prune.calibration import CalibrationFn, check_calibration
from sparsekit.prune.criteria import (
    CRITERIA,
    check_finite_weight,
    collect_input_norms,
    magnitude,
    wanda,
)
from sparsekit.checks import check_fraction, positional_until
from sparsekit.errors import ConfigTypeError, UsageError
from sparsekit.prune.patterns import (
    lowest_k_masks,
    nm_group_cost,
    nm_incompatibility,
    nm_partial_mask,
    parse_pattern,
    prune_count,
    row_mask,
)
from sparsekit.prune.report import SparsityReport, build_report
from sparsekit.prune.schedules import OneShot, Schedule
from sparsekit.prune.select import name_matches, select_modules

SCOPES = ("layer", "global")
STATE_VERSION = 1
_LEVEL = "the fraction of weights set to zero"


class Pruner:
    """Masks on the weights of the selected layers, updated on a schedule.

    Args:
        model: the module to prune (masks are attached at construction, all ones).
        sparsity: unstructured target, the fraction of weights set to zero, in [0, 1); or a
            mapping from layer name patterns (globs or ``re:``) to levels, first match wins.
            For N:M patterns it is implied (1 - N/M) and may be left None.
        pattern: ``"unstructured"`` or ``"N:M"`` (N kept of every M consecutive inputs).
        criterion: ``"magnitude"``, ``"wanda"`` (needs ``calibration``) or ``"sparsegpt"``
            (one shot; needs ``calibration``; updates the kept weights too).
        scope: ``"layer"`` (each layer reaches its target) or ``"global"`` (one threshold over
            all selected layers; for N:M, the ramp enforces the cheapest groups model-wide).
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

    Wanda compares scores within each output row (Sun et al. 2023): each row of a layer gets
    ``round(level * in_features)`` zeros. N:M under a gradual schedule enforces a growing
    fraction of M-groups, those losing the least score first, and the full pattern at ``end``.
    """

    @positional_until(("pattern", "criterion", "scope", "schedule", "include", "exclude",
                       "calibration", "calibration_fn", "strict", "process_group"), leading=3)
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
    ):
        # the DDP wrapper, or its .module once wrapped: masks held here, not parametrizations
        wrapped = D.unwrap(model) is not model or D.ddp_wrapped(model)
        model = D.unwrap(model)
        self.model = model
        self.pattern = pattern
        self.nm = parse_pattern(pattern)
        if criterion not in CRITERIA:
            raise UsageError(f"unknown criterion {criterion!r}: allowed are {list(CRITERIA)}")
        if scope not in SCOPES:
            raise UsageError(f"unknown scope {scope!r}: allowed are {list(SCOPES)}")
        self.criterion, self.scope = criterion, scope
        self.schedule = OneShot() if schedule is None else schedule
        if not isinstance(self.schedule, Schedule):
            raise ConfigTypeError(f"schedule must be OneShot, Linear or Cubic, got {schedule!r}")
        if criterion == "sparsegpt" and not isinstance(self.schedule, OneShot):
            raise UsageError("criterion 'sparsegpt' is one shot: use schedule=OneShot(...)")
        if criterion in ("wanda", "sparsegpt") and calibration is None:
            raise UsageError(f"criterion {criterion!r} needs calibration= (an iterable of batches)")
        if criterion == "wanda" and self.nm is None and scope == "global":
            raise UsageError(
                "criterion 'wanda' compares scores within each output row; use scope='layer'"
            )
        check_calibration(calibration)
        self.calibration, self.calibration_fn = calibration, calibration_fn

        selected = select_modules(model, include, exclude)
        self.levels = self._resolve_levels(sparsity, selected)
        self.skipped: dict[str, str] = {}
        self.modules: dict[str, nn.Module] = {}
        for name, module in selected.items():
            reason = self._skip_reason(module)
            if reason is None and self.levels.get(name, 0.0) is None and self.nm is None:
                reason = "no sparsity level in the mapping matches this layer"
            if reason is not None:
                if strict:
                    raise UsageError(f"layer {name!r} cannot be pruned with {pattern!r}: {reason}")
                self.skipped[name] = reason
            else:
                self.modules[name] = module
        self._selected = list(selected)
        self._comm = D.comm(process_group)
        sharded = [D.is_sharded(M.original_weight(m)) for m in self.modules.values()]
        self._sharded = any(sharded)
        if self._sharded and not all(sharded):
            raise UsageError(
                "some selected weights are sharded (FSDP2) and some are not: shard "
                "all selected layers or none"
            )
        if self._sharded and criterion == "sparsegpt":
            raise UsageError("criterion 'sparsegpt' needs whole weights: prune before fully_shard")
        # Masks held here and enforced by zeroing pruned weights at every step() (and, when
        # not sharded, masking their gradients) where a parametrization cannot go: FSDP2 owns
        # sharded Parameters, and parametrizing a Parameter after DDP wrapped it detaches
        # DDP's gradient hooks (register_parametrization resets its grad accumulator).
        self._held = self._sharded or wrapped
        self._local_masks: dict[str, torch.Tensor] = {}
        self._hooks: list[Any] = []
        for name, module in self.modules.items():
            wm = M.find_mask(module)
            owner = None if wm is None or wm.owner is None else wm.owner()
            if owner is not None or (self._held and wm is not None):
                # a second Pruner would share (and overwrite) the first one's mask
                raise UsageError(
                    f"layer {name!r} already has a pruning mask (another Pruner's): finalize "
                    "that Pruner first, or exclude the layer from one of them"
                )
        self._attached: list[nn.Module] = []  # masks attached here (not prepare_qat_'s)
        for name, module in self.modules.items():
            if not self._held:
                fresh = M.find_mask(module) is None
                try:
                    M.attach_mask(module).owner = weakref.ref(self)
                except Exception:
                    self._remove_masks()
                    raise
                if fresh:
                    self._attached.append(module)
                continue
            self._local_masks[name] = torch.ones_like(D.local(module.weight), dtype=torch.bool)
            if not self._sharded:
                mask = self._local_masks[name]
                self._hooks.append(module.weight.register_hook(lambda g, mask=mask: g * mask))
        self.progress = 0.0
        self.last_step: int | None = None

    def _remove_masks(self) -> None:
        """Take this Pruner's masks off again without applying them (the weights keep their
        values, the state_dict its keys): the rollback of a failed construction or prune_."""
        for module in self._attached:
            M.remove_mask(module)
        for module in self.modules.values():
            wm = M.find_mask(module)
            if wm is not None:  # prepare_qat_'s all-ones mask: free for another Pruner again
                wm.owner = None
        for hook in self._hooks:
            hook.remove()
        self.modules, self._local_masks, self._hooks = {}, {}, []

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
        if not weight.is_floating_point():
            return f"weight dtype {weight.dtype} is not floating point"
        if self.nm is not None:
            return nm_incompatibility(weight.shape, self.nm[1])
        return None

    @property
    def masks(self) -> dict[str, torch.Tensor]:
        """Current keep-masks (True = kept) by qualified layer name; live tensors, not copies.
        For sharded (FSDP2) weights, DTensors sharded like the weights."""
        if self._sharded:
            D.reshard(self.model)
            return {n: D.like(self._local_masks[n], m.weight) for n, m in self.modules.items()}
        if self._held:
            return dict(self._local_masks)
        return {name: M.find_mask(m).mask for name, m in self.modules.items()}

    def _keep(self, name: str) -> torch.Tensor:
        """This rank's part of a layer's mask (all of it for replicated weights)."""
        if self._held:
            return self._local_masks[name]
        return M.find_mask(self.modules[name]).mask

    def _set_mask(self, name: str, mask: torch.Tensor) -> None:
        module = self.modules[name]
        if self._held:
            self._local_masks[name].copy_(mask)
            D.local(module.weight).detach().masked_fill_(~self._local_masks[name], 0)
        else:
            M.attach_mask(module, mask).owner = weakref.ref(self)
            M.zero_pruned(module)

    def _allsum(self, counts: list[int]) -> list[int]:
        """Counts summed over ranks for sharded weights (local counts are partial)."""
        if not self._sharded or self._comm is None:
            return counts
        return self._comm.all_reduce_sum(torch.tensor(counts, dtype=torch.int64)).tolist()

    @property
    def sparsity(self) -> float:
        """Target fraction of zeros over the pruned layers at the end of the schedule."""
        if self.nm is not None:
            return 1 - self.nm[0] / self.nm[1]
        total = sum(m.weight.numel() for m in self.modules.values())
        return sum(self.levels[n] * m.weight.numel() for n, m in self.modules.items()) / total

    def step(self, step: int) -> bool:
        """Move the masks to the schedule's position at ``step`` (call after optimizer.step()).
        Returns True when the masks changed."""
        if not self.modules:
            return False
        if self._held:  # undo what the optimizer step did to pruned weights
            if self._sharded:  # FSDP2: the sharded weights, and no stale gathered copies
                D.reshard(self.model)
            with torch.no_grad():
                for name, module in self.modules.items():
                    D.local(module.weight).masked_fill_(~self._local_masks[name], 0)
        target = self.schedule.progress(step)
        self.last_step = step
        if target <= self.progress:
            return False
        self._update(target)
        self.progress = target
        return True

    @torch.no_grad()
    def _update(self, progress: float) -> None:
        if self.criterion == "sparsegpt":
            self._update_sparsegpt(progress)
            return
        scores = self._scores()
        keeps = {n: self._keep(n) for n in self.modules}
        new = self._nm_masks(scores, keeps, progress) if self.nm else None
        if new is None:
            new = self._unstructured_masks(scores, keeps, progress)
        for name in self.modules:
            self._set_mask(name, new[name])
        if not self._sharded:
            D.verify_masks(self.masks, self._comm)

    def _scores(self) -> dict[str, torch.Tensor]:
        for n, m in self.modules.items():
            check_finite_weight(n, D.local(m.weight))
        if self.criterion == "magnitude":
            return {n: magnitude(D.local(m.weight)) for n, m in self.modules.items()}
        norms = collect_input_norms(
            self.model, self.modules, self.calibration, self.calibration_fn, self._comm
        )
        D.reshard(self.model)  # a no-grad forward leaves FSDP2's root module unsharded
        return {
            n: wanda(D.local(m.weight), norms[n], getattr(m, "groups", 1))
            for n, m in self.modules.items()
        }

    def _nm_masks(self, scores, keeps, progress: float) -> dict[str, torch.Tensor]:
        n, m = self.nm
        names = list(self.modules)
        costs = [nm_group_cost(scores[k], m, n, keeps[k]) for k in names]
        done = [
            (~keeps[k]).reshape(c.shape[0], -1, m).sum(-1) >= m - n for k, c in zip(names, costs)
        ]
        comm = self._comm if self._sharded else None
        numels = self._allsum([c.numel() for c in costs])
        dones = self._allsum([int(d.sum()) for d in done])
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
        if self.criterion == "wanda":
            return {k: row_mask(scores[k], self.levels[k] * progress, keeps[k]) for k in names}
        comm = self._comm if self._sharded else None
        numel = {k: self.modules[k].weight.numel() for k in names}  # DTensors: global numel
        if self.scope == "global":
            count = prune_count(sum(numel.values()), self.sparsity * progress)
            picked = lowest_k_masks(
                [scores[k] for k in names], count, [keeps[k] for k in names], comm
            )
            return dict(zip(names, picked))
        return {
            k: lowest_k_masks(
                [scores[k]], prune_count(numel[k], self.levels[k] * progress), [keeps[k]], comm
            )[0]
            for k in names
        }

    def _update_sparsegpt(self, progress: float) -> None:
        from sparsekit.prune.sparsegpt import sparsegpt_prune

        # the solver updates weights layer by layer: keep a host copy to undo a failed solve
        saved = {n: D.local(M.original_weight(m)).detach().to("cpu", copy=True)
                 for n, m in self.modules.items()}
        keeps = {n: self._keep(n).clone() for n in self.modules}
        for module in self.modules.values():
            M.fold_mask(module)  # all-ones masks: plain weights for the solver to update
        levels = {n: None if self.nm else self.levels[n] * progress for n in self.modules}
        try:
            new = sparsegpt_prune(
                self.model,
                self.modules,
                levels,
                self.nm,
                self.calibration,
                self.calibration_fn,
                comm=self._comm,
            )
        except BaseException:
            for name, module in self.modules.items():
                D.local(M.original_weight(module)).detach().copy_(saved[name])
                if not self._held:
                    M.attach_mask(module, keeps[name]).owner = weakref.ref(self)
            raise
        for name in self.modules:
            self._set_mask(name, new[name])
        D.verify_masks(self.masks, self._comm)

    def report(self) -> SparsityReport:
        """Sparsity of every selected layer, with skip reasons and N:M validity."""
        selected = dict(self.model.named_modules())
        modules = {n: selected[n] for n in self._selected}
        pattern = None if self.nm is None else self.pattern
        if not self._sharded:
            return build_report(modules, pattern, self.skipped)
        D.reshard(self.model)
        # sharded weights: count this rank's shards (whole rows), then sum over the ranks
        shards = {n: SimpleNamespace(weight=D.local(m.weight)) for n, m in modules.items()}
        report = build_report(shards, pattern, self.skipped)
        layers = list(report.layers.values())
        k = len(layers)
        counts = self._allsum(
            [s.numel for s in layers]
            + [s.zeros for s in layers]
            + [s.nm_ok is False for s in layers]
        )
        for i, s in enumerate(layers):
            s.numel, s.zeros = counts[i], counts[k + i]
            if s.nm_ok is not None:
                s.nm_ok = counts[2 * k + i] == 0
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
            "masks": {
                n: m.detach().clone() if self._sharded else m.detach().cpu().clone()
                for n, m in self.masks.items()
            },
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
        if state["criterion"] not in CRITERIA or state["scope"] not in SCOPES:
            raise UsageError(
                f"pruner state criterion={state['criterion']!r} scope={state['scope']!r}: "
                f"allowed criteria {list(CRITERIA)}, scopes {list(SCOPES)}"
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
        for name, module in self.modules.items():
            mask = saved[name]
            if self._sharded:
                mask = D.local_part(mask, module.weight)
            self._set_mask(name, mask.to(self._keep(name).device))
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
        pruning and zeros where pruned. The pruner is done afterwards. Returns the model."""
        for name, module in self.modules.items():
            if self._held:
                self._set_mask(name, self._local_masks[name])
            else:
                M.fold_mask(module)
        for hook in self._hooks:
            hook.remove()
        self.modules, self._local_masks, self._hooks = {}, {}, []
        return self.model


@positional_until(("pattern", "criterion", "scope", "include", "exclude", "calibration",
                   "calibration_fn", "strict"))
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
) -> SparsityReport:
    """Prune in one shot and fold the masks (a Pruner with ``OneShot`` then ``finalize``).
    Modifies ``model`` in place and returns its :class:`SparsityReport`.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> report = prune_(model, pattern="2:4")
    >>> report.global_sparsity
    0.5
    >>> int((model[0].weight == 0).sum())
    64
    """
    pruner = Pruner(
        model, sparsity, pattern=pattern, criterion=criterion, scope=scope, schedule=OneShot(0),
        include=include, exclude=exclude, calibration=calibration, calibration_fn=calibration_fn,
        strict=strict,
    )
    try:
        pruner.step(0)
    except BaseException:
        pruner._remove_masks()  # leave the model as it was: no masks, the same state_dict keys
        raise
    report = pruner.report()
    pruner.finalize()
    return report
