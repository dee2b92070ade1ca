"""Build sparsekit's CUDA libraries ahead of time: ``python -m sparsekit.accel.build``.

Two libraries, built here and never by the library at run time:
- the mma.sp 2:4 kernel (``kernels/mma_sp/csrc/sk24_mma.cu``,
  :mod:`sparsekit.accel.kernels.mma_sp.launch`): a plain shared library compiled by nvcc for
  sm_90, no torch needed;
- sparsekit's cuSPARSELt binding (``kernels/cusparselt/csrc/cslt_epilogue.cpp``,
  :mod:`sparsekit.accel.kernels.cusparselt.ext`): a torch C++ extension against the installed
  torch and its cuSPARSELt wheel (rebuilt when torch changes).

``pip install`` builds them on a machine with an sm_90 GPU and the CUDA toolkit (``setup.py``
calls :func:`install_hook`; the binding only where pip's build environment has torch, e.g.
``--no-build-isolation``), this command at any time after installing (or in a checkout). The
binaries go into the package itself (``sparsekit/accel/_lib/``), beside ``manifest.json``, which
records per library its file, sha256, size, the sha256 of the sources it was built from, its
version (and the torch it was built against); :mod:`sparsekit.accel.libload` opens only a file
that matches it.

Without the library the layers run the Triton 2:4 kernels: 1.4-3.2x slower per decode GEMM
shape (README, Quickstart). ``--check`` reports what is built without building.

This module uses the standard library only: ``setup.py`` loads it by path in pip's build
environment, where neither torch nor sparsekit is importable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # sparsekit/accel
LIB_DIR = HERE / "_lib"
MANIFEST = "manifest.json"
COMMAND = "python -m sparsekit.accel.build"
SK24_MMA = "sk24_mma"
SK24_MMA_SOURCES = ("kernels/mma_sp/csrc/sk24_mma.cu",)
# the functions the loader requires in the file before it opens it (libload)
SK24_MMA_SYMBOLS = ("sk24_mma_launch", "sk24_mma_version", "sk24_mma_e4m3_launch")
ARCH = "sm_90"
CSLT = "cslt_epilogue"
CSLT_MODULE = "sparsekit_cslt_v2"  # the extension's Python module (PyInit_<name>)
CSLT_SOURCES = ("kernels/cusparselt/csrc/cslt_epilogue.cpp",)
CSLT_VERSION = 2
CSLT_SYMBOLS = (f"PyInit_{CSLT_MODULE}",)


def source_hash(sources: tuple[str, ...], root: Path = HERE) -> str:
    """sha256 over the sources (paths relative to ``root``), in order."""
    h = hashlib.sha256()
    for rel in sources:
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return h.hexdigest()


def source_version(root: Path = HERE) -> int:
    """The version ``sk24_mma_version()`` returns in the source."""
    text = (root / SK24_MMA_SOURCES[0]).read_text()
    found = re.search(r"int\s+sk24_mma_version\(\)\s*\{\s*return\s+(\d+)\s*;", text)
    if found is None:
        raise RuntimeError(f"{SK24_MMA_SOURCES[0]}: no sk24_mma_version() in the source")
    return int(found.group(1))


def find_nvcc() -> str | None:
    """nvcc on PATH, else in ``$CUDA_HOME/bin`` (default /usr/local/cuda), else None."""
    found = shutil.which("nvcc")
    if found:
        return found
    cand = Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda") / "bin" / "nvcc"
    return str(cand) if cand.is_file() and os.access(cand, os.X_OK) else None


def gpu_capability() -> tuple[int, int] | None:
    """The first NVIDIA GPU's compute capability from ``nvidia-smi`` (no torch needed), or
    None where there is no driver or GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        res = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    first = res.stdout.strip().splitlines()[:1] if res.returncode == 0 else []
    found = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", first[0]) if first else None
    return (int(found.group(1)), int(found.group(2))) if found else None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(lib_dir: Path) -> dict:
    """The manifest's ``libraries`` (name -> entry), {} where there is none or it is unreadable
    (the loader checks it properly: :mod:`sparsekit.accel.libload`)."""
    try:
        return dict(json.loads((lib_dir / MANIFEST).read_text())["libraries"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _write_manifest(lib_dir: Path, libraries: dict) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=lib_dir)
    with os.fdopen(fd, "w") as f:
        json.dump({"format": 1, "libraries": libraries}, f, indent=1, sort_keys=True)
    os.chmod(tmp, 0o644)
    os.replace(tmp, lib_dir / MANIFEST)


def up_to_date(lib_dir: Path | None = None, name: str = SK24_MMA,
               sources: tuple[str, ...] = SK24_MMA_SOURCES, **extra: str) -> bool:
    """Whether ``lib_dir`` (default the package's ``_lib/``) holds library ``name`` built from
    the current ``sources`` (and with the ``extra`` manifest fields, e.g. the torch version),
    with the hash its manifest records."""
    lib_dir = lib_dir or LIB_DIR
    entry = read_manifest(lib_dir).get(name)
    if not isinstance(entry, dict) or entry.get("source_sha256") != source_hash(sources) or \
            any(entry.get(k) != v for k, v in extra.items()):
        return False
    path = lib_dir / str(entry.get("file", ""))
    return path.is_file() and entry.get("sha256") == _sha256(path)


def build_sk24_mma(lib_dir: Path | None = None, nvcc: str | None = None) -> Path:
    """Compile ``kernels/mma_sp/csrc/sk24_mma.cu`` for sm_90 into ``lib_dir/sk24_mma.so`` (a
    temporary file renamed into place, mode 0755) and record it in the manifest; RuntimeError
    with nvcc's first error line on failure or without nvcc."""
    lib_dir, nvcc = lib_dir or LIB_DIR, nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("no nvcc on PATH or in $CUDA_HOME/bin (install the CUDA toolkit)")
    lib_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(lib_dir, 0o755)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib_dir)
    os.close(fd)
    cmd = [nvcc, "-O3", f"-arch={ARCH}", "-DSK24_ORDERED", "-shared", "-Xcompiler", "-fPIC",
           "-o", tmp, str(HERE / SK24_MMA_SOURCES[0])]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        os.unlink(tmp)
        lines = [ln for ln in res.stderr.splitlines() if "error" in ln.lower()]
        raise RuntimeError(f"nvcc failed: {(lines or res.stderr.splitlines() or ['?'])[0][:300]}")
    os.chmod(tmp, 0o755)
    path = lib_dir / f"{SK24_MMA}.so"
    os.replace(tmp, path)
    record(lib_dir, SK24_MMA, path, SK24_MMA_SOURCES, source_version())
    return path


