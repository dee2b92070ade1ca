"""Running calibration batches through a model (Wanda, SparseGPT, quantization, channels).

:func:`call_model` is the one place that turns a batch into a model call; a failure inside the
model is reported as :class:`~sparsekit.errors.ModelCallError` naming the layer that failed and
the batch's shapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sparsekit.errors import ConfigTypeError, ModelCallError, SparsekitError, UsageError

CalibrationFn = Callable[[nn.Module, Any], Any]

_HOW = (
    "pass calibration_fn=lambda model, batch: model(...) to say how a batch is fed, for "
    "example calibration_fn=lambda model, batch: model(batch) for a forward(features: dict)"
)


def tree_map(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``fn`` applied to every tensor in nested lists, tuples (named too), dicts and dataclasses
    (HF ``ModelOutput`` included), each container rebuilt as its own type; other leaves as
    they are. The one tree-map of sparsekit (batches, example inputs, model outputs)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return type(obj)(**{f.name: tree_map(fn, getattr(obj, f.name))
                            for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(tree_map(fn, o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(tree_map(fn, o) for o in obj)
    if isinstance(obj, dict):
        out = {k: tree_map(fn, v) for k, v in obj.items()}
        return out if type(obj) is dict else type(obj)(out)
    if isinstance(obj, Mapping):
        return {k: tree_map(fn, v) for k, v in obj.items()}
    return obj


def to_device(batch: Any, device: torch.device | str) -> Any:
    """Every tensor of ``batch`` moved to ``device`` (see :func:`tree_map`)."""
    return tree_map(lambda t: t.to(device), batch)


def describe(batch: Any) -> str:
    """A batch's structure and shapes, short: ``tensor(4, 7)``, ``tuple(tensor(4, 7), int)``,
    ``dict(input_ids=tensor(2, 16))``."""
    if isinstance(batch, torch.Tensor):
        return f"tensor({', '.join(map(str, batch.shape))})"
    if isinstance(batch, Mapping):
        items = list(batch.items())
        inner = ", ".join(f"{k}={describe(v)}" for k, v in items[:6])
        return f"dict({inner}{', ...' if len(items) > 6 else ''})"
    if isinstance(batch, (list, tuple)):
        inner = ", ".join(describe(v) for v in list(batch)[:6])
        return f"{type(batch).__name__}({inner}{', ...' if len(batch) > 6 else ''})"
    return type(batch).__name__


def _signature(model: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin or C++ forward: nothing to inspect
        return None


def _binds(sig: inspect.Signature | None, *args: Any, **kwargs: Any) -> bool | None:
    """Whether ``forward(*args, **kwargs)`` fits the signature (None when it is unknown)."""
    if sig is None:
        return None
    try:
        sig.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def model_arguments(model: nn.Module, batch: Any, hint: str = _HOW) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for one batch: a tensor as ``model(x)``, a tuple/list as
    ``model(*b)``, a dict as ``model(**b)``, or as ``model(b)`` when the model's forward takes
    one positional argument and not the dict's keys (sentence-transformers' ``forward(features)``).
    Raises ModelCallError when the forward's signature fits neither, with ``hint`` (how to
    pass ``calibration_fn``)."""
    sig = _signature(model)
    if isinstance(batch, torch.Tensor):
        args, kwargs = (batch,), {}
    elif isinstance(batch, Mapping):
        if not all(isinstance(k, str) for k in batch):
            raise ConfigTypeError(
                f"batch {describe(batch)} has non-string keys; a dict batch is passed as "
                f"keyword arguments; {hint}"
            )
        if _binds(sig, **batch) is False and _binds(sig, batch):
            return (batch,), {}
        args, kwargs = (), dict(batch)
    elif isinstance(batch, (list, tuple)):
        args, kwargs = tuple(batch), {}
    else:
        raise ConfigTypeError(
            f"batch of type {type(batch).__name__} is not a tensor, tuple, list or dict; {hint}"
        )
    if _binds(sig, *args, **kwargs) is False:
        raise ModelCallError(
            f"{type(model).__name__}.forward{sig} cannot take batch {describe(batch)} (a "
            f"tensor is passed as model(x), a tuple/list as model(*b), a dict as model(**b) or "
            f"model(b)); {hint}"
        )
    return args, kwargs


