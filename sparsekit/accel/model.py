"""The :class:`AcceleratedModel` ``accelerate`` returns: the model with its layers on kernel
modules, run through ``torch.compile`` (or eagerly), replayed as CUDA graphs on CUDA."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sparsekit import _compat
from sparsekit.accel import graphs
from sparsekit.accel import epilogue
from sparsekit.accel.epilogue import uses_alpha_path
from sparsekit.accel.kernels import switches
from sparsekit.accel.options import CompileOptions, PlanOptions
from sparsekit.accel.report import AccelReport
from sparsekit.nn.calibration import tree_map

log = logging.getLogger(__name__)


class AcceleratedModel(nn.Module):
    """The accelerated model: ``model`` (its linears replaced by kernel modules) run through
    ``torch.compile`` as ``options`` say (:class:`~sparsekit.accel.options.CompileOptions`), or
    eagerly with ``compile=False``. Floating inputs are cast to bfloat16 and moved to the
    model's device. Outputs keep their types (HF ``ModelOutput``, tuples, dataclasses).

    ``sparsekit_report`` (also ``report``) is the :class:`AccelReport`; ``report.compiles``
    counts the graphs the compiler built so far (a new input shape may add one; a warning
    names more than ``max_compiles``). Dynamo's recompile limit is per code object, shared by
    every model of a class in the process; calls raise it to
    :data:`sparsekit._compat.FRAME_COMPILES` (past which a frame runs eagerly), so that a
    process holding several accelerated models does not run the later ones uncompiled. With
    ``options.capture`` (CUDA only) the model is compiled in mode "default" and replayed as
    sparsekit's own CUDA graphs (``graphs``, a
    :class:`~sparsekit.accel.graphs.GraphCache`); a call that cannot be captured switches the
    model to ``mode="reduce-overhead"`` for good, with a note in the report."""

    _sparsekit_accelerated = True

    def __init__(self, model: nn.Module, report: AccelReport, device: torch.device,
                 options: CompileOptions | None = None, *, compile: bool = True,
                 max_compiles: int = 8):
        super().__init__()
        options = options or CompileOptions()
        self.model = model
        self.sparsekit_report = report
        self.device = device
        self.options = options
        # the plan's choices (accelerate sets it); generate runs with its kernel switches
        self.plan = PlanOptions()
        self.clone_outputs = options.clone_outputs
        self.max_compiles = max_compiles
        self.fuse_gelu: Any = None  # an epilogue.FuseGelu when the model runs one
        capture = bool(options.capture) and compile and device.type == "cuda"
        if compile:
            mode = options.mode
            if mode is None:
                mode = "default" if capture or device.type != "cuda" else "reduce-overhead"
            runner = self._compile(mode)
        else:
            runner = model
        self.compiled = compile
        # kept out of the module tree: the model's tensors are listed once, under ``model.``
        self.__dict__["runner"] = runner
        self.__dict__["graphs"] = graphs.GraphCache(runner) if capture else None

    def _compile(self, mode: str) -> Callable:
        """The model through ``torch.compile`` in ``mode`` (with sparsekit's GELU pass where
        its layers can take it)."""
        backend, inductor = self.options.backend, self.options.inductor
        if backend == "inductor" and uses_alpha_path(self.model) and \
                "pre_grad_custom_pass" not in (inductor or {}):
            # GELU into the epilogue of the GEMMs on sparsekit's binding
            if self.fuse_gelu is None:
                self.fuse_gelu = epilogue.FuseGelu()
            inductor = {**(inductor or {}), "pre_grad_custom_pass": self.fuse_gelu}
        return _compat.compile_module(self.model, mode=mode, dynamic=self.options.dynamic,
                                      backend=backend, options=inductor)

    @property
    def report(self) -> AccelReport:
        return self.sparsekit_report

    @property
    def capture(self) -> bool:
        """Whether calls run on sparsekit's own CUDA graphs now (False after a fallback to
        reduce-overhead)."""
        return self.graphs is not None

    def forward(self, *args, **kwargs):
        args, kwargs = tree_map(self._as_input, (args, kwargs))
        with torch.no_grad(), _compat.recompile_limit():
            out = self._captured(args, kwargs) if self.graphs is not None else None
            if out is None:
                before = _compat.compiled_graph_count() if self.compiled else 0
                out = self.runner(*args, **kwargs)
                if self.compiled:
                    self._count(_compat.compiled_graph_count() - before)
        if self.clone_outputs and self.device.type == "cuda":
            out = tree_map(torch.clone, out)
        return out

    def _captured(self, args: tuple, kwargs: dict) -> Any:
        """The output of the call's captured CUDA graph (captured now if its signature is new),
        or None: the model is then recompiled with ``mode="reduce-overhead"``, once, and this
        and every later call runs that (the report says why)."""
        cache = self.graphs
        before = cache.compiled
        out = cache.run(args, kwargs)
        self._count(cache.compiled - before)
        if out is not None:
            return out
        self.report.notes.append(f"own CUDA graphs off ({cache.why}): torch.compile's "
                                 f"reduce-overhead mode replays the model instead")
        self.__dict__["graphs"] = None
        self.__dict__["runner"] = self._compile("reduce-overhead")
        return None

    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Generate from a causal LM (HF's): ``input_ids`` (batch, tokens) and Hugging Face's
        keyword arguments for greedy or sampled decoding (``attention_mask`` with left padding,
        ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``repetition_penalty``, ``eos_token_id``, ``pad_token_id``, ... and ``generator``, a
        torch.Generator for the draws: :data:`sparsekit.accel.decoding.SUPPORTED`; anything
        else is an error). sparsekit's own loop: the prompt runs on the large-M (prefill)
        kernels, each new token on the small-M (decode) kernels, both compiled (CUDA graphs
        on CUDA) over a static KV cache kept by sparsekit. Prompts are left-padded to a
        bucket (the next power of two, at least 16), so prompt lengths in one bucket share
        one compiled graph (:mod:`sparsekit.accel.generate`). Returns the sequences, prompt
        included, as ``model.generate`` does; ``report.compiles`` counts the graphs built.

        >>> ids = fast.generate(input_ids, max_new_tokens=8)  # doctest: +SKIP
        """
        with switches.using(self.plan.switches()):  # decode attention, lagged stop
            gen = self.__dict__.get("generator")
            if gen is None:
                from sparsekit.accel.generate import Generator
                gen = Generator(self.model, self.device, compile=self.compiled,
                                backend=self.options.backend, count=self._count,
                                notes=self.report.notes, inductor=self.options.inductor,
                                seconds=self.report.seconds)
                self.__dict__["generator"] = gen
            return gen.generate(input_ids, **kwargs)

    def _count(self, new: int) -> None:
        """Add ``new`` compiled graphs to the report (a warning past ``max_compiles``)."""
        if new:
            self.report.compiles += new
            if self.report.compiles > self.max_compiles:
                log.warning("sk.accelerate: the model was compiled %d times (input shapes "
                            "vary); pass compile=CompileOptions(dynamic=True) or "
                            "fixed shapes", self.report.compiles)

    def _as_input(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.device)
        return t.to(torch.bfloat16) if t.is_floating_point() else t


__all__ = ["AcceleratedModel"]
