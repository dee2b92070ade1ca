"""Build hook: ship the top-level conf/ and recipes/ inside the wheel as sparsekit/_data/."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithData(build_py):
    def run(self) -> None:
        super().run()
        root = Path(__file__).resolve().parent
        target = Path(self.build_lib) / "sparsekit" / "_data"
        for name in ("conf", "recipes"):
            src = root / name
            if src.is_dir():
                shutil.copytree(src, target / name, dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildPyWithData})
