"""The speed-aware planner's decision rule and the report of what ``accelerate`` did.

:func:`decide` is pure: given measured times per variant it picks the fastest variant that
beats bf16 dense by ``min_speedup``, else bf16 dense. ``accelerate`` feeds it timings measured
under CUDA-graph replay at the example input's shape; tests feed it recorded timings.

>>> decide({"bf16_dense": 100.0, "bf16_2:4": 70.0, "fp8_2:4": 40.0}, min_speedup=1.0)
('fp8_2:4', 2.5)
>>> decide({"bf16_dense": 100.0, "bf16_2:4": 99.0}, min_speedup=1.05)
('bf16_dense', 1.0)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from sparsekit.reporting import Report

BASELINE = "bf16_dense"


def decide(timings_us: dict[str, float], min_speedup: float = 1.0) -> tuple[str, float]:
    """(variant, speedup over bf16 dense) for one layer from its timings in microseconds."""
    if BASELINE not in timings_us:
        raise ValueError(f"timings must include the baseline {BASELINE!r}, got {list(timings_us)}")
    if min_speedup <= 0:
        raise ValueError(f"min_speedup must be > 0, got {min_speedup}")
    base = timings_us[BASELINE]
    best = min(timings_us, key=lambda v: (timings_us[v], v != BASELINE))
    speedup = base / timings_us[best]
    if best == BASELINE or speedup < min_speedup:
        return BASELINE, 1.0
    return best, speedup


@dataclass
class LayerDecision:
    """One layer: its GEMM shape (out_features N, in_features K, tokens M of the example
    input), whether its weight holds 2:4, the variant chosen, why, timings (us), its plan
    (which kernel runs which token counts) and the bytes of the weight copies it keeps."""

    name: str
    out_features: int
    in_features: int
    tokens: int
    has_2to4: bool
    variant: str
    reason: str
    timings_us: dict[str, float] = field(default_factory=dict)
    alg_ids: dict[str, int] = field(default_factory=dict)
    confirmed_speedup: float | None = None  # auto: winner re-timed against dense
    plan: str = ""  # e.g. "M 1-32: sk24; M 33+: cusparselt"
    weight_bytes: int = 0  # the weight copies the layer keeps (its plan's formats)

    @property
    def speedup(self) -> float | None:
        t = self.timings_us
        if BASELINE in t and self.variant in t:
            return t[BASELINE] / t[self.variant]
        return None


@dataclass
class AccelReport(Report):
    """What ``sk.accelerate`` did: per-layer decisions, skipped modules with reasons, the
    whole model's time before and after where measured (microseconds per call), planning and
    compile seconds, and how many graphs the compiler built (recompiles = compiles - 1)."""

    tag: ClassVar[str] = "accel"

    precision: str
    sparsity: str
    min_speedup: float
    device: str
    layers: list[LayerDecision] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    model_us: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # "plan" (all of it; of which "plan_layers": per-GEMM timing, "plan_model": whole-model
    # plans), "compile" (the first call), "generate_prefill" / "generate_decode" (generate()'s
    # calls that built a graph of that kind: compile, warm-up, capture)
    seconds: dict[str, float] = field(default_factory=dict)
    compiles: int = 0  # graphs torch.compile built for this model (1 + recompiles)
    plan: str = ""  # auto, whole-model planning: the plan kept ("dense", "per_layer", a variant)
    plans_ms: dict[str, float] = field(default_factory=dict)  # ... and each plan's ms per call

    @property
    def model_speedup(self) -> float | None:
        m = self.model_us
        if "dense" in m and "accelerated" in m:
            return m["dense"] / m["accelerated"]
        return None

    @property
    def bound(self) -> dict[str, float] | None:
        """Where the model's time goes and the most acceleration can give it (Amdahl): the timed
        linears' bf16 dense time (each layer timed alone), the rest of the dense model's time
        (attention, norms, untimed layers), the linears' time with the chosen variants, and
        ``max_speedup`` = dense / (rest + chosen). None before the model was timed."""
        timed = [d for d in self.layers if BASELINE in d.timings_us and d.variant in d.timings_us]
        if "dense" not in self.model_us or not timed:
            return None
        dense = sum(d.timings_us[BASELINE] for d in timed)
        chosen = sum(d.timings_us[d.variant] for d in timed)
        rest = max(self.model_us["dense"] - dense, 0.0)
        return {"linear_dense_us": dense, "linear_chosen_us": chosen, "rest_us": rest,
                "max_speedup": self.model_us["dense"] / (rest + chosen)}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for layer, obj in zip(d["layers"], self.layers):
            layer["speedup"] = obj.speedup
        d["model_speedup"] = self.model_speedup
        d["bound"] = self.bound
        return d

    def to_markdown(self) -> str:
        rows = ["| layer | N x K | M | 2:4 | variant | speedup | plan | weight MiB | reason |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for d in self.layers:
            s = "" if d.speedup is None else f"{d.speedup:.2f}x"
            mib = f"{d.weight_bytes / 2**20:.2f}" if d.weight_bytes else ""
            rows.append(f"| {d.name} | {d.out_features}x{d.in_features} | {d.tokens} | "
                        f"{'yes' if d.has_2to4 else 'no'} | {d.variant} | {s} | {d.plan} | "
                        f"{mib} | {d.reason} |")
        for name, why in self.skipped.items():
            rows.append(f"| {name} | | | | skipped | | | | {why} |")
        head = f"accelerate(precision={self.precision}, sparsity={self.sparsity}, " \
               f"min_speedup={self.min_speedup}) on {self.device}"
        if self.model_speedup is not None:
            head += (f": model {self.model_us['dense']:.1f} us dense -> "
                     f"{self.model_us['accelerated']:.1f} us ({self.model_speedup:.2f}x)")
        if self.plan:
            head += "\n\nwhole-model plans (ms): " + ", ".join(
                f"{p} {t:.3f}" for p, t in self.plans_ms.items()) + f"; kept: {self.plan}"
        b = self.bound
        if b is not None:
            head += (f"\n\nlinears {b['linear_dense_us']:.1f} us dense (timed alone) -> "
                     f"{b['linear_chosen_us']:.1f} us; the rest of the model "
                     f"{b['rest_us']:.1f} us; so at most {b['max_speedup']:.2f}x for the model")
        return "\n".join([head, "", *rows, *[f"\nnote: {n}" for n in self.notes]])

    def scalars(self) -> dict[str, float]:
        """``accel/speedup/<layer>`` (measured layers), ``accel/model_speedup`` and
        ``accel/model_us/<dense|accelerated>`` where the model was timed."""
        out = {f"accel/speedup/{d.name}": d.speedup for d in self.layers
               if d.speedup is not None and math.isfinite(d.speedup)}
        if self.model_speedup is not None:
            out["accel/model_speedup"] = self.model_speedup
            out.update({f"accel/model_us/{k}": v for k, v in self.model_us.items()})
        return out

    def __str__(self) -> str:
        return self.to_markdown()
