"""Structured channel pruning: remove whole channels, filters and attention heads.

Torch-Pruning's dependency graph finds which tensors must shrink together (residual adds,
concatenations, grouped and depthwise convs, norms, embeddings); its importance classes score
the coupled channels and its pruner removes the lowest-scoring ones. The result is a
physically smaller dense model that is faster on any hardware, CPU included. This module adds
what sparsekit needs around it: one verb with validated options, whole-head attention pruning,
model outputs that keep their shape, a report in channels, parameters and MACs, and a JSON
channel plan that rebuilds the pruned architecture from a fresh model without pickled code.

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Conv2d(3, 32, 3), nn.ReLU(), nn.Conv2d(32, 16, 3))
>>> report = prune_channels_(model, torch.randn(1, 3, 8, 8), ratio=0.5)
>>> model[0].out_channels, model[2].out_channels   # the output layer keeps its 16 channels
(16, 16)
>>> model(torch.randn(2, 3, 8, 8)).shape
torch.Size([2, 16, 4, 4])
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
import torch_pruning as tp
from torch import nn
from torch.nn.utils import parametrize

from sparsekit.nn.calibration import call_model, eval_mode, feed
from sparsekit import _compat
from sparsekit.checks import check_fraction, check_int, check_mapping, check_module
from sparsekit.errors import ConfigTypeError, UsageError
from sparsekit.io import checkpoint
from sparsekit.registry import Registry
from sparsekit.reporting import Report, markdown_table
from sparsekit.prune.schedules import Linear, OneShot, Schedule
from sparsekit.nn.select import (PRUNABLE_TYPES, as_patterns, include_patterns,
                                 name_matches)
from sparsekit.nn.select import check_finite_weight
from sparsekit.names import SCOPES

PLAN_FORMAT = "sparsekit.channel_plan"
PLAN_VERSION = 1

# Integer attributes that hold widths live in a module's __dict__ next to its parameters; these
# never change with pruning and would only bloat the plan.
_PLAN_SKIP_ATTRS = ("training", "layer_idx")


_RATIO = "the fraction of output channels removed per layer"


@dataclass(frozen=True)
class ChannelCriterion:
    """How channel pruning scores channels: ``make()`` returns a torch-pruning ``Importance``
    (called on each coupled group, it gives one score per channel; the lowest go);
    ``needs_loss``: it reads gradients, so the pruner needs ``loss_fn``."""

    make: Callable[[], tp.importance.Importance]
    needs_loss: bool = False


CHANNEL_CRITERIA: Registry[ChannelCriterion] = Registry(
    "channel criterion", group="sparsekit.channel_criteria",
    check=lambda obj: None if isinstance(obj, ChannelCriterion) else (
        f"an entry point of this group is a ChannelCriterion, got {type(obj).__name__}"))


def register_channel_criterion(name: str, make: Callable[[], tp.importance.Importance], *,
                               needs_loss: bool = False) -> None:
    """Make ``make()`` (a torch-pruning ``Importance``, e.g. a subclass of
    ``torch_pruning.importance.Importance``) available as ``criterion=name`` in
    :class:`ChannelPruner`, :func:`prune_channels_` and ``prune.channel.criterion``;
    ``needs_loss``: it scores with gradients (``loss_fn`` becomes required). Installed packages
    can declare one under the entry point group ``sparsekit.channel_criteria`` (a
    :class:`ChannelCriterion`)."""
    if not callable(make):
        raise ConfigTypeError(f"register_channel_criterion({name!r}): make must be callable "
                              f"(returning a torch-pruning Importance), got {type(make).__name__}")
    CHANNEL_CRITERIA.register(name, ChannelCriterion(make, bool(needs_loss)))


register_channel_criterion("magnitude", lambda: tp.importance.MagnitudeImportance(p=2))
register_channel_criterion("taylor", tp.importance.TaylorImportance, needs_loss=True)
register_channel_criterion("lamp", lambda: tp.importance.LAMPImportance(p=2))


def channel_criterion(name: str) -> ChannelCriterion:
    """The channel criterion registered as ``name``; UsageError naming the allowed ones."""
    if not isinstance(name, str) or name not in CHANNEL_CRITERIA:
        raise UsageError(f"criterion={name!r} is not allowed; choose one of: "
                         f"{', '.join(CHANNEL_CRITERIA.names())}")
    found = CHANNEL_CRITERIA[name]
    if not isinstance(found, ChannelCriterion):
        raise ConfigTypeError(f"channel criterion {name!r} is a {type(found).__name__}, "
                              "not a ChannelCriterion")
    return found


@dataclass
class ChannelReport(Report):
    """What channel pruning removed.

    ``layers`` maps each Conv/Linear/MultiheadAttention name to ``(width before, width after)``
    in output channels (``out_channels``, ``out_features`` or ``embed_dim``); ``heads`` maps each
    attention module to ``(heads before, heads after)``. ``params_*`` count every parameter
    element; ``macs_*`` are multiply-accumulates of one forward pass over ``example_inputs``
    (torch_pruning.utils.count_ops_and_params). Fractions are removed / before, in [0, 1].
    """

    tag: ClassVar[str] = "channels"

    ratio: float
    criterion: str
    scope: str
    round_to: int
    layers: dict[str, tuple[int, int]] = field(default_factory=dict)
    heads: dict[str, tuple[int, int]] = field(default_factory=dict)
    params_before: int = 0
    params_after: int = 0
    macs_before: int = 0
    macs_after: int = 0
    protected: list[str] = field(default_factory=list)

    @property
    def channels_before(self) -> int:
        return sum(b for b, _ in self.layers.values())

    @property
    def channels_after(self) -> int:
        return sum(a for _, a in self.layers.values())

    @property
    def channels_removed(self) -> float:
        """Fraction of all output channels (summed over ``layers``) that were removed."""
        return _fraction(self.channels_before, self.channels_after)

    @property
    def params_removed(self) -> float:
        return _fraction(self.params_before, self.params_after)

    @property
    def macs_removed(self) -> float:
        return _fraction(self.macs_before, self.macs_after)

    def scalars(self) -> dict[str, float]:
        """Flat ``{"channels/removed": x, "channels/params_removed": y, ...}`` for a metrics
        logger, plus ``channels/<layer>``: the fraction of that layer's width removed."""
        out = {
            "channels/removed": self.channels_removed,
            "channels/params_removed": self.params_removed,
            "channels/macs_removed": self.macs_removed,
        }
        out.update({f"channels/{n}": _fraction(b, a) for n, (b, a) in self.layers.items()})
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain data for logging and JSON: the fields plus the removed fractions."""
        d = asdict(self)
        d["layers"] = {n: list(w) for n, w in self.layers.items()}
        d["heads"] = {n: list(h) for n, h in self.heads.items()}
        d.update(
            channels_before=self.channels_before,
            channels_after=self.channels_after,
            channels_removed=self.channels_removed,
            params_removed=self.params_removed,
            macs_removed=self.macs_removed,
        )
        return d

    def _summary(self) -> str:
        return (
            f"channels removed {self.channels_removed:.1%}, parameters removed "
            f"{self.params_removed:.1%} ({self.params_before} -> {self.params_after}), MACs "
            f"removed {self.macs_removed:.1%} ({self.macs_before} -> {self.macs_after})"
        )

    def to_markdown(self) -> str:
        rows = [[n, b, a] for n, (b, a) in self.layers.items()]
        rows += [[f"{n} (heads)", b, a] for n, (b, a) in self.heads.items()]
        return markdown_table(["layer", "before", "after"], rows) + "\n\n" + self._summary()

    def __str__(self) -> str:
        width = max([len(n) for n in self.layers] + [5])
        rows = [f"{'layer':<{width}}  {'before':>7}  {'after':>7}"]
        rows += [f"{n:<{width}}  {b:>7}  {a:>7}" for n, (b, a) in self.layers.items()]
        rows += [f"{n + ' (heads)':<{width}}  {b:>7}  {a:>7}" for n, (b, a) in self.heads.items()]
        rows.append(self._summary())
        return "\n".join(rows)


def _fraction(before: int, after: int) -> float:
    return (before - after) / before if before else 0.0


def _out_width(module: nn.Module) -> int | None:
    if isinstance(module, nn.MultiheadAttention):
        return module.embed_dim
    if isinstance(module, nn.modules.conv._ConvNd):
        return module.out_channels
    if isinstance(module, nn.Linear):
        return module.out_features
    return None


def _is_hf_attention(module: nn.Module) -> bool:
    """A Hugging Face style self-attention (BERT, RoBERTa, ViT, ...): separate query, key and
    value Linears and an integer ``num_attention_heads``."""
    return isinstance(getattr(module, "num_attention_heads", None), int) and all(
        isinstance(getattr(module, n, None), nn.Linear) for n in ("query", "key", "value")
    )


def _heads(module: nn.Module) -> int | None:
    if isinstance(module, nn.MultiheadAttention):
        return module.num_heads
    if _is_hf_attention(module):
        return module.num_attention_heads
    return None


def _widths(model: nn.Module) -> tuple[dict[str, int], dict[str, int]]:
    widths = {n: w for n, m in model.named_modules() if (w := _out_width(m)) is not None}
    heads = {n: h for n, m in model.named_modules() if (h := _heads(m)) is not None}
    return widths, heads


def _count(model: nn.Module, example_inputs: Any) -> tuple[int, int]:
    """(parameter elements, MACs of one forward pass over ``example_inputs``)."""
    params = sum(p.numel() for p in model.parameters())
    # The counter prints notes (e.g. on keyword-only inputs) to stdout; keep them out of logs.
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        macs, _ = tp.utils.count_ops_and_params(model, example_inputs)
    return params, int(macs)


_INPUTS_HINT = (
    "pass example_inputs as the model takes one batch: a tensor for model(x), a tuple for "
    "model(*args), a dict for model(**kwargs)"
)


def _output_modules(model: nn.Module, example_inputs: Any) -> list[nn.Module]:
    """Leaf modules whose output tensor is returned by the model as it is. (torch-pruning marks
    an output only when an operation, not a module, produced it.)"""
    produced: list[tuple[torch.Tensor, nn.Module]] = []

    def record(module: nn.Module, _inputs: Any, output: Any) -> None:
        produced.extend((t, module) for t in tp.utils.flatten_as_list(output))

    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    handles = [m.register_forward_hook(record) for m in leaves]
    try:
        with torch.no_grad():
            outputs = tp.utils.flatten_as_list(feed(model, example_inputs, _INPUTS_HINT))
    finally:
        for h in handles:
            h.remove()
    return [m for t, m in produced if any(t is o for o in outputs)]


def _check_model(model: nn.Module) -> None:
    """UsageError unless ``model``'s layers can be channel-pruned: no parametrizations (masks),
    no quantized layers, no weights on the meta device, none non-finite."""
    for name, m in model.named_modules():
        if parametrize.is_parametrized(m):
            raise UsageError(
                f"module '{name}' carries parametrizations (pruning masks?): run channel "
                "pruning before mask pruning, or finalize the Pruner first"
            )
    quantized = [
        f"{n} ({getattr(m, 'scheme', None) or m.weight.dtype})"
        for n, m in model.named_modules()
        if getattr(m, "scheme", None) is not None  # sparsekit's quantized layers
        or (isinstance(getattr(m, "weight", None), torch.Tensor)
            and not m.weight.is_floating_point())
    ]
    if quantized:
        # torch-pruning only sees float Linear/Conv layers: it would remove nothing here
        raise UsageError(
            f"channel pruning needs float layers; these are quantized: {', '.join(quantized)}."
            " Prune channels before quantize_ (or prepare_qat_)"
        )
    for name, m in model.named_modules():
        if isinstance(m, PRUNABLE_TYPES):
            if m.weight.device.type == "meta":
                raise UsageError(
                    f"layer {name!r} has its weight on the meta device (no values to "
                    "score): materialize the model first (model.to_empty(device=...) and "
                    "load its weights)")
            check_finite_weight(name, m.weight, "pruning channels of")


class ChannelPruner:
    """Removes ``ratio`` of each layer's output channels, at once or over several steps.

    ``ratio`` is the fraction of output channels (filters, features, attention heads) removed
    per layer, relative to the widths at construction: 0.5 halves every prunable layer. With
    ``scope="global"`` the same fraction is removed over all layers together, more where the
    scores are low. Kept widths are rounded down to a multiple of ``round_to`` (8 or 16 suit
    tensor cores and 2:4 kernels); a layer that would round to zero keeps its width.

    What is never pruned: channels that reach a model output directly (a classifier's classes,
    an encoder's hidden size), so outputs keep their shapes; modules matching an ``exclude``
    pattern and Linear/Conv layers matching no ``include`` pattern (fnmatch globs or
    ``re:<regex>`` over qualified names, as everywhere in sparsekit). Attention loses whole heads:
    Hugging Face style attention (``query``/``key``/``value`` Linears) per layer, and
    ``nn.MultiheadAttention`` over the width it shares with the residual stream (its embedding
    width is heads x head size, so the same heads go in every block that shares that stream).

    ``criterion``: "magnitude" (L2 norm of the coupled weights), "lamp" (layer-adaptive
    magnitude), "taylor" (|weight x gradient|, which needs ``loss_fn(model) -> scalar loss`` on
    a few real batches; it is back-propagated before every pruning step), or a name registered
    with :func:`register_channel_criterion`.

    Pruning follows ``schedule`` (a :class:`sparsekit.Schedule`; default one shot): call
    ``step(step)`` during fine-tuning; it prunes when the schedule's progress rises and returns
    True then. Pruning replaces parameters, so rebuild the optimizer after a True.

    >>> import torch
    >>> from torch import nn
    >>> from sparsekit import Linear as LinearSchedule
    >>> model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 2))
    >>> pruner = ChannelPruner(model, torch.randn(1, 4), ratio=0.5,
    ...                        schedule=LinearSchedule(start=0, end=100, every=50))
    >>> [(pruner.step(t), model[0].out_features) for t in (0, 50, 60, 100)]
    [(False, 64), (True, 48), (False, 48), (True, 32)]
    """

    def __init__(
        self,
        model: nn.Module,
        example_inputs: Any,
        *,
        ratio: float,
        criterion: str = "magnitude",
        scope: str = "layer",
        round_to: int | None = 8,
        include: str | Sequence[str] = ("*",),
        exclude: str | Sequence[str] = (),
        schedule: Schedule | None = None,
        loss_fn: Callable[[nn.Module], torch.Tensor] | None = None,
    ) -> None:
        check_module(model, where="sk.ChannelPruner: ")
        self.ratio = check_fraction("ratio", ratio, _RATIO)
        scorer = channel_criterion(criterion)
        if scope not in SCOPES:
            raise UsageError(f"scope={scope!r} is not allowed; choose one of: {', '.join(SCOPES)}")
        self.round_to = 1 if round_to is None else check_int("round_to", round_to, 1)
        if scorer.needs_loss and loss_fn is None:
            raise UsageError(
                f"criterion={criterion!r} scores channels with gradients (taylor: |weight x "
                "gradient|) and needs loss_fn=lambda model: <scalar loss on a few real batches>"
            )
        if schedule is not None and not isinstance(schedule, Schedule):
            raise ConfigTypeError(
                f"schedule must be a sparsekit Schedule, got {type(schedule).__name__}"
            )
        _check_model(model)
        self.model = model
        self.example_inputs = example_inputs
        self.criterion, self.scope = str(criterion), str(scope)  # plain: saved in plans
        self.schedule = schedule if schedule is not None else OneShot(step=0)
        self.loss_fn = loss_fn
        self.progress = 0.0
        self._names = {m: n for n, m in model.named_modules()}
        self._widths0, self._heads0 = _widths(model)
        self._hf_attention = [m for m in model.modules() if _is_hf_attention(m)]
        # Every forward pass here runs in eval mode: batch-norm statistics must not move.
        with eval_mode(model, grad=True):
            call_model(model, example_inputs, hint=_INPUTS_HINT)  # a clear error, naming the layer
            self._counts0 = _count(model, example_inputs)
            self._tp = self._build_tp(self._ignored_modules(include, exclude))
            self._protected, self._mha_groups = self._special_groups()

    def _build_tp(self, ignored: list[nn.Module]) -> tp.pruner.BasePruner:
        # Whole heads for HF attention: torch-pruning groups q/k/v by head (num_heads) and removes
        # heads, never head dims; the residual and MLP widths follow `ratio` as channels.
        num_heads = {
            lin: att.num_attention_heads
            for att in self._hf_attention
            for lin in (att.query, att.key, att.value)
        }
        with warnings.catch_warnings():
            # torch-pruning warns about every unwrapped nn.Parameter (class tokens, position
            # embeddings); it prunes their last dimension, which is what these models need.
            warnings.filterwarnings("ignore", module="torch_pruning")
            try:
                return tp.pruner.BasePruner(
                    self.model,
                    self.example_inputs,
                    importance=channel_criterion(self.criterion).make(),
                    global_pruning=self.scope == "global",
                    pruning_ratio=self.ratio,
                    iterative_steps=1,
                    round_to=self.round_to if self.round_to > 1 else None,
                    ignored_layers=ignored,
                    num_heads=num_heads,
                    prune_num_heads=True,
                    prune_head_dims=False,
                    head_pruning_ratio=self.ratio,
                )
            except Exception as exc:
                raise UsageError(
                    f"torch-pruning could not trace {type(self.model).__name__} with the given "
                    f"example_inputs: {exc}"
                ) from exc

    def _ignored_modules(self, include: str | Sequence[str],
                         exclude: str | Sequence[str]) -> list[nn.Module]:
        """What torch-pruning must leave alone: every module an ``exclude`` pattern names (with
        its submodules), and the Linear/Conv layers no ``include`` pattern names."""
        include_l, exclude_l = include_patterns(include), as_patterns(exclude)
        for kind, patterns in (("include", include_l), ("exclude", exclude_l)):
            for p in patterns:
                if p != "*" and not any(name_matches(n, p) for n, _ in self.model.named_modules()
                                        if n):
                    raise UsageError(f"{kind} pattern {p!r} matches no module of the model")
        ignored = [m for n, m in self.model.named_modules()
                   if n and any(name_matches(n, p) for p in exclude_l)]
        if include_l != ["*"]:
            ignored += [m for n, m in self.model.named_modules()
                        if isinstance(m, PRUNABLE_TYPES) and m not in ignored
                        and not any(name_matches(n, p) for p in include_l)]
        return ignored

    def _special_groups(self) -> tuple[list[str], list[list[nn.MultiheadAttention]]]:
        """Take two kinds of group away from torch-pruning's ranking: groups whose channels
        reach a model output (pruning them would change the output shape) and groups holding
        nn.MultiheadAttention (pruned here as whole heads). Returns the protected layer names
        and the attention groups."""
        dg = _compat.tp_graph(self._tp)
        protected: list[str] = []
        mha_groups: list[list[nn.MultiheadAttention]] = []
        output_modules = _output_modules(self.model, self.example_inputs)
        for group in list(_compat.tp_groups(self._tp)):
            outs = [d.target.module for d, _ in group if dg.is_out_channel_pruning_fn(d.handler)]
            reaches_output = any(_compat.tp_is_output(d) for d, _ in group) or any(
                m in output_modules for m in outs
            )
            mhas = [m for m in dict.fromkeys(outs) if isinstance(m, nn.MultiheadAttention)]
            if reaches_output or mhas:
                _compat.tp_ignore(self._tp, (m for m in outs if isinstance(m, nn.Module)))
            if reaches_output:
                protected += [self._names[m] for m in outs if m in self._names]
            elif mhas:
                mha_groups.append(mhas)
        return sorted(set(protected)), mha_groups

    def step(self, step: int = 0) -> bool:
        """Prune to ``ratio x schedule.progress(step)`` of the starting widths if that is more
        than already removed. Returns True when the model changed (rebuild the optimizer)."""
        target = self.ratio * self.schedule.progress(step)
        if target <= self.progress:
            return False
        plan0 = channel_plan(self.model)
        state0 = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self._emptied: list[str] = []
        try:
            with eval_mode(self.model, grad=True):
                self._prune_to(target)
                if self.progress == 0 and channel_plan(self.model) == plan0:
                    self._check_removed_some(target)
                _sync_attributes(self.model)
                self._check_forward()
        except Exception:
            # Leave the caller's model as it was before this step, then re-raise.
            apply_channel_plan(self.model, plan0)
            self.model.load_state_dict(state0)
            raise
        if self._emptied:
            warnings.warn(
                f"channel pruning kept layer(s) {self._emptied} whole: ratio {target:g} with "
                f"round_to={self.round_to} would remove all of their channels", stacklevel=2
            )
        self.progress = target
        return True

    def _check_removed_some(self, target: float) -> None:
        """UsageError when nothing was removed although ``target`` asks for at least
        ``round_to`` channels of some prunable layer: rounding the kept widths to multiples of
        ``round_to`` would have emptied the layers, and a silent no-op would read as success."""
        ignored = set(map(id, _compat.tp_ignored(self._tp)))
        wanted = [
            n for n, w in self._widths0.items()
            if n not in self._protected and id(self.model.get_submodule(n)) not in ignored
            and target * w >= self.round_to
        ]
        if wanted:
            raise UsageError(
                f"channel pruning to ratio {target:g} with round_to={self.round_to} removed no "
                f"channel (it would leave fewer than round_to channels in layer(s) "
                f"{(self._emptied or wanted)[:4]}): lower the ratio or round_to"
            )

    def resume(self, plan: Mapping[str, Any], progress: float) -> None:
        """Continue a run on a fresh copy of the starting model: reshape it to ``plan`` (from
        :func:`channel_plan` at ``progress``) so later steps keep counting from the starting
        widths. Load the pruned weights afterwards."""
        # torch-pruning notes the starting widths at its first pruning step: take one that
        # removes nothing while the model still has them
        with eval_mode(self.model, grad=True):
            self._prune_to(0.0)
        apply_channel_plan(self.model, plan)
        self.progress = float(progress)

    @property
    def done(self) -> bool:
        """Whether the whole ``ratio`` is removed: later steps change nothing."""
        return self.progress >= self.ratio

    def state_dict(self) -> dict[str, Any]:
        """Plain data for a resume checkpoint: the channel plan of the model now (see
        :func:`channel_plan`) and the fraction of channels removed so far."""
        return {"plan": channel_plan(self.model), "progress": self.progress}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """:meth:`resume` from what :meth:`state_dict` saved (on a fresh copy of the starting
        model; load the pruned weights afterwards)."""
        if not isinstance(state, Mapping) or not {"plan", "progress"} <= set(state):
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise UsageError(f"channel pruner state must hold 'plan' and 'progress', got {got}")
        progress = state["progress"]
        if isinstance(progress, bool) or not isinstance(progress, (int, float)) or not (
            0.0 <= float(progress) <= self.ratio
        ):
            raise UsageError(
                f"channel pruner state['progress'] must be a number in [0, {self.ratio}] (the "
                f"fraction of channels removed), got {progress!r}"
            )
        self.resume(state["plan"], progress)

    def finalize(self) -> nn.Module:
        """The pruned model: its layers are plain, narrower modules already, so nothing is
        folded (the protocol shared with :class:`~sparsekit.Pruner`). Returns the model."""
        return self.model

    def _prune_to(self, target: float) -> None:
        tp_pruner = self._tp
        if self.loss_fn is not None:
            self.model.zero_grad()
            self.loss_fn(self.model).backward()
        _compat.tp_set_target(tp_pruner, target)
        # Its per-layer head count is relative to the heads left, not the initial ones.
        for att in self._hf_attention if self.scope == "layer" else ():
            now, initial = _compat.tp_heads(tp_pruner, att.query)
            keep = max(1, int(initial * (1 - target)))
            r = max(0.0, (now - keep) / now - 1e-9)
            for lin in (att.query, att.key, att.value):
                _compat.tp_set_head_ratio(tp_pruner, lin, r)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="torch_pruning")
            for group in tp_pruner.step(interactive=True):
                if self._empties_a_layer(group):  # kept whole; step() says so
                    self._emptied.append(self._names.get(group[0][0].target.module, "?"))
                    continue
                group.prune()
            for mhas in self._mha_groups:
                self._prune_mha_heads(mhas, target)
        if self.loss_fn is not None:
            self.model.zero_grad(set_to_none=True)  # the scoring gradients are not training's
        for att in self._hf_attention:
            att.num_attention_heads = _compat.tp_heads(tp_pruner, att.query)[0]

    def _empties_a_layer(self, group: Any) -> bool:
        """True when rounding would remove every channel of the group's root layer."""
        dep, idxs = group[0]
        dg = _compat.tp_graph(self._tp)
        if dg.is_out_channel_pruning_fn(dep.handler):
            width = dg.get_out_channels(dep.target.module)
        else:
            width = dg.get_in_channels(dep.target.module)
        return width is not None and len(idxs) >= width

    def _prune_mha_heads(self, mhas: list[nn.MultiheadAttention], target: float) -> None:
        """Remove the lowest-scoring whole heads from attention modules that share one width."""
        first = mhas[0]
        if any(m.num_heads != first.num_heads or m.embed_dim != first.embed_dim for m in mhas):
            names = ", ".join(self._names[m] for m in mhas)
            raise UsageError(
                f"attention modules {names} share a width but differ in heads; ignore them"
            )
        heads0 = self._heads0[self._names[first]]
        keep = max(1, int(heads0 * (1 - target)))
        n_remove = first.num_heads - keep
        if n_remove <= 0:
            return
        dg = _compat.tp_graph(self._tp)
        prune_fn = tp.prune_multihead_attention_out_channels
        head_dim = first.head_dim
        full = dg.get_pruning_group(first, prune_fn, list(range(first.embed_dim)))
        imp = self._tp.estimate_importance(full)
        head_imp = imp.view(first.num_heads, head_dim).mean(1)
        worst = torch.topk(head_imp, n_remove, largest=False).indices.tolist()
        idxs = [h * head_dim + i for h in sorted(worst) for i in range(head_dim)]
        for m in mhas:
            # torch-pruning keeps num_heads and shrinks head_dim; we drop heads instead, so set
            # the new count first (its check and head_dim update then see whole heads).
            m.num_heads = keep
        dg.get_pruning_group(first, prune_fn, idxs).prune()

    def _check_forward(self) -> None:
        """Run example_inputs through the pruned model; on failure name the module that broke."""
        stack: list[str] = []

        def enter(name: str) -> Callable[..., None]:
            return lambda *_: stack.append(name)  # list.append returns None: input unchanged

        def leave(*_: Any) -> None:
            stack.pop()

        handles = []
        for name, m in self.model.named_modules():
            handles.append(m.register_forward_pre_hook(enter(name)))
            handles.append(m.register_forward_hook(leave))
        try:
            with torch.no_grad():
                feed(self.model, self.example_inputs, _INPUTS_HINT)
        except Exception as exc:
            where = stack[-1] if stack else "<top level>"
            module = self.model.get_submodule(where) if stack else self.model
            raise UsageError(
                f"channel pruning cannot handle module '{where}' ({type(module).__name__}): the "
                f"pruned model fails there with {type(exc).__name__}: {exc}. Keep it unpruned "
                f"with exclude=['{where}'] (the model was left unchanged)"
            ) from exc
        finally:
            for h in handles:
                h.remove()

    def report(self) -> ChannelReport:
        """Widths, parameters and MACs now, against those at construction."""
        widths, heads = _widths(self.model)
        params, macs = _count(self.model, self.example_inputs)
        return ChannelReport(
            ratio=self.ratio,
            criterion=self.criterion,
            scope=self.scope,
            round_to=self.round_to,
            layers={n: (w, widths[n]) for n, w in self._widths0.items() if n in widths},
            heads={n: (h, heads[n]) for n, h in self._heads0.items() if n in heads},
            params_before=self._counts0[0],
            params_after=params,
            macs_before=self._counts0[1],
            macs_after=macs,
            protected=self._protected,
        )


