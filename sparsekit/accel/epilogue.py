"""An inductor pass moving GELU into the 8-bit 2:4 GEMM's epilogue.

A layer on sparsekit's own cuSPARSELt binding
(:func:`sparsekit.accel.kernels.cusparselt.op.sparse24_mm_alpha`)
can apply GELU inside the GEMM, but the layer does not know what follows it: in BERT's and
ViT's MLPs the GELU is the next module. :class:`FuseGelu` runs on the graph dynamo traced
(inductor's ``pre_grad_custom_pass``, before autograd decomposes GELU) and rewrites

    gelu(reshape(sparse24_mm_alpha(..., gelu=False)))
        ->  reshape(sparse24_mm_alpha(..., gelu=True))

when the GEMM's result has no other use and the GELU is the form cuSPARSELt computes
(:data:`sparsekit.accel.kernels.cusparselt.op.GELU_APPROXIMATE`). GELU is elementwise, so it
commutes with the
reshape.
"""

from __future__ import annotations

import functools
from typing import Any

import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsekit.accel.kernels.cusparselt import op as cslt_op
from sparsekit import _compat

_RESHAPES = ("reshape", "view")


def _is_gelu(node: torch.fx.Node) -> bool:
    """F.gelu / Tensor.gelu of the form cuSPARSELt computes."""
    if not ((node.op == "call_function" and node.target is F.gelu)
            or (node.op == "call_method" and node.target == "gelu")):
        return False
    form = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    return form == cslt_op.GELU_APPROXIMATE


def _is_reshape(node: torch.fx.Node) -> bool:
    return ((node.op == "call_method" and node.target in _RESHAPES)
            or (node.op == "call_function" and node.target is torch.reshape))


@functools.cache
def _fusegelu_class() -> type:
    """The class, made on first use: its base (inductor's ``CustomGraphPass``) imports
    dynamo, which ``import sparsekit`` should not."""
    class FuseGelu(_compat.custom_graph_pass()):
        """Inductor pre-grad pass: GELU after a ``sparse24_mm_alpha`` (directly or through one
        reshape/view) becomes the GEMM's ``gelu=True``. Counts the rewrites in ``fused``."""

        def __init__(self) -> None:
            self.fused = 0

        def __call__(self, graph: torch.fx.Graph) -> None:
            packet = torch.ops.sparsekit.sparse24_mm_alpha
            for node in list(graph.nodes):
                if node.op != "call_function" or node.target not in (packet, packet.default):
                    continue
                args = list(node.args)
                if len(args) != 7 or args[6] is not False or len(node.users) != 1:
                    continue
                (user,) = node.users
                shaped = user if _is_reshape(user) and user.args[0] is node else None
                if shaped is not None and len(shaped.users) != 1:
                    continue
                act = next(iter(shaped.users)) if shaped is not None else user
                if not _is_gelu(act) or act.args[0] is not (shaped or node):
                    continue
                args[6] = True
                node.args = tuple(args)
                act.replace_all_uses_with(shaped or node)
                graph.erase_node(act)
                self.fused += 1

        def uuid(self) -> str:  # inductor's graph cache key: this file's code and the GELU form
            return hashlib.sha256(Path(__file__).read_bytes()
                                  + cslt_op.GELU_APPROXIMATE.encode()).hexdigest()
    return FuseGelu


def __getattr__(name: str) -> Any:
    if name == "FuseGelu":
        return _fusegelu_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def uses_alpha_path(model: torch.nn.Module) -> bool:
    """Whether any layer of ``model`` runs
    :func:`~sparsekit.accel.kernels.cusparselt.op.sparse24_mm_alpha`."""
    return any(getattr(m, "path", "") == "cslt_alpha" for m in model.modules())


__all__ = ["FuseGelu", "uses_alpha_path"]  # noqa: F822 (FuseGelu: module __getattr__)
