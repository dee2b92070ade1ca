"""Decode: up to which token count each layer's small-M kernel serves, which of the small-M
kernels the registry offers it runs, with which configuration, and where bf16 dense beats both
of its 2:4 paths.

On CUDA each shape of a layer whose small-M limit is tuned (the bf16 and fp8 2:4 layers) is
timed at M = 1, 4, 16, 32 (``DECODE_BUCKETS``) on its small-M kernel, its large-M kernel and
bf16 dense (:func:`time_decode`, CUDA graphs, the weights read from memory as in a decode
step): the small-M kernel serves up to the last M where it beats the large-M one. A layer
offered several small-M kernels (``choices["small"]``: an fp8 layer that both the Triton and
the mma.sp kernels take) is timed on each and keeps the cheaper (:func:`time_decode_choices`).
Under ``sparsity="auto"`` (and ``PlanOptions(decode_dense=True)``) the layer also runs its
dense alternative (a bf16 copy of its effective weight, 2 bytes per weight) for the M where
dense beats the 2:4 path it would run (:func:`dense_range`), so "auto" never runs a decode
batch slower than dense; ``sparsity="2:4"`` keeps the 2:4 paths at every M (the report's
notes name the batches where they lose). A kernel with configurations has them chosen per
bucket of its own (:func:`choose_config`). The result is the layer's plan
(:func:`route_decode`), which keeps only the weight copies its routes read; the entries are
cached with the per-layer timings (:class:`Decode`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sparsekit.accel import kernels
from sparsekit.accel.kernels import UNBOUNDED
from sparsekit.accel.linear import AccelLinear, LayerPlan, Route
from sparsekit.accel.planner.cache import plan_key

DECODE_BUCKETS = (1, 4, 16, 32)  # token counts at which the small-M kernel is timed
# how decode plans time their layers; a cached plan timed otherwise is timed again
DECODE_TIMING = "weights-from-memory"


def small_kernel(mod: AccelLinear) -> str | None:
    """The small-M kernel ``mod``'s plan runs (None: none)."""
    return next((r.kernel for r in mod.plan.routes if kernels.get(r.kernel).small_m), None)


def routes(mod: AccelLinear, small: str | None, limit: int, config=None,
           dense_m: tuple[int, int] = (0, 0)) -> LayerPlan:
    """The plan of ``mod`` with its dense alternative for ``dense_m`` (lo, hi; (0, 0) none),
    ``small`` for M up to ``limit`` (0: none) with ``config``, its plan's large-M kernel
    beyond."""
    out = []
    if dense_m[1] >= 1:
        out.append(Route(dense_m[0], dense_m[1], mod.choices["large"][0]))
    if small is not None and limit:
        out.append(Route(1, limit, small, config))
    out.append(Route(1, UNBOUNDED, mod.plan.routes[-1].kernel))
    return LayerPlan(tuple(out))


def dense_range(us: dict[str, list[float]], decode_max_m: int) -> tuple[int, int]:
    """(lo, hi): the token counts M (lo <= M <= hi) a layer runs bf16 dense, from
    :func:`time_decode`'s timings ``us`` ({M: [small-M, large-M, bf16 dense]}, M in
    ``DECODE_BUCKETS``): from above the bucket before the first one where dense beats the path
    the layer runs there otherwise (the small-M kernel up to ``decode_max_m``, the large-M path
    above) up to the last such bucket; buckets between them run dense too (never slower than
    dense). (0, 0): none. A bucket's time stands for the counts above the bucket before it, as
    with ``decode_max_m``. Pure."""
    wins = [m for m in DECODE_BUCKETS if str(m) in us and len(us[str(m)]) > 2
            and us[str(m)][2] < us[str(m)][0 if m <= decode_max_m else 1]]
    if not wins:
        return 0, 0
    first = DECODE_BUCKETS.index(wins[0])
    return (DECODE_BUCKETS[first - 1] + 1 if first else 1), wins[-1]


def valid_config(mod: AccelLinear, kernel: str, config) -> tuple | None:
    """A plan's "config" (one configuration per bucket of ``kernel``'s ``buckets``) as a
    route's when every one is among the kernel's configurations for ``mod`` (whose plan reads
    ``kernel``'s format), else None (a plan from another version of the library: the
    kernel's defaults run)."""
    k = kernels.get(kernel)
    if not isinstance(config, (list, tuple)) or not k.buckets or len(config) != len(k.buckets):
        return None
    cands = set(k.configs(mod, mod.weights(kernel)))
    got = tuple(tuple(c) if isinstance(c, (list, tuple)) else None for c in config)
    return got if all(c in cands for c in got) else None