def prune_channels_(
    model: nn.Module, example_inputs: Any, *, ratio: float, steps: int = 1, **options: Any
) -> ChannelReport:
    """Remove ``ratio`` (fraction, per layer) of the output channels of ``model`` in place.

    ``example_inputs`` is one batch as the model takes it (a tensor, a tuple of positional
    arguments or a dict of keyword arguments); it is traced to find coupled channels and used
    to count MACs. ``steps > 1`` prunes in that many equal increments (ratio x k / steps), each
    re-scoring the channels that remain. For pruning interleaved with fine-tuning use
    :class:`ChannelPruner` with a schedule. ``options`` are :class:`ChannelPruner`'s:
    ``criterion``, ``scope``, ``round_to``, ``include``, ``exclude``, ``loss_fn``.
    Returns a :class:`ChannelReport`.
    """
    steps = check_int("steps", steps, 1)
    pruner = ChannelPruner(model, example_inputs, ratio=ratio,
                           schedule=Linear(start=0, end=steps, every=1), **options)
    for k in range(1, steps + 1):
        pruner.step(k)
    return pruner.report()


def _sync_attributes(model: nn.Module) -> None:
    """Update the width attributes that forward passes read but torch-pruning does not know."""
    for m in model.modules():
        if _is_hf_attention(m):
            m.all_head_size = m.query.out_features
            m.attention_head_size = m.all_head_size // m.num_attention_heads
        elif type(m).__name__ == "VisionTransformer" and isinstance(
            getattr(m, "conv_proj", None), nn.Conv2d
        ):
            m.hidden_dim = m.conv_proj.out_channels  # torchvision reshapes patches with it
        elif type(m).__name__ == "EncoderBlock" and isinstance(
            getattr(m, "self_attention", None), nn.MultiheadAttention
        ):
            m.num_heads = m.self_attention.num_heads