def cusparselt_dirs() -> tuple[str, str]:
    """(include dir, lib dir) of the cuSPARSELt wheel beside torch (``nvidia/cusparselt*``)."""
    for entry in map(Path, sys.path):
        for base in sorted(entry.glob("nvidia/cusparselt*")):
            if (base / "include" / "cusparseLt.h").exists():
                return str(base / "include"), str(base / "lib")
    raise RuntimeError("no nvidia/cusparselt*/include/cusparseLt.h on sys.path (the "
                       "nvidia-cusparselt wheel torch loads)")


def _torch_versions() -> dict[str, str]:
    import torch

    return {"torch": str(torch.__version__), "torch_cuda": str(torch.version.cuda)}


def build_cslt(lib_dir: Path | None = None) -> Path:
    """Compile sparsekit's cuSPARSELt binding against the installed torch (its C++ extension
    builder, in a temporary directory) into ``lib_dir/sparsekit_cslt_v2.so`` and record it with
    the torch version; RuntimeError naming what failed (no torch, CUDA toolkit or cuSPARSELt
    headers)."""
    lib_dir = lib_dir or LIB_DIR
    try:
        import torch  # noqa: F401  (the extension is built against this torch)
        from torch.utils.cpp_extension import load
    except ImportError as e:
        raise RuntimeError(f"the cuSPARSELt binding builds against torch: {e}") from None
    inc, lib = cusparselt_dirs()
    # CUDA headers from the nvidia wheels where the toolkit lacks one ATen includes
    wheels = Path(inc).parents[1]
    extra = [str(d) for d in sorted(wheels.glob("*/include")) if (d / "cusparse.h").exists()]
    lib_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(lib_dir, 0o755)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            load(name=CSLT_MODULE, sources=[str(HERE / CSLT_SOURCES[0])],
                 extra_include_paths=[inc, *extra], with_cuda=True, verbose=False,
                 build_directory=tmp,
                 extra_ldflags=[f"-L{lib}", "-l:libcusparseLt.so.0", f"-Wl,-rpath,{lib}"])
        except Exception as e:  # noqa: BLE001  (the builder raises many kinds)
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise RuntimeError(f"the cuSPARSELt binding did not build: {first}") from None
        fd, part = tempfile.mkstemp(suffix=".so", dir=lib_dir)
        os.close(fd)
        shutil.copyfile(Path(tmp) / f"{CSLT_MODULE}.so", part)
    os.chmod(part, 0o755)
    path = lib_dir / f"{CSLT_MODULE}.so"
    os.replace(part, path)
    record(lib_dir, CSLT, path, CSLT_SOURCES, CSLT_VERSION, **_torch_versions())
    return path