def feed(model: nn.Module, batch: Any, hint: str = _HOW) -> Any:
    """``model`` called on one batch as :func:`model_arguments` says (no device move, no error
    wrapping, no hooks: safe on a compiled model). :func:`call_model` adds those."""
    args, kwargs = model_arguments(model, batch, hint)
    return model(*args, **kwargs)


class _LayerTrace:
    """Forward pre-/post-hooks on every submodule keeping the stack of layers being called: a
    layer that raises never runs its post-hook, so the top of the stack names it."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.stack: list[str] = []
        self._handles: list[Any] = []

    def __enter__(self) -> _LayerTrace:
        for name, module in self.model.named_modules():
            if name:
                self._handles.append(module.register_forward_pre_hook(self._enter(name)))
                self._handles.append(module.register_forward_hook(self._leave))
        return self

    def _enter(self, name: str) -> Callable:
        def hook(_module: nn.Module, _args: Any) -> None:
            self.stack.append(name)

        return hook

    def _leave(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        if self.stack:
            self.stack.pop()

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def check_no_meta(batch: Any, what: str = "a calibration batch") -> None:
    """UsageError when a tensor of ``batch`` is on the meta device (a shape, no values)."""
    found: list[torch.Tensor] = []
    tree_map(lambda t: found.append(t) if t.device.type == "meta" else t, batch)
    if found:
        raise UsageError(f"{what} ({describe(batch)}) holds a tensor on the meta device (a "
                         "shape without values): pass real tensors")


def call_model(
    model: nn.Module, batch: Any, calibration_fn: CalibrationFn | None = None, hint: str = _HOW
) -> Any:
    """Feed one batch as :func:`model_arguments` says; ``calibration_fn(model, batch)``
    overrides that. An exception inside the model becomes ModelCallError naming the innermost
    layer that failed and the batch's shapes (sparsekit's own errors pass through)."""
    if calibration_fn is not None:
        args, kwargs, call = (model, batch), {}, calibration_fn
    else:
        try:
            device = next(model.parameters()).device
        except StopIteration:
            device = torch.device("cpu")
        if device.type != "meta":
            check_no_meta(batch)
        batch = to_device(batch, device)
        args, kwargs = model_arguments(model, batch, hint)
        call = model
    with _LayerTrace(model) as trace:
        try:
            return call(*args, **kwargs)
        except SparsekitError:
            raise
        except Exception as e:
            where = f"{type(model).__name__}.forward"
            if trace.stack:
                layer = trace.stack[-1]
                kind = type(model.get_submodule(layer)).__name__.removeprefix("Parametrized")
                where = f"layer {layer!r} ({kind})"
            how = "" if calibration_fn is not None else f"; if the batch is fed wrongly, {hint}"
            first = (str(e).strip().splitlines() or [""])[0]
            raise ModelCallError(
                f"calling the model on batch {describe(batch)} failed in {where}: "
                f"{type(e).__name__}: {first}{how}"
            ) from e


@contextlib.contextmanager
def eval_mode(model: nn.Module, grad: bool = False) -> Iterator[nn.Module]:
    """``model`` in eval mode, and without autograd unless ``grad=True`` (channel pruning
    traces autograd graphs), inside the block; the training flag is restored afterwards, also
    on an exception."""
    was_training = model.training
    model.eval()
    try:
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            yield model
    finally:
        model.train(was_training)


def check_calibration(calibration: Any) -> None:
    """ConfigTypeError unless ``calibration`` is None or an iterable of batches (one tensor or
    dict would be iterated row by row or key by key: silently the wrong batches)."""
    if calibration is None:
        return
    if isinstance(calibration, (torch.Tensor, Mapping, str, bytes)) or not isinstance(
        calibration, Iterable
    ):
        raise ConfigTypeError(
            f"calibration must be an iterable of batches, got one {describe(calibration)}; "
            "wrap a single batch in a list: calibration=[batch]"
        )


def run_calibration(
    model: nn.Module,
    calibration: Iterable[Any],
    calibration_fn: CalibrationFn | None = None,
) -> int:
    """Run every batch through ``model`` in eval mode without gradients; restores the training
    flag afterwards. Returns the number of batches. Raises UsageError when there are none."""
    if calibration is None:
        raise UsageError("calibration is required for this criterion: pass an iterable of batches")
    check_calibration(calibration)
    n = 0
    with eval_mode(model):
        for batch in calibration:
            call_model(model, batch, calibration_fn)
            n += 1
    if n == 0:
        raise UsageError("calibration yielded no batches: pass at least one batch")
    return n


def conv_pads(conv: nn.modules.conv._ConvNd) -> list[int]:
    """``F.pad`` widths (last spatial dimension first, left then right) equivalent to the
    conv's padding, ``padding='same'`` included (the extra pixel on the right, as PyTorch)."""
    pads: list[int] = []
    for d in reversed(range(len(conv.kernel_size))):
        if conv.padding == "valid":
            lo = hi = 0
        elif conv.padding == "same":
            total = conv.dilation[d] * (conv.kernel_size[d] - 1)
            lo, hi = total // 2, total - total // 2
        else:
            lo = hi = conv.padding[d]
        pads += [lo, hi]
    return pads