# ----------------------------------------------------------------------------------------------
# Channel plan: the pruned architecture as plain JSON data


def _int_attrs(module: nn.Module) -> dict[str, int | list[int]]:
    attrs: dict[str, int | list[int]] = {}
    for k, v in vars(module).items():
        if k.startswith("_") or k in _PLAN_SKIP_ATTRS or isinstance(v, bool):
            continue
        if isinstance(v, int):
            attrs[k] = v
        elif (
            isinstance(v, (tuple, list))
            and v
            and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        ):
            attrs[k] = list(v)
    return attrs


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_parameter) of a module's own parameters and buffers; a parametrized
    tensor (a pruning mask) is reported under its plain name, as a fresh model has it."""
    for k, p in module._parameters.items():
        if p is not None:
            yield k, p, True
    for k, b in module._buffers.items():
        if b is not None:
            yield k, b, False
    if parametrize.is_parametrized(module):
        for k, plist in module.parametrizations.items():  # several originals (weight_norm):
            yield k, plist.original if hasattr(plist, "original") else getattr(module, k), True


def _plan_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Named modules without the containers that parametrizations (masks) add."""
    for name, m in model.named_modules():
        if "parametrizations" not in name.split("."):
            yield name, m


def _type_name(module: nn.Module) -> str:
    return type(module).__name__.removeprefix("Parametrized")