def record(lib_dir: Path, name: str, path: Path, sources: tuple[str, ...], version: int,
           **extra: str) -> None:
    """Write ``path``'s (a file in ``lib_dir``) sha256, size, the sources' hash and ``version``
    into ``lib_dir``'s manifest under ``name`` (the other entries kept)."""
    libraries = read_manifest(lib_dir)
    libraries[name] = {"file": path.name, "sha256": _sha256(path), "size": path.stat().st_size,
                       "source_sha256": source_hash(sources), "version": version,
                       "arch": ARCH, **extra}
    _write_manifest(lib_dir, libraries)


def install_hook(lib_dir: Path) -> str:
    """What ``pip install`` does (``setup.py``): build the library into ``lib_dir`` where there
    is an sm_90 GPU and nvcc, else build nothing; returns the one line it prints."""
    cap = gpu_capability()
    if cap is None:
        return ("sparsekit: no NVIDIA GPU found, the mma.sp CUDA kernel is not built "
                f"(on a GPU machine: {COMMAND})")
    if cap[0] < 9:
        return (f"sparsekit: GPU compute capability {cap[0]}.{cap[1]}: the mma.sp kernel needs "
                "sm_90, not built")
    nvcc = find_nvcc()
    if nvcc is None:
        return ("sparsekit: GPU found but no CUDA toolkit (nvcc): the mma.sp 2:4 decode kernel "
                f"is not built, the Triton kernels run instead (1.4-3.2x slower); install the "
                f"toolkit and run {COMMAND}")
    try:
        line = f"sparsekit: built the mma.sp CUDA kernel into {build_sk24_mma(lib_dir, nvcc)}"
    except (OSError, RuntimeError) as e:
        return f"sparsekit: the mma.sp kernel did not build ({str(e)[:200]}); retry: {COMMAND}"
    try:
        build_cslt(lib_dir)
        return line + " and the cuSPARSELt binding"
    except (OSError, RuntimeError) as e:
        return f"{line}; not the cuSPARSELt binding ({str(e)[:160]}): {COMMAND} builds it"


def _cslt_current() -> bool:
    try:
        versions = _torch_versions()
    except ImportError:
        return False
    return up_to_date(None, CSLT, CSLT_SOURCES, **versions)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description="Build sparsekit's CUDA libraries "
                                 "(the mma.sp 2:4 kernel for sm_90, the cuSPARSELt binding) into "
                                 "the installed package.")
    ap.add_argument("--check", action="store_true",
                    help="say whether the built libraries are up to date; build nothing")
    ap.add_argument("--force", action="store_true", help="rebuild even when up to date")
    ap.add_argument("--only", choices=("mma", "cslt"), help="build one library only")
    args = ap.parse_args(argv)
    wanted = [(label, current, make) for label, current, make in (
        ("mma", up_to_date, build_sk24_mma), ("cslt", _cslt_current, build_cslt))
        if args.only in (None, label)]
    names = {"mma": "the mma.sp library", "cslt": "the cuSPARSELt binding"}
    rc = 0
    for label, current, make in wanted:
        if args.check or (current() and not args.force):
            ok = current()
            print(f"sparsekit: {names[label]} in {LIB_DIR} is "
                  f"{'up to date' if ok else f'not built or stale (run {COMMAND})'}")
            rc |= not ok
            continue
        try:
            print(f"sparsekit: built {make()}")
        except (OSError, RuntimeError) as e:
            print(f"{COMMAND}: error: {names[label]}: {e}", file=sys.stderr)
            rc = 1
    return rc