def route_decode(mod: AccelLinear, entry: dict, dense: bool) -> None:
    """Put 2:4 layer ``mod`` on the plan a decode plan ``entry`` (:func:`time_decode`'s, maybe
    read from the cache) says: its small-M kernel (``entry["kernel"]`` where it is one of the
    layer's choices) up to ``decode_max_m``, and (``dense``) its dense alternative for
    ``dense_m``; the small-M copy of the weight goes where no token count is left to it."""
    small = entry.get("kernel")
    if small not in mod.choices["small"]:
        small = mod.choices["small"][-1]
    limit = int(entry["decode_max_m"])
    mod.use(routes(mod, small, max(limit, 1)), keep=True)  # its format, to check the config
    config = valid_config(mod, small, entry["config"]) if entry.get("config") else None
    lo, hi = entry.get("dense_m", (0, 0)) if dense else (0, 0)
    if hi >= 1 and lo <= 1 and limit <= hi:
        limit = 0  # every count of the small-M kernel runs dense
    mod.use(routes(mod, small, limit, config, (int(lo), int(hi))))


def time_decode(mod: AccelLinear, device: torch.device, dense: bool = False,
                kernel: str | None = None) -> dict:
    """{"kernel": the small-M kernel timed (``kernel``, default the one ``mod`` runs),
    "decode_max_m": the last of DECODE_BUCKETS up to which it beats ``mod``'s large-M kernel,
    "us": {M: [small-M us, large-M us, bf16 dense us]}[, "config"]} (timed in CUDA graphs
    with the weights read from memory, not the L2, as in a decode step:
    :func:`~sparsekit.nn.timing.cold_time_us`; dense: ``F.linear`` on a bf16 weight of the
    layer's shape, the baseline a decode step is compared with). Timing stops at the first M
    where the small-M kernel loses, unless ``dense``: then every bucket is timed and the entry
    has "dense_m" too (:func:`dense_range`, a list [lo, hi]). ``mod`` is left on that
    kernel up to the limit, its configuration chosen (:func:`choose_config`)."""
    from sparsekit.nn import timing  # looked up per call: tests replace cold_time_us

    kernel = kernel or small_kernel(mod)
    # the layer holds this kernel's copy and its large-M one, no other small-M copy (timed as
    # it will run: the bytes its timing rotates through the L2 are the layer's)
    mod.use(routes(mod, kernel, DECODE_BUCKETS[-1]))
    config = choose_config(mod, device, kernel)
    dense_w = torch.randn(mod.out_features, mod.in_features, device=device,
                          dtype=torch.bfloat16)
    limit, us, losing = 0, {}, False
    for m in DECODE_BUCKETS:
        x = torch.randn(m, mod.in_features, device=device, dtype=torch.bfloat16)
        times = []
        for max_m in (m, 0):
            mod.use(routes(mod, kernel, max_m, config), keep=True)
            times.append(timing.cold_time_us(functools.partial(mod, x)))
        times.append(timing.cold_time_us(functools.partial(F.linear, x, dense_w)))
        us[str(m)] = times
        losing = losing or times[0] >= times[1]
        if losing and not dense:
            break
        if not losing:
            limit = m
    mod.use(routes(mod, kernel, max(limit, 1), config), keep=True)
    entry = {"kernel": kernel, "decode_max_m": limit, "us": us}
    if config is not None:
        entry["config"] = [list(c) for c in config]
    if dense:
        entry["dense_m"] = list(dense_range(us, limit))
    return entry


def decode_cost_us(entry: dict, buckets) -> float:
    """What a layer planned by ``entry`` (:func:`time_decode`'s) takes over ``buckets`` (token
    counts it timed): at each, the small-M kernel's time up to its ``decode_max_m``, the
    large-M path's above. Pure."""
    limit = int(entry["decode_max_m"])
    return sum(entry["us"][str(m)][0 if m <= limit else 1] for m in buckets)


def time_decode_choices(mod: AccelLinear, device: torch.device, dense: bool = False) -> dict:
    """:func:`time_decode` of ``mod`` on each small-M kernel it may run (``choices["small"]``,
    the one it prefers first), keeping the one whose path costs less over the token counts
    all timed (:func:`decode_cost_us`; a tie keeps the preferred one). With more than one,
    the entry has every kernel's timings ("kernels_us"); ``mod`` is left on the chosen one."""
    names = list(reversed(mod.choices["small"]))
    entries = {k: time_decode(mod, device, dense=dense, kernel=k) for k in names}
    if len(entries) == 1:
        return entries[names[0]]
    common = [m for m in DECODE_BUCKETS if all(str(m) in e["us"] for e in entries.values())]
    kernel = min(names, key=lambda k: decode_cost_us(entries[k], common))
    e = entries[kernel]
    mod.use(routes(mod, kernel, max(int(e["decode_max_m"]), 1),
                   valid_config(mod, kernel, e.get("config"))), keep=True)
    return {**e, "kernels_us": {k: v["us"] for k, v in entries.items()}}


