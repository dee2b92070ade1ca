"""Host overhead of an accelerated HF BERT-large call (8x512, all-ones attention_mask), and
what two ways around it would save.

Under CUDA graphs a ~6 ms BERT-large call still spends host time outside the graph: dynamo's
guard check, the CUDA-graph-tree bookkeeping and sparsekit's ``AcceleratedModel`` wrapper.
Six ways of running one forward, each on a fresh copy of one 2:4-masked bf16 model:

- ``dense_ro``: plain ``nn.Linear`` layers, ``torch.compile`` mode "reduce-overhead": the
  reference every other way is compared with;
- ``dense_ro_skipguards``: the same compiled model, each call inside
  ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` (after warm-up calls without it);
- ``dense_owngraph``: compiled with mode "default" (no CUDA-graph trees) and captured into a
  ``torch.cuda.CUDAGraph``; a call copies its inputs into the static ones and replays;
- ``sk_bf16_24``: ``sk.accelerate`` bf16 2:4 with sibling fusion (mode "reduce-overhead");
- ``sk_bf16_24_skipguards``: that model under the stance, as for the dense one;
- ``sk_bf16_24_owngraph``: ``sk.accelerate`` with mode "default", its compiled module
  (``.runner``, the wrapper bypassed) captured as for the dense one.

Per way, in the JSON (rewritten after every way) and one printed line:

- ``ms``: median of synchronized calls between CUDA events;
- ``host_us``: median of 50 calls timed with ``time.perf_counter`` from just before the call
  to its return, the GPU idle at the start: the host's time until the work is launched;
- ``max_diff``: max abs difference of its ``last_hidden_state`` from ``dense_ro``'s;
- the ways changing another (their ``base``: ``dense_ro`` or ``sk_bf16_24``):
  ``max_diff_base`` from the base's output and ``host_us_saved``, the base's ``host_us``
  less their own;
- every way but the reference: ``paired_ms``, ``paired_ref_ms`` and ``paired_ratio``, timed in
  ABBA blocks alternating with ``dense_ro`` (:func:`sparsekit.accel.planner.time_paired`).

    python tools/probe_host.py --out $OUT/probe_host.json      # H200
    python tools/probe_host.py --smoke --out /tmp/host.json    # tiny BERT on CPU (CI)

``--smoke`` runs the four ways without CUDA graphs on CPU (backend "aot_eager", mode
"default" for the "_ro" ways); the two CUDA-graph ways are recorded as skipped.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import sys
import traceback
from pathlib import Path

import torch

import sparsekit as sk
from sparsekit._compat import compile_module, reset_compiled
from sparsekit.accel import graphs, planner
from sparsekit.nn import timing

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_models  # noqa: E402  (tools/bench_models.py, beside this script)

# (ways, whether they need CUDA graphs): one model per group, the ways of a group share it
GROUPS = ((("dense_ro", "dense_ro_skipguards"), False), (("dense_owngraph",), True),
          (("sk_bf16_24", "sk_bf16_24_skipguards"), False), (("sk_bf16_24_owngraph",), True))
WAYS = [w for ways, _ in GROUPS for w in ways]
REF = "dense_ro"
HOST_CALLS = 50


def skip_guards(fn):
    """``fn`` called inside ``set_stance(skip_guard_eval_unsafe=True)``: dynamo runs only the
    guards that tell its cache entries apart (none with one entry)."""
    def go():
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return fn()
    return go


def own_graph(module, inputs: dict):
    """A call of ``module(**inputs)`` on sparsekit's own CUDA graph (the capture ``accelerate``
    uses, :class:`sparsekit.accel.graphs.GraphCache`: warm-up on a side stream, where the
    module compiles, then one graph); each call copies ``inputs`` in and replays."""
    cache = graphs.GraphCache(module, warmup=3)

    def replay():
        with torch.no_grad():
            out = cache.run((), inputs)
        if out is None:
            raise RuntimeError(f"not captured: {cache.why}")
        return out
    replay()  # captured here, not in the first timed call
    replay.module = module  # the graph reads its weights: they must outlive it
    return replay


def build_group(first: str, master, inputs: dict, device: torch.device, backend: str):
    """The callable (one forward under no_grad) of the model behind ``first``, its group's
    first way, built from a fresh copy of ``master``."""
    model = copy.deepcopy(master)
    graphs = first.endswith("owngraph")
    mode = "reduce-overhead" if device.type == "cuda" and not graphs else "default"
    if first.startswith("dense"):
        module, args = compile_module(model, mode=mode, backend=backend), inputs
    else:
        fast = sk.accelerate(
            model, inputs, precision="bf16", sparsity="2:4", device=device,
            compile=sk.CompileOptions(mode=mode, backend=backend, clone_outputs=False),
            plan=sk.PlanOptions(siblings=True))
        if not graphs:
            return lambda: bench_models.call(fast, inputs)  # through the wrapper
        module, args = fast.runner, {k: fast._as_input(v) for k, v in inputs.items()}
    if not graphs:
        def go():
            with torch.no_grad():
                return module(**args)
        return go
    return own_graph(module, args)


def host_us(fn, device: torch.device) -> float:
    """Median microseconds from just before ``fn()`` to its return over ``HOST_CALLS`` calls,
    the GPU finished (synchronized) before each, outside the span."""
    def idle() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.compiler.cudagraph_mark_step_begin()
    # timing.time_ms's perf_counter clock (device "cpu"), whichever device fn runs on
    return timing.time_ms(fn, "cpu", warmup=3, repeats=HOST_CALLS, before=idle) * 1e3


def failure(e: Exception) -> dict:
    """The row of a way that raised ``e``: the error's first line, the traceback's end."""
    first = str(e).splitlines()[0][:300] if str(e) else ""
    return {"error": f"{type(e).__name__}: {first}", "trace": traceback.format_exc()[-1500:]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="probe_host.json")
    ap.add_argument("--smoke", action="store_true", help="tiny BERT on CPU, no CUDA graphs")
    ap.add_argument("--ways", default=",".join(WAYS),
                    help=f"comma list of ways ({REF} always runs)")
    args = ap.parse_args(argv)
    chosen = {REF, *(w for w in args.ways.split(",") if w)}
    if chosen - set(WAYS):
        raise SystemExit(f"--ways: unknown {sorted(chosen - set(WAYS))}; known: {WAYS}")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("probe_host.py needs CUDA (or --smoke: a tiny BERT on CPU)")
    device = torch.device("cpu" if args.smoke else "cuda")
    backend = "aot_eager" if args.smoke else "inductor"
    calls = 3 if args.smoke else 20
    if args.smoke:
        torch.set_num_threads(1)
    master, inputs, _, label = bench_models.build("bert", args.smoke, device, llama_layers=0)
    bench_models.magnitude_24_(master.eval())
    master.to(torch.bfloat16)
    res = {"command": " ".join(["python tools/probe_host.py", *(argv or sys.argv[1:])]),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "model": label, "backend": backend, "calls": calls,
           "host_calls": HOST_CALLS, "ways": {}}
    rows = res["ways"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    outs: dict[str, torch.Tensor] = {}  # last_hidden_state of each way (float)
    ref_fn = None
    for group, needs_graphs in GROUPS:
        ways = [w for w in group if w in chosen]
        if not ways:
            continue
        fn = None
        if needs_graphs and device.type != "cuda":
            rows.update({w: {"skipped": "needs CUDA"} for w in ways})
        else:
            try:
                fn = build_group(group[0], master, inputs, device, backend)
            except Exception as e:  # a failing way is recorded, the run goes on
                rows.update({w: failure(e) for w in ways})
        # a group's other way is its first under the stance
        fns = {} if fn is None else {w: fn if w == group[0] else skip_guards(fn) for w in ways}
        ref_fn = fn if ref_fn is None else ref_fn
        # the group is timed before its pairing adds the reference's cache entries (dropped by
        # the last reset) to the same code object, BertModel.forward
        for w in fns:
            try:
                with torch.no_grad():
                    outs[w] = bench_models.main_output(fns[w]()).float()
                ms = bench_models.time_ms(fns[w], device, calls)
                rows[w] = {"ms": ms, "host_us": host_us(fns[w], device),
                           "max_diff": (outs[w] - outs[REF]).abs().max().item(),
                           "ratio": rows[REF]["ms"] / ms if w != REF else 1.0}
                base = REF if w.startswith("dense") else "sk_bf16_24"
                if w != base and "host_us" in rows.get(base, {}):
                    rows[w]["base"] = base
                    rows[w]["max_diff_base"] = (outs[w] - outs[base]).abs().max().item()
                    rows[w]["host_us_saved"] = rows[base]["host_us"] - rows[w]["host_us"]
            except Exception as e:
                rows[w] = failure(e)
            out.write_text(json.dumps(res, indent=1))
        for w in [w for w in fns if w != REF and "ms" in rows[w]]:
            try:
                for _ in range(3):  # recompiled after a reset: compile, record its CUDA graph
                    ref_fn()
                ref_ms, ms = planner.time_paired(ref_fn, fns[w], device)
                rows[w].update(paired_ref_ms=ref_ms, paired_ms=ms, paired_ratio=ref_ms / ms)
            except Exception as e:
                rows[w].update(failure(e))
        fn = fns = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        reset_compiled()
        out.write_text(json.dumps(res, indent=1))
        for w in ways:
            print(f"{w}: " + json.dumps({k: v for k, v in rows[w].items() if k != "trace"}),
                  flush=True)
        if "ms" not in rows[REF]:
            raise SystemExit(f"{REF}, the reference of every other way, failed: "
                             f"{rows[REF]['error']}")
    out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