def channel_plan(model: nn.Module) -> dict[str, Any]:
    """The architecture of a (pruned) model as JSON-serialisable data: for every module, its
    type, the shape of each parameter and buffer, and its integer width attributes
    (``out_channels``, ``embed_dim``, ``num_heads``, ...). :func:`apply_channel_plan` turns a
    fresh model of the same class into this architecture so the pruned ``state_dict`` loads.
    Masked (parametrized) modules are described as the plain modules they stand for.

    >>> from torch import nn
    >>> plan = channel_plan(nn.Linear(4, 2))
    >>> plan["modules"][""]["shapes"]
    {'weight': [2, 4], 'bias': [2]}
    """
    check_module(model, where="channel_plan: ")
    modules = {}
    for name, m in _plan_modules(model):
        shapes = {k: list(t.shape) for k, t, _ in _tensors(m)}
        modules[name] = {"type": _type_name(m), "shapes": shapes, "attrs": _int_attrs(m)}
    return {"format": PLAN_FORMAT, "version": PLAN_VERSION, "modules": modules}


def apply_channel_plan(model: nn.Module, plan: Mapping[str, Any]) -> nn.Module:
    """Reshape ``model`` (freshly built, same class as the pruned one) in place to the widths in
    ``plan`` (from :func:`channel_plan`). Resized parameters and buffers are zero-filled: load
    the pruned ``state_dict`` next. Raises ValueError naming the first module that does not
    match. A module whose type differs (a layer that was later quantized, say) gets only the
    shapes and widths it has itself; its own plan (e.g. the quantization plan) does the rest.
    Returns ``model``.

    >>> import torch
    >>> from torch import nn
    >>> pruned = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    >>> _ = prune_channels_(pruned, torch.randn(1, 4), ratio=0.5)
    >>> fresh = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    >>> fresh = apply_channel_plan(fresh, channel_plan(pruned))
    >>> fresh.load_state_dict(pruned.state_dict())
    <All keys matched successfully>
    """
    check_module(model, where="apply_channel_plan: ")
    check_mapping(plan, "apply_channel_plan: plan", "from channel_plan(model)")
    if plan.get("format") != PLAN_FORMAT or plan.get("version") != PLAN_VERSION:
        raise UsageError(
            f"not a channel plan (format {PLAN_FORMAT!r} version {PLAN_VERSION}): got format "
            f"{plan.get('format')!r} version {plan.get('version')!r}"
        )
    entries = plan["modules"]
    present = dict(_plan_modules(model))
    for name in present:
        if name not in entries:
            raise UsageError(f"module '{name}' of the model is not in the channel plan")
    for name, entry in entries.items():
        m = present.get(name)
        if m is None:
            raise UsageError(
                f"channel plan expects a {entry['type']} at '{name}'; the model has none"
            )
        strict = _type_name(m) == entry["type"]
        current = {k: (t, is_param) for k, t, is_param in _tensors(m)}
        for k, shape in entry["shapes"].items():
            if k not in current:
                if strict:
                    raise UsageError(f"channel plan expects tensor '{k}' on module '{name}'")
                continue
            t, is_param = current[k]
            if list(t.shape) == list(shape):
                continue
            new = torch.zeros(shape, dtype=t.dtype, device=t.device)
            if is_param:
                m._parameters[k] = nn.Parameter(new, requires_grad=t.requires_grad)
            else:
                m._buffers[k] = new
        for k, v in entry["attrs"].items():
            old = vars(m).get(k)
            if old is None:
                if strict:
                    raise UsageError(f"channel plan sets '{k}' on module '{name}', which has none")
                continue
            with contextlib.suppress(TypeError):
                v = type(old)(v)  # tuples (kernel_size, normalized_shape) come back as lists
            setattr(m, k, v)
    return model


checkpoint.register_plan("channels", channel_plan, apply_channel_plan)
