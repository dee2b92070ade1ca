"""Build hook: ship the top-level conf/ and recipes/ inside the wheel as sparsekit/_data/, and
build the mma.sp CUDA kernel into sparsekit/accel/_lib/ where the machine has an sm_90 GPU and
the CUDA toolkit (elsewhere nothing is compiled and one line says so; the same build later:
``python -m sparsekit.accel.build``)."""

import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _kernel_builder():
    """sparsekit/accel/build/ loaded by path (standard library only: pip's build environment
    has neither torch nor sparsekit)."""
    spec = importlib.util.spec_from_file_location(
        "_sparsekit_build", ROOT / "sparsekit" / "accel" / "build" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithData(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "sparsekit" / "_data"
        for name in ("conf", "recipes"):
            src = ROOT / name
            if src.is_dir():
                shutil.copytree(src, target / name, dirs_exist_ok=True)
        # an editable install imports the package from the checkout: build the library there
        editable = getattr(self, "editable_mode", False)
        lib_dir = (ROOT if editable else Path(self.build_lib)) / "sparsekit" / "accel" / "_lib"
        print(_kernel_builder().install_hook(lib_dir), flush=True)


setup(cmdclass={"build_py": BuildPyWithData})