def conv_columns(conv: nn.modules.conv._ConvNd, x: torch.Tensor) -> torch.Tensor:
    """The conv's input as GEMM rows: ``(groups, n_positions, in/groups * prod(kernel))``,
    ordered like ``conv.weight[g * out_g:(g + 1) * out_g].flatten(1)``, so that
    ``conv(x)`` (without bias) equals ``rows @ weight_g.T`` for each group ``g``."""
    nd = len(conv.kernel_size)
    if x.dim() == nd + 1:  # unbatched input
        x = x.unsqueeze(0)
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    x = F.pad(x, conv_pads(conv), mode=mode)
    return im2col(x, conv.kernel_size, conv.stride, conv.dilation, conv.groups)


def im2col(x: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int],
           dilation: Sequence[int], groups: int = 1) -> torch.Tensor:
    """The one im2col of sparsekit (criteria, SparseGPT, quantized convs): an already padded
    batched input ``(B, C, *spatial)`` as ``(groups, B * positions, C/groups * prod(kernel))``,
    rows ordered by sample then output position (row-major), columns by channel then kernel
    position, as ``weight.flatten(1)``; any number of spatial dimensions."""
    nd = len(kernel_size)
    for d in range(nd):
        span = dilation[d] * (kernel_size[d] - 1) + 1
        x = x.unfold(2 + d, span, stride[d])[..., :: dilation[d]]
    # x: (B, C, *out_positions, *kernel) -> (B * positions, C, *kernel)
    c = x.shape[1]
    x = x.permute(0, *range(2, 2 + nd), 1, *range(2 + nd, 2 + 2 * nd))
    x = x.reshape(-1, groups, c // groups * x.shape[-nd:].numel())
    return x.transpose(0, 1)


def gemm_inputs(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's input as GEMM rows ``(tokens, in * prod(kernel))``: Linear treats every
    leading dimension as a token; a conv's rows are its unfolded patches (im2col, any padding
    mode, stride, dilation; for ``groups > 1`` the groups' features side by side)."""
    if isinstance(module, nn.Linear):
        return x.reshape(-1, x.shape[-1])
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        cols = conv_columns(module, x)  # (groups, tokens, in/groups * prod(kernel))
        return cols.transpose(0, 1).reshape(cols.shape[1], -1)
    raise ConfigTypeError(f"no GEMM form for {type(module).__name__}")
