"""The two option objects of :func:`~sparsekit.accel.accelerate`: how the accelerated model is
compiled (:class:`CompileOptions`) and how its variants are planned (:class:`PlanOptions`).
Both are frozen and checked when built: a bad value is a ``UsageError`` (a ``ValueError``)
naming the field and what it allows.

>>> import sparsekit as sk
>>> sk.CompileOptions(mode="max-autotune").backend
'inductor'
>>> sk.PlanOptions(min_speedup=1.05).whole_model is None
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparsekit import _compat
from sparsekit.accel.kernels import switches as kernel_switches
from sparsekit.accel.layers import check_precision
from sparsekit.errors import UsageError

# torch.compile's modes
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _check_flag(owner: str, name: str, value: Any, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        allowed = "True, False or None" if optional else "True or False"
        raise UsageError(f"{owner}.{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class CompileOptions:
    """How ``accelerate`` compiles the model (``accelerate(compile=CompileOptions(...))``;
    ``compile=True`` is ``CompileOptions()``, ``compile=False`` runs it eagerly).

    ``mode``: torch.compile's mode (one of :data:`MODES`); None: "default" where sparsekit's own
    CUDA graphs replay the model (``capture``) or on CPU, else "reduce-overhead".
    ``dynamic``: torch.compile's ``dynamic`` (None: a new input shape recompiles once with
    dynamic sizes). ``backend``: a registered torch.compile backend ("inductor"; "eager" and
    "aot_eager" for tests). ``inductor``: extra inductor options (e.g.
    ``{"triton.multi_kernel": 1}``) over the mode's, for the model and the planner (needs
    backend "inductor"). ``capture``: sparsekit's own CUDA graph per input signature around the
    model compiled in mode "default", replayed without dynamo's guard check
    (:mod:`sparsekit.accel.graphs`); None: on CUDA when ``mode`` is not given and the example
    inputs hold only tensors and scalars; False: ``mode="reduce-overhead"``.
    ``clone_outputs``: under CUDA graphs an output lives in the graph's memory until the next
    call; cloning hands out tensors of your own (turn it off when you consume each output
    before the next call). ``warmup``: run the example inputs once inside ``accelerate``, so
    that its time holds the compile and the first call is fast; False leaves the compile to
    the first call (a model served only through ``generate()``, which compiles its own prefill
    and decode graphs, never runs the example's graph: False saves that compile)."""

    mode: str | None = None
    dynamic: bool | None = None
    backend: str = "inductor"
    inductor: dict | None = None
    capture: bool | None = None
    clone_outputs: bool = True
    warmup: bool = True

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in MODES:
            raise UsageError(f"CompileOptions.mode must be None or one of {MODES}, "
                             f"got {self.mode!r}")
        _check_flag("CompileOptions", "dynamic", self.dynamic, optional=True)
        _check_flag("CompileOptions", "capture", self.capture, optional=True)
        _check_flag("CompileOptions", "clone_outputs", self.clone_outputs)
        _check_flag("CompileOptions", "warmup", self.warmup)
        self._check_backend()
        if self.capture and self.mode == "reduce-overhead":
            raise UsageError("CompileOptions(capture=True) replays sparsekit's own CUDA graphs "
                             "and needs a mode other than 'reduce-overhead' (torch's CUDA "
                             "graphs): pass one of them")
        if self.inductor is not None:
            self._check_inductor()

    def _check_backend(self) -> None:
        if self.backend == "inductor":
            return
        import torch

        known = torch.compiler.list_backends(exclude_tags=())
        if not isinstance(self.backend, str) or self.backend not in known:
            raise UsageError(f"CompileOptions.backend must be a registered torch.compile "
                             f"backend (e.g. 'inductor', 'eager', 'aot_eager'), got "
                             f"{self.backend!r}")

    def _check_inductor(self) -> None:
        """A dict of inductor option names torch.compile knows (copied: a later change to the
        caller's dict changes nothing here)."""
        if not isinstance(self.inductor, dict) or not all(isinstance(k, str)
                                                          for k in self.inductor):
            raise UsageError(f"CompileOptions.inductor must be a dict of inductor option "
                             f"names, got {self.inductor!r}")
        object.__setattr__(self, "inductor", dict(self.inductor))
        from torch import nn

        try:
            _compat.compile_module(nn.Identity(), backend=self.backend, options=self.inductor)
        except ValueError as e:
            raise UsageError(f"CompileOptions.inductor: {e}") from None


@dataclass(frozen=True)
class PlanOptions:
    """How ``accelerate`` picks each layer's variant (``accelerate(plan=PlanOptions(...))``;
    :mod:`sparsekit.accel.planner`).

    ``min_speedup`` (> 0): what a variant (per GEMM shape) or a whole-model plan must beat bf16
    dense by to be kept. ``dense_precision``: the precision of layers without a 2:4 pattern
    ("bf16"; "fp8" runs e.g. an LM head as fp8 dense). ``fused_quant``: an 8-bit layer's
    activation quantization as plain torch ops the compiler fuses into its producer (True) or
    the opaque ``sparsekit::quant_rows`` op. ``search_algs``: search each 2:4 shape's fastest
    cuSPARSELt algorithm (CUDA). ``cache``: reuse the timings and choices cached on disk
    (``$SPARSEKIT_CACHE/plans.json``; False re-measures). ``whole_model`` (``sparsity="auto"``):
    after the per-layer choice, time a few whole-model plans as they will run and keep the
    fastest (None: on CUDA). ``siblings``: layers fed one tensor (q/k/v, gate/up) with one
    variant become one GEMM (compiled by inductor; :mod:`sparsekit.accel.siblings`).
    ``decode_dense`` (``sparsity="auto"``, CUDA): a 2:4 layer keeps a bf16 dense copy of its
    weight (2 bytes per weight) and runs ``F.linear`` on it at the decode token counts (M <= 32)
    where bf16 dense was timed faster than both its 2:4 paths; False keeps no copy (less
    memory; those batches then run slower than dense).

    The kernels (CUDA; :mod:`sparsekit.accel.kernels.switches`): ``mma_sp``: "auto" (bf16 and
    int4 2:4 layers decode on the mma.sp library where it is built and loads; an fp8 layer
    where its decode plan timed it faster than the Triton kernel), "all" (every fp8 2:4 layer
    too, untimed) or "off" (the Triton 2:4 kernels only). ``cslt_epilogue``: an fp8 2:4 layer
    with one static activation scale and one weight scale runs scale, bias (and GELU) inside
    the cuSPARSELt GEMM on sparsekit's binding where it is built (False: torch's binding, the
    epilogue as separate ops). ``decode_attention``: ``generate`` attends with sparsekit's
    decode attention kernel on a model on HF's SDPA (False: HF's SDPA). ``lagged_stop``:
    ``generate`` reads its "all finished?" flag two steps late instead of waiting for the GPU
    after every token (same tokens)."""

    min_speedup: float = 1.0
    dense_precision: str = "bf16"
    fused_quant: bool = True
    search_algs: bool = True
    cache: bool = True
    whole_model: bool | None = None
    siblings: bool = False
    decode_dense: bool = True
    mma_sp: str = "auto"
    cslt_epilogue: bool = True
    decode_attention: bool = True
    lagged_stop: bool = True

    def __post_init__(self) -> None:
        speedup = self.min_speedup
        if isinstance(speedup, bool) or not isinstance(speedup, (int, float)) or \
                not speedup > 0:
            raise UsageError(f"PlanOptions.min_speedup must be a number > 0, got {speedup!r}")
        check_precision("PlanOptions.dense_precision", self.dense_precision)
        for name in ("fused_quant", "search_algs", "cache", "siblings", "decode_dense",
                     "cslt_epilogue", "decode_attention", "lagged_stop"):
            _check_flag("PlanOptions", name, getattr(self, name))
        _check_flag("PlanOptions", "whole_model", self.whole_model, optional=True)
        if not isinstance(self.mma_sp, str) or self.mma_sp not in kernel_switches.MMA_SP:
            raise UsageError(f"PlanOptions.mma_sp must be one of {kernel_switches.MMA_SP}, got "
                             f"{self.mma_sp!r}")

    def switches(self) -> kernel_switches.Switches:
        """The kernel choices the kernels read while this plan is current."""
        return kernel_switches.Switches(self.mma_sp, self.cslt_epilogue, self.decode_attention,
                                 self.lagged_stop)


__all__ = ["MODES", "CompileOptions", "PlanOptions"]
