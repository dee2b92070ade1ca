"""cuSPARSELt algorithm search by timing under CUDA-graph replay, cached on disk.

cuSPARSELt's default algorithm (alg_id=0) is often slower than dense bf16 on the H200, and
``torch._cslt_sparse_mm_search`` times with the per-call host work inside. So every alg_id from
0 up (until the op raises) is timed under graph replay, and the fastest is kept. Results are
cached in a JSON file keyed by GPU name, torch and cuSPARSELt versions, variant, weight shape,
token count and dtype, so a second run does not search again. The cache lives in
``$SPARSEKIT_CACHE`` (default ``~/.cache/sparsekit``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from sparsekit.io.files import atomic_write
from sparsekit.accel.layers import VARIANTS
from sparsekit.io.cache import cache_root
from sparsekit.nn.timing import graph_time_us

MAX_ALG_ID = 64


def cache_path() -> Path:
    """The algorithm cache file (``$SPARSEKIT_CACHE/cusparselt_algs.json``)."""
    return cache_root() / "cusparselt_algs.json"


def cache_key(variant: str, out_features: int, in_features: int, tokens: int,
              device_name: str, torch_version: str, cusparselt_version: str | int | None) -> str:
    """One cache entry's key: everything the best algorithm can depend on."""
    return (f"{device_name}|torch={torch_version}|cusparselt={cusparselt_version}|{variant}|"
            f"N={out_features}|K={in_features}|M={tokens}")


def _runtime_key(variant: str, linear: nn.Linear, tokens: int) -> str:
    return cache_key(variant, linear.out_features, linear.in_features, tokens,
                     torch.cuda.get_device_name(), torch.__version__,
                     torch.backends.cusparselt.version())


def load_cache(path: Path | None = None) -> dict[str, dict]:
    path = path or cache_path()
    if not path.exists():
        return {}
    with open(path) as f:
        return json.load(f)


def store_cache(entries: dict[str, dict], path: Path | None = None) -> None:
    """Merge ``entries`` into the cache file (atomic write)."""
    path = path or cache_path()
    data = load_cache(path)
    data.update(entries)
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=1, sort_keys=True)))


def search(variant: str, linear: nn.Linear, tokens: int, *, use_cache: bool = True
           ) -> tuple[nn.Module, int, dict[int, float]]:
    """Build ``variant`` for ``linear`` with the fastest alg_id at ``tokens`` rows of input.

    Returns (module, alg_id, {alg_id: microseconds}); the timings are empty on a cache hit."""
    module = VARIANTS[variant](linear, alg_id=0)
    # the kernel route is part of the key: sparsekit's binding has its own best algorithms
    key = _runtime_key(variant if module.path == "cslt" else f"{variant}|{module.path}",
                       linear, tokens)
    if use_cache:
        hit = load_cache().get(key)
        if hit is not None:
            module.alg_id = int(hit["alg_id"])
            return module, module.alg_id, {}
    x = torch.randn(tokens, linear.in_features, device="cuda", dtype=torch.bfloat16)
    timings: dict[int, float] = {}
    best: tuple[float, int, nn.Module] | None = None
    for alg_id in range(MAX_ALG_ID):
        module.alg_id = alg_id
        try:
            module(x)
            torch.cuda.synchronize()
        except RuntimeError:
            break  # past the last algorithm for this shape and dtype
        t = graph_time_us(lambda: module(x), replays=7)
        timings[alg_id] = t
        if best is None or t < best[0]:
            best = (t, alg_id, module)
    if best is None:
        shape = tuple(linear.weight.shape)
        raise RuntimeError(f"cuSPARSELt ran no algorithm for {variant} {shape}")
    module.alg_id = best[1]
    if use_cache:
        store_cache({key: {"alg_id": best[1], "us": best[0]}})
    return module, best[1], timings