def choose_config(mod: AccelLinear, device: torch.device, kernel: str
                  ) -> tuple[tuple[int, ...], ...] | None:
    """Per bucket of ``kernel``'s ``buckets`` (mma.sp: M = 1, 2..8, 9..16, 17..32), the
    configuration with the least time at the bucket's largest M for ``mod``'s shape (CUDA
    graphs, the weight read from memory: :func:`~sparsekit.nn.timing.cold_time_us`); None
    when there is one candidate or none. ``mod``'s plan is left as it was."""
    from sparsekit.nn import timing  # looked up per call: tests replace cold_time_us

    k = kernels.get(kernel)
    cands = k.configs(mod, mod.weights(kernel)) if k.buckets else []
    if len(cands) < 2:
        return None
    before, chosen = mod.plan, []
    for m in k.buckets:
        x = torch.randn(m, mod.in_features, device=device, dtype=torch.bfloat16)
        best = None
        for cfg in cands:
            mod.use(routes(mod, kernel, max(k.buckets), (cfg,) * len(k.buckets)), keep=True)
            t = timing.cold_time_us(functools.partial(mod, x))
            if best is None or t < best[1]:
                best = (cfg, t)
        chosen.append(best[0])
    mod.use(before, keep=True)
    return tuple(chosen)


def plan_config(mod: AccelLinear, device: torch.device) -> dict:
    """The decode plan entry of a layer whose small-M limit is fixed (int4): {"config": its
    small-M kernel's configuration per bucket (:func:`choose_config`), or None}."""
    config = choose_config(mod, device, small_kernel(mod))
    return {"config": None if config is None else [list(c) for c in config]}


def decode_note(mod: AccelLinear, entry: dict) -> str:
    """The report's line for one decode plan: the kernel, the limit, the timings per M and the
    token counts where neither 2:4 path beats bf16 dense (a decode step there is slower)."""
    times = entry["us"]
    slower = [m for m, t in times.items() if len(t) > 2 and min(t[:2]) > t[2]]
    kernel = entry.get("kernel") or small_kernel(mod)
    cfg = entry.get("config")
    text = f" ({kernel}" + (f" {kernels.get(kernel).config_text(cfg)}" if cfg else "") + ")"
    both = entry.get("kernels_us") or {}
    chose = ""
    if len(both) > 1 and kernel in both:
        other = next(k for k in both if k != kernel)
        chose = (f"; {kernel} chosen over {other} (small-M us: "
                 + ", ".join(f"M={m} {t[0]:.1f} vs {both[other][m][0]:.1f}"
                             for m, t in both[kernel].items() if m in both[other])
                 + ")")
    return (f"decode: {mod.variant} {mod.out_features}x{mod.in_features} on the small-M "
            f"kernel{text} for M <= {entry['decode_max_m']} (us small-M/large-M/bf16 dense: "
            + ", ".join(f"M={m} " + "/".join(f"{u:.1f}" for u in t) for m, t in times.items())
            + ")" + (f"; slower than bf16 dense at M = {', '.join(slower)}" if slower else "")
            + chose)


