"""Host time of dynamo's guard check per call: a dense and an accelerated (bf16 2:4, fp8 2:4)
HF BERT of BERT-large's structure (24 layers) at a small width, on the CPU reference ops.

Every call of a compiled model first runs its guards (in C++); under CUDA graphs that is most
of the host time before the replay. The accelerated layers guard more attributes than an
``nn.Linear`` (``alg_id``, ``in_features``, ``out_features``, scales), so this measures the
guard manager's ``check`` alone (median of ``--repeats``), with dynamo's default config and
with ``use_recursive_dict_tags_for_guards`` (which skips unchanged module subtrees).

    python tools/probe_guards.py --out probe_guards.json
    python tools/probe_guards.py --layers 2 --repeats 20 --out /tmp/g.json   # quick (CI)
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import sparsekit as sk  # noqa: E402


def build(layers: int):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=layers,
                                  num_attention_heads=4, vocab_size=128)
    cfg._attn_implementation = "sdpa"
    model = transformers.BertModel(cfg).eval()
    sk.prune_(model, pattern="2:4", criterion="magnitude")
    inputs = {"input_ids": torch.randint(0, 128, (2, 16)),
              "attention_mask": torch.ones(2, 16, dtype=torch.long)}
    return model, inputs


def guard_us(module, inputs: dict, repeats: int) -> float:
    """Median microseconds of one guard check of ``module``'s compiled forward (already run
    once), on the frame locals a call with ``inputs`` gives it."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    fn = type(module).forward
    code = fn.__code__
    entries = _debug_get_cache_entry_list(code)
    if len(entries) != 1:
        raise RuntimeError(f"expected one compiled entry for {type(module).__name__}.forward, "
                           f"found {len(entries)}")
    star = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS
    if code.co_argcount == 1 and code.co_flags & star == star:  # forward(self, *args, **kw)
        local = {"self": module, code.co_varnames[1]: (), code.co_varnames[2]: dict(inputs)}
    else:
        local = {"self": module, **inputs}
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):  # a decorator's wrapped fn
        local[name] = cell.cell_contents
    manager = entries[0].guard_manager
    with torch.no_grad():
        if not manager.check(local):
            raise RuntimeError("the guards reject the call's own locals: "
                               f"{manager.check_verbose(local).verbose_code_parts[:2]}")
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            manager.check(local)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(layers: int, repeats: int) -> dict[str, float]:
    master, inputs = build(layers)
    out = {}
    dense = copy.deepcopy(master).to(torch.bfloat16)
    with torch.no_grad():
        torch.compile(dense, backend="eager")(**inputs)
    out["dense"] = guard_us(dense, inputs, repeats)
    torch._dynamo.reset()
    for precision in ("bf16", "fp8"):
        model = copy.deepcopy(master)
        sk.accelerate(model, inputs, precision=precision, sparsity="2:4", device="cpu",
                      backend="eager", mode="default")
        out[f"{precision}_2:4"] = guard_us(model, inputs, repeats)
        torch._dynamo.reset()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="probe_guards.json")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args(argv)
    if args.layers < 1 or args.repeats < 1:
        raise SystemExit("--layers and --repeats: positive integers")
    res = {"torch": torch.__version__, "layers": args.layers, "repeats": args.repeats}
    res["default_us"] = measure(args.layers, args.repeats)
    config = torch._dynamo.config
    if hasattr(config, "use_recursive_dict_tags_for_guards"):
        res["recursive_dict_tags_default"] = config.use_recursive_dict_tags_for_guards
        with config.patch(use_recursive_dict_tags_for_guards=True):
            res["recursive_dict_tags_us"] = measure(args.layers, args.repeats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    for key in ("default_us", "recursive_dict_tags_us"):
        if key in res:
            print(key, {k: round(v, 1) for k, v in res[key].items()})
    return res


if __name__ == "__main__":
    main()
