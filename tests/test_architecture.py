"""The package's shape: imports point down the layers (run > accel > quant > prune > nn >
io/models/data > core), with no cycles, lazy imports inside functions included."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("architecture", ROOT / "tools" / "architecture.py")
arch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arch)


@pytest.fixture(scope="module")
def graph():
    return arch.import_graph(ROOT)


def test_the_graph_sees_lazy_and_package_imports(graph):
    # a function-level import counts, and importing a submodule runs its package's __init__
    assert "sparsekit.data.hf_text" in graph["sparsekit.run.loading"]  # only inside a function
    assert "sparsekit.run.pipeline" in graph["sparsekit.run.cli"]  # the same
    assert {"sparsekit.quant", "sparsekit.quant.modules"} <= graph["sparsekit.accel.api"]
    assert "sparsekit.prune" not in graph["sparsekit.prune.pruner"]  # its own package: no edge


def test_cycle_finder_finds_a_cycle_through_a_lazy_import(tmp_path):
    pkg = tmp_path / "sparsekit"
    (pkg / "io").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "io" / "__init__.py").write_text("")
    (pkg / "io" / "a.py").write_text("from sparsekit.io.b import x\n")
    (pkg / "io" / "b.py").write_text("def x():\n    from sparsekit.io import a\n")
    (pkg / "accel.py").write_text("")
    (pkg / "io" / "c.py").write_text("def f():\n    import sparsekit.accel\n")
    g = arch.import_graph(tmp_path)
    assert arch.cycles(g) == [["sparsekit.io.a", "sparsekit.io.b"]]
    assert arch.upward_imports(g) == [("sparsekit.io.c", "sparsekit.accel")]


def test_no_import_cycles(graph):
    assert arch.cycles(graph) == []


def test_imports_point_down_the_layers(graph):
    assert arch.upward_imports(graph) == []


def test_quant_and_accel_import_prune_only_for_pruning(graph):
    # the helpers all three use live in nn/; what quant and accel still take from prune is
    # pruning itself: masks (QAT keeps them), the sparsity report, the N:M pattern parser,
    # SparseGPT's sweep (joint 2:4 + GPTQ prunes as it quantizes)
    edges = {(a, b) for a, deps in graph.items() for b in deps
             if a.startswith(("sparsekit.quant", "sparsekit.accel"))
             and b.startswith("sparsekit.prune.")}
    assert edges <= {("sparsekit.quant.qat", "sparsekit.prune.masks"),
                     ("sparsekit.quant.layers", "sparsekit.prune.report"),
                     ("sparsekit.accel.api", "sparsekit.prune.patterns"),
                     ("sparsekit.quant.gptq", "sparsekit.prune.patterns"),
                     ("sparsekit.quant.gptq", "sparsekit.prune.sparsegpt")}
    assert arch.layer("sparsekit.nn.shards") < arch.layer("sparsekit.prune.pruner")
    assert arch.layer("sparsekit.nn.timing") < arch.layer("sparsekit.quant.quantize")


def test_only_the_core_helpers_sit_outside_the_layer_folders(graph):
    core = {name for name in graph if arch.layer(name) == arch.CORE}
    assert {"sparsekit.errors", "sparsekit.progress"} <= core
    # the registry class is the one extension mechanism prune/, quant/ and accel/ share
    # and the shared helpers: number checks, import by name, the report protocol, the config's
    # fixed name sets (torch-free: the command line is checked before torch is imported)
    assert core <= {"sparsekit.errors", "sparsekit.progress", "sparsekit._compat",
                    "sparsekit.registry", "sparsekit.checks", "sparsekit.imports",
                    "sparsekit.reporting", "sparsekit.names"}


# Functions longer than 60 lines (decorators and docstring included) as they stand: each may
# shrink, none may grow, and no other function may pass 60. Drop an entry once it is split.
LONG_FUNCTIONS = {
}


def test_no_function_grows_past_60_lines():
    found = dict(arch.long_functions(ROOT, limit=60))
    grown = {name: n for name, n in found.items() if n > LONG_FUNCTIONS.get(name, 60)}
    assert not grown, f"functions over their limit (60 lines, or LONG_FUNCTIONS): {grown}"


def test_import_sparsekit_loads_no_heavy_optional_modules():
    code = ("import sys, sparsekit; heavy = ('torch_pruning', 'hydra', 'safetensors', 'triton', "
            "'transformers', 'tensorboard', 'omegaconf'); "
            "print(sorted(m for m in heavy if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert done.stdout.strip() == "[]"


def test_lazy_names_resolve_to_the_public_objects():
    import sparsekit as sk
    from sparsekit.prune.pruner import Pruner

    assert sk.Pruner is Pruner
    assert set(sk.__all__) <= set(dir(sk))
    with pytest.raises(AttributeError, match="no attribute 'Prunerr'"):
        sk.Prunerr  # noqa: B018