class Decode:
    """The :class:`~sparsekit.accel.planner.Planner`'s decode planning (after the variants
    are installed; on CUDA)."""

    def plan_decode(self, model: nn.Module) -> None:
        """Plan each accelerated layer's small-M routes (module docstring): timed per shape
        and numerics once, cached (an entry without ``dense_m`` is timed again when a dense
        route is wanted). On CPU the reference paths keep the plans the layers started
        with (numerics, not speed)."""
        if self.device.type != "cuda":
            return
        dense = self.sparsity == "auto" and self.options.decode_dense
        mods = [m for m in model.modules() if isinstance(m, AccelLinear)]
        self._refused_notes(mods)
        chosen: dict[str, dict] = {}
        copies: dict[str, list] = {}  # key -> [a module of the shape, layers with a copy]
        for mod in mods:
            if not mod.tune_limit or small_kernel(mod) is None:
                continue
            w = mod.weights(small_kernel(mod)).items()
            numerics = (f"{mod.variant}|decode|{'/'.join(mod.choices['small'])}"
                        f"{'|' + w['layout'] if 'layout' in w else ''}|{mod.path}|"
                        f"{'dynamic' if getattr(mod, 'act_scale', None) is None else 'static'}")
            key, entry, new = self._decode_entry(
                mod, numerics, chosen,
                functools.partial(time_decode_choices, mod, self.device, dense=dense),
                fresh=lambda e: not dense or "dense_m" in e)
            if new:
                self.report.notes.append(decode_note(mod, entry))
            route_decode(mod, entry, dense)
            if mod.plan.routes[0].kernel == mod.choices["large"][0] and len(
                    mod.choices["large"]) > 1:
                copies.setdefault(key, [mod, 0])[1] += 1
        self._plan_configs(mods, chosen)
        for mod, count in copies.values():
            r = mod.plan.routes[0]
            extra = 2 * mod.out_features * mod.in_features * count
            self.report.notes.append(
                f"decode: {mod.variant} {mod.out_features}x{mod.in_features} runs bf16 dense "
                f"for M = {r.lo}..{r.hi} (faster there than its 2:4 paths): a bf16 copy of the "
                f"weight in {count} layer(s), {extra / 2**20:.1f} MiB extra")

    def _refused_notes(self, mods: list[AccelLinear]) -> None:
        """One note per small-M kernel that comes before the one some layers run but cannot
        run them here (the mma.sp library not built, a group it does not take), naming the
        layers' shapes, what runs instead and why."""
        seen: dict[tuple[str, str, str], set[str]] = {}
        for mod in mods:
            runs = small_kernel(mod)
            for kernel, why in mod.refused.items():
                if runs is None or kernels.get(kernel).order < kernels.get(runs).order:
                    key = (kernel, why, runs or "large-M")
                    seen.setdefault(key, set()).add(mod.shape_text())
        for (kernel, why, runs), shapes in seen.items():
            self.report.notes.append(f"decode: {', '.join(sorted(shapes))} run the {runs} "
                                     f"kernel: the {kernel} kernel is not used ({why})")

    def _decode_entry(self, mod: AccelLinear, numerics: str, chosen: dict[str, dict],
                      plan: Callable[[], dict], fresh: Callable[[dict], bool]
                      ) -> tuple[str, dict, bool]:
        """(key, entry, whether this call made it) of the decode plan of ``mod``'s shape with
        ``numerics``: the one ``chosen`` earlier in this call, else the cached one where
        ``fresh(entry)`` and it was timed as :data:`DECODE_TIMING` says, else ``plan()``
        (then cached)."""
        key = plan_key(self.name, torch.__version__, numerics, mod.out_features,
                       mod.in_features, 0, inductor=self.inductor)
        if key in chosen:
            return key, chosen[key], False
        hit = self.cache.get(key)
        if hit is None or hit.get("timing") != DECODE_TIMING or not fresh(hit):
            hit = {**plan(), "timing": DECODE_TIMING}
        chosen[key] = self.cache[key] = self.new[key] = hit
        return key, hit, True

    def _plan_configs(self, mods: list[AccelLinear], chosen: dict[str, dict]) -> None:
        """The configurations per token bucket of the small-M kernel of each layer whose limit
        is fixed (int4; :func:`plan_config`, cached like the other decode plans), set on its
        plan."""
        for mod in mods:
            kernel = small_kernel(mod)
            if mod.tune_limit or kernel is None or not kernels.get(kernel).buckets:
                continue
            _, entry, new = self._decode_entry(
                mod, f"{mod.variant}|decode|{kernel}|g{getattr(mod, 'group_size', 0)}", chosen,
                functools.partial(plan_config, mod, self.device),
                fresh=lambda e: "config" in e)
            config = valid_config(mod, kernel, entry["config"]) if entry["config"] else None
            if new and config:
                self.report.notes.append(
                    f"decode: {mod.variant} {mod.out_features}x{mod.in_features} on the "
                    f"{kernel} kernel ({kernels.get(kernel).config_text(config)})")
            mod.use(LayerPlan(tuple(Route(r.lo, r.hi, r.kernel, config if r.kernel == kernel
                                          else r.config) for r in mod.plan.routes)))


__all__ = ["DECODE_BUCKETS", "DECODE_TIMING", "Decode", "choose_config", "decode_cost_us",
           "decode_note", "dense_range", "plan_config", "route_decode", "routes",
           "small_kernel", "time_decode", "time_decode_choices", "valid_config"]
